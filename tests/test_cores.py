"""Servers on one machine share its cores (server/cores.py): the share, the board, the owner's use of it."""
import os
import subprocess
import sys
import threading
import time

import pytest

from disaggregated_inference.server import cores
from disaggregated_inference.server.cores import CoreShare, thread_share
from disaggregated_inference.server.owner import ModelOwner


@pytest.mark.parametrize("cores_, mine, others, expected", [
    (2, 2, [], 2),          # alone: every configured thread (the engine's speed, spinning)
    (2, 2, [2], 1),         # two busy on two cores: one thread each, no barrier to wait at
    (2, 2, [2, 2, 2], 1),   # four busy: still one each (never 0)
    (2, 1, [1], 1),         # already fits
    (4, 2, [2], 2),         # fits: nobody gives anything up
    (16, 8, [8, 8, 8], 4),  # four servers of 8 on 16 cores: 4 each
    (16, 8, [8, 8], 5),     # three: 5 + 5 + 5 <= 16 (rounded down, never more than the cores)
    (16, 12, [4], 12),      # fits
    (16, 12, [8], 9),       # 20 wanted on 16: 9 + 6 (the other's share) = 15
])
def test_the_share_of_the_cores(cores_, mine, others, expected):
    assert thread_share(cores_, mine, others) == expected
    shares = [thread_share(cores_, t, [o for j, o in enumerate([mine, *others]) if j != i])
              for i, t in enumerate([mine, *others])]
    assert sum(shares) <= max(cores_, len(shares))  # together never more than the cores (or one each)


@pytest.fixture
def board(tmp_path):
    return tmp_path / "cores.board"


def test_servers_of_a_group_take_their_share_while_the_others_are_busy(board):
    a, b = (CoreShare("cluster-1", 2, cores=2, path=board) for _ in range(2))
    other = CoreShare("cluster-2", 2, cores=2, path=board)  # another cluster on the machine: not counted
    try:
        assert a.slot != b.slot != other.slot
        other.threads()
        assert a.threads() == 2  # b idle: all of a's threads
        assert b.threads() == 1 and a.threads() == 1  # both busy: one each
        assert a.busy_peers() == 1
        b.idle()
        assert a.threads() == 2
        b.close()  # a closed slot is free again
        c = CoreShare("cluster-1", 2, cores=2, path=board)
        assert c.slot == b.slot
        c.close()
    finally:
        for share in (a, other):
            share.close()


def test_a_dead_servers_busy_slot_is_ignored_and_then_taken_over(board):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # a process that has exited
    alive = CoreShare("cluster-1", 2, cores=2, path=board)  # slot 0
    with open(board, "r+b") as f:  # slot 1: left busy by a server killed mid-step
        f.seek(1 * cores.FIELDS * 8)
        f.write(b"".join(v.to_bytes(8, "little") for v in (pid, cores.group_tag("cluster-1"), 2, 1)))
    try:
        assert alive.threads() == 2  # the dead one's busy flag counts for nothing
        share = CoreShare("cluster-1", 2, cores=2, path=board)
        assert share.slot == 1  # and its slot is the first free one
        share.close()
    finally:
        alive.close()


def test_the_board_is_shared_between_processes(board):
    """Another process marks itself busy on the same board: this one takes its share."""
    script = ("import sys, time; from disaggregated_inference.server.cores import CoreShare; "
              f"s = CoreShare('g', 2, cores=2, path={str(board)!r}); s.threads(); print('busy', flush=True); "
              "sys.stdin.readline(); s.idle(); print('idle', flush=True); sys.stdin.readline(); s.close()")
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    share = CoreShare("g", 2, cores=2, path=board)
    try:
        assert proc.stdout.readline().strip() == "busy"
        assert share.threads() == 1
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "idle"
        assert share.threads() == 2
    finally:
        proc.stdin.write("\n")
        proc.stdin.close()
        proc.wait(10)
        share.close()


class ThreadedFake:
    """A batched backend recording the thread count of every step; ``hold`` keeps a request going."""

    batched = True
    slots = 2

    def __init__(self):
        self.steps, self.set_to, self.hold = [], [], threading.Event()
        self.threads = None

    def load(self, progress):
        pass

    def close(self):
        pass

    def set_threads(self, n, shared=False):
        self.set_to.append((n, shared))
        self.threads = n

    def evaluate(self, evals, waiting=0):
        self.steps.append(self.threads)
        for ev in evals:
            ev.done, ev.row = len(ev.tokens), 0
        time.sleep(0.002)
        return len(evals)

    def run_until_released(self, cancelled):
        from disaggregated_inference.backends.base import Eval, Event

        i = 0
        while not self.hold.is_set() and i < 5000:
            yield Eval(0, [1], i)
            i += 1
        yield Event(metrics={"steps": i})


def _ready(owner):
    deadline = time.time() + 5
    while not owner.ready and time.time() < deadline:
        time.sleep(0.01)
    return owner


def _wait_for(condition, timeout=10.0):
    deadline = time.time() + timeout
    while not condition() and time.time() < deadline:
        time.sleep(0.005)
    return condition()


def test_owners_sharing_a_machine_step_with_their_share_and_take_it_all_back(board, monkeypatch):
    monkeypatch.setattr(cores.Contention, "COLLAPSED", 0.0)  # the fake's steps sleep: off CPU, not contended
    first, second = ThreadedFake(), ThreadedFake()
    owners = [_ready(ModelOwner(b, cores=CoreShare("g", 2, cores=2, path=board))) for b in (first, second)]
    try:
        a = owners[0].stream(lambda b, cancelled: b.run_until_released(cancelled))
        assert _wait_for(lambda: first.steps and first.steps[-1] == 2)  # alone: both threads
        b = owners[1].stream(lambda b, cancelled: b.run_until_released(cancelled))
        assert _wait_for(lambda: first.steps[-1] == 1 and second.steps and second.steps[-1] == 1)  # one each
        second.hold.set()
        list(b)
        assert owners[1].cores.busy_peers() == 1 and not owners[1].cores._busy  # idle once its request ended
        assert _wait_for(lambda: first.steps[-1] == 2)  # the first takes both back
        first.hold.set()
        list(a)
        # set only when the share changes; shared from the moment the other computed, for SHARING_SECONDS after
        assert first.set_to[:3] == [(2, False), (1, True), (2, True)] and owners[0].compute_threads == 2
        assert all(x != y for x, y in zip(first.set_to, first.set_to[1:])) and len(first.set_to) <= 4
    finally:
        for owner in owners:
            owner.shutdown()
    assert all(owner.cores._map is None for owner in owners)  # the slots were given back


def test_steps_kept_off_the_cpu_by_other_work_drop_to_one_thread_for_a_while():
    c = cores.Contention()

    def steps(start, n, on_cpu, threads=2):  # n steps of 10 ms from ``start``, on a CPU ``on_cpu`` of the time
        for i in range(n):
            c.observe(threads, 0.010, 0.010 * on_cpu, now=start + i * 0.01)

    steps(0.0, 50, 0.98)  # a free machine: the stepping thread is on a CPU all the time
    assert not c.holds(0.5)
    steps(0.5, 5, 0.1, threads=1)  # one thread: no barrier, nothing to learn
    c.observe(2, 0.0005, 0.0, now=0.6)  # a step too short to say anything
    steps(1.0, 5, 0.6)  # other work on the machine, but the stepping thread mostly runs: no hold
    steps(1.05, 1, 0.1)
    steps(1.06, 1, 0.6)  # one collapsed step between others is not enough
    steps(1.07, 1, 0.1)
    assert not c.holds(1.08)
    steps(1.08, 1, 0.1)  # two in a row are: one thread for 2 s, then all again
    assert c.holds(1.09) and c.holds(3.0) and not c.holds(3.1)
    steps(3.1, 2, 0.05)  # still collapsed: the hold doubles
    assert c.holds(7.0) and not c.holds(7.2)
    steps(7.2, 60, 0.5)  # neither collapsed nor free for long: the hold keeps growing
    steps(7.8, 2, 0.05)
    assert c.holds(15.7) and not c.holds(15.9)
    steps(16.0, 300, 0.97)  # then the cores stay free for 3 s
    steps(19.0, 2, 0.05)
    assert c.holds(20.9) and not c.holds(21.1)  # the next hold starts short again
    assert c.count == 4


def test_the_cores_count_as_shared_for_a_while_after_a_peer_was_seen_computing(board, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(cores.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(cores, "DEFER_SECONDS", 0.0)  # the clock stands still: no waiting for a's step
    a, b = (CoreShare("g", 2, cores=2, path=board) for _ in range(2))
    try:
        assert a.threads() == 2 and not a.sharing()  # alone
        b.threads()
        clock[0] += 0.1
        assert a.threads() == 1 and a.sharing() and a.describe()["sharing"]
        b.idle()
        clock[0] += cores.SHARING_SECONDS - 0.2
        assert a.threads() == 2 and a.sharing()  # all its threads again, but the peer may be back at any moment
        clock[0] += 0.2
        assert not a.sharing()
    finally:
        a.close()
        b.close()


def test_a_server_that_becomes_busy_waits_for_a_peers_step_that_holds_more_than_its_share(board, monkeypatch):
    monkeypatch.setattr(cores, "DEFER_SECONDS", 0.3)
    a, b = (CoreShare("g", 2, cores=2, path=board) for _ in range(2))
    try:
        assert a.threads() == 2  # a step under way with both cores: b idle
        threading.Timer(0.1, a.threads).start()  # a's next step: b busy, so one thread
        started = time.monotonic()
        assert b.threads() == 1
        waited = time.monotonic() - started
        assert 0.08 <= waited < 0.3 and b.deferred == pytest.approx(waited, abs=0.01)
        assert a.describe()["threads"] == 2 and a._busy == 1
        started = time.monotonic()
        assert b.threads() == 1 and time.monotonic() - started < 0.05  # a holds its share: nothing to wait for
        a.idle()
        b.idle()
        assert a.threads() == 2  # and then a step that outlasts the wait (a peer stuck in it)
        started = time.monotonic()
        assert b.threads() == 1 and 0.3 <= time.monotonic() - started < 0.5
        started = time.monotonic()
        assert b.threads() == 1 and time.monotonic() - started < 0.05  # no more waiting for a while
    finally:
        a.close()
        b.close()


def test_a_contended_server_takes_one_thread_whatever_its_share(board):
    share = CoreShare("g", 2, cores=2, path=board)
    try:
        assert share.threads() == 2
        for _ in range(2):  # two collapsed steps
            share.stepped(2, 0.010, 0.0005)
        assert share.threads() == 1
        facts = share.describe()
        assert facts["contended"] and facts["contended_holds"] == 1 and facts["threads"] == 2
    finally:
        share.close()


def test_for_server_needs_a_group_and_a_batched_backend_that_sets_threads(board, monkeypatch):
    from disaggregated_inference.server.settings import ServerSettings

    monkeypatch.setenv("DISAGG_CORE_BOARD", str(board))
    grouped = ServerSettings(name="a", core_group="g")
    assert cores.for_server(ServerSettings(name="a"), ThreadedFake()) is None  # no group: nothing shared
    assert cores.for_server(grouped, object()) is None  # a backend that cannot change its threads
    share = cores.for_server(grouped, ThreadedFake())
    try:
        assert isinstance(share, CoreShare) and share.path == board
    finally:
        share.close()
    monkeypatch.setenv("DISAGG_CORE_BOARD", str(board.parent / "missing" / "board"))
    assert cores.for_server(grouped, ThreadedFake()) is None  # no board to be had: computes unshared, logged


def test_llama_cpp_computes_with_the_threads_it_is_given(tmp_path):
    """The real engine: ``set_threads`` changes the count llama.cpp computes the next step with, and the
    canary names it."""
    from disaggregated_inference.backends import ModelSettings, create
    from disaggregated_inference.backends.base import Prompt
    from tests.tiny_models import tiny_gguf

    import llama_cpp

    backend = create(ModelSettings(model=str(tiny_gguf("qwen3moe")), n_threads=2, n_ctx=512, parallel=1))
    backend.load()
    try:
        assert llama_cpp.llama_n_threads(backend.ctx.ctx) == 2
        backend.set_threads(1)
        assert (llama_cpp.llama_n_threads(backend.ctx.ctx), llama_cpp.llama_n_threads_batch(backend.ctx.ctx)) == (1, 1)
        _, prefilled = backend.run(backend.prefill(Prompt(text="one two three four", raw=True)))
        assert prefilled.meta["canary"]["threads"] == 1
    finally:
        backend.close()
