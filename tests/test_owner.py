"""The model's owner: requests hold slots; a batched backend's requests are stepped together on one
thread, other backends' requests run on the owner's worker threads; HTTP threads only wait."""
import threading
import time

import pytest

from disaggregated_inference.backends.base import Event
from disaggregated_inference.errors import BackendUnavailable, Overloaded
from disaggregated_inference.server.owner import ModelOwner


class FakeBackend:
    """Records which thread ran each call; ``gate`` holds a job until released."""

    slots = 1

    def __init__(self, load_delay=0.0, fail_load=False):
        self.load_delay, self.fail_load = load_delay, fail_load
        self.threads, self.gate = [], threading.Event()
        self.gate.set()
        self.closed = False

    def load(self, progress):
        progress("loading fake weights")
        time.sleep(self.load_delay)
        if self.fail_load:
            raise RuntimeError("weights are corrupt")

    def work(self, value):
        self.threads.append(threading.current_thread().name)
        self.gate.wait(5)
        return value * 2

    def tokens(self, n, cancelled):
        for i in range(n):
            if cancelled():
                return
            self.threads.append(threading.current_thread().name)
            yield Event(piece=str(i))
            time.sleep(0.01)
        yield Event(metrics={"n": n})

    def close(self):
        self.closed = True


def loaded(owner: ModelOwner, timeout: float = 5.0) -> ModelOwner:
    """``owner`` once its load has ended, ready or failed (on its own thread: not at once on a busy machine)."""
    deadline = time.time() + timeout
    while owner.state == "loading" and time.time() < deadline:
        time.sleep(0.01)
    return owner


def ready_owner(backend, **kw) -> ModelOwner:
    return loaded(ModelOwner(backend, **kw))


def test_calls_run_on_the_owner_thread_not_the_caller():
    backend = FakeBackend()
    owner = ready_owner(backend)
    assert owner.call(lambda b: b.work(21)) == 42
    assert backend.threads == ["model-worker-0"]
    owner.close()


def test_loading_and_failed_models_answer_503_with_the_reason():
    slow = ModelOwner(FakeBackend(load_delay=0.5))
    with pytest.raises(BackendUnavailable, match="still loading") as info:
        slow.call(lambda b: b.work(1))
    assert info.value.details["retry_after"] == 5
    broken = loaded(ModelOwner(FakeBackend(fail_load=True)))
    assert broken.state == "failed" and "weights are corrupt" in broken.error
    with pytest.raises(BackendUnavailable, match="failed to load: RuntimeError: weights are corrupt"):
        broken.call(lambda b: b.work(1))


def test_work_not_picked_up_in_time_is_dropped_with_overloaded():
    backend = FakeBackend()
    owner = ready_owner(backend, queue_timeout=0.2)
    backend.gate.clear()  # the first job blocks the owner thread
    first = threading.Thread(target=lambda: owner.call(lambda b: b.work(1)))
    first.start()
    time.sleep(0.05)
    started = time.monotonic()
    with pytest.raises(Overloaded, match="no slot of 1 came free within 0.2s") as info:
        owner.call(lambda b: b.work(2))
    assert info.value.details["retry_after"] == 1
    assert time.monotonic() - started < 1.0
    backend.gate.set()
    first.join()
    assert owner.call(lambda b: b.work(3)) == 6
    assert len(backend.threads) == 2  # the dropped job never ran
    owner.close()


def test_streams_yield_in_order_and_closing_early_cancels_the_job():
    backend = FakeBackend()
    owner = ready_owner(backend)
    events = list(owner.stream(lambda b, cancelled: b.tokens(5, cancelled)))
    assert [e.piece for e in events[:-1]] == ["0", "1", "2", "3", "4"] and events[-1].metrics == {"n": 5}
    backend.threads.clear()
    stream = owner.stream(lambda b, cancelled: b.tokens(1000, cancelled))
    next(stream)
    stream.close()
    time.sleep(0.1)
    produced = len(backend.threads)
    assert produced < 1000
    assert owner.call(lambda b: b.work(5)) == 10  # the owner is free again


def test_errors_raised_by_the_backend_reach_the_caller():
    owner = ready_owner(FakeBackend())

    def boom(backend):
        raise ValueError("bad tokens")

    with pytest.raises(ValueError, match="bad tokens"):
        owner.call(boom)
    assert owner.call(lambda b: b.work(4)) == 8


def test_a_full_queue_is_refused_at_once_and_the_server_keeps_serving():
    backend = FakeBackend()
    owner = ready_owner(backend, queue_timeout=5, max_queue=1)
    backend.gate.clear()
    running = threading.Thread(target=lambda: owner.call(lambda b: b.work(1)))
    running.start()
    time.sleep(0.05)
    waiting = threading.Thread(target=lambda: owner.call(lambda b: b.work(2)))
    waiting.start()
    time.sleep(0.05)
    assert owner.slot_stats()["busy"] == 1 and owner.queued == 1
    started = time.monotonic()
    with pytest.raises(Overloaded, match="1 requests already wait for one of 1 slots"):
        owner.call(lambda b: b.work(3))
    assert time.monotonic() - started < 0.5  # not after queue_timeout
    backend.gate.set()
    running.join()
    waiting.join()
    assert owner.call(lambda b: b.work(4)) == 8
    assert owner.slot_stats()["busy"] == 0


class BatchedFake:
    """A batched backend: requests are generators yielding Evals; evaluate() records each step's batch."""

    batched = True
    slots = 4

    def __init__(self):
        self.steps, self.free = [], [3, 2, 1, 0]

    def load(self, progress):
        pass

    def close(self):
        pass

    def evaluate(self, evals, waiting=0):
        self.steps.append(sorted(e.seq for e in evals))
        for ev in evals:
            ev.done = len(ev.tokens)
            ev.row = ev.seq
        return len(evals)

    def count(self, n, cancelled):
        from disaggregated_inference.backends.base import Eval

        seq = self.free.pop()
        try:
            for i in range(n):
                ev = Eval(seq, [i], i)
                yield ev
                yield Event(piece=f"{seq}:{ev.row}")
            yield Event(metrics={"seq": seq})
        finally:
            self.free.append(seq)


def test_a_batched_backend_steps_every_active_request_in_one_batch():
    backend = BatchedFake()
    owner = ready_owner(backend)
    a = owner.stream(lambda b, cancelled: b.count(50, cancelled))
    b_ = owner.stream(lambda b, cancelled: b.count(50, cancelled))
    got_a, got_b = list(a), list(b_)
    assert len(got_a) == len(got_b) == 51
    seq_a, seq_b = got_a[-1].metrics["seq"], got_b[-1].metrics["seq"]
    assert seq_a != seq_b
    assert [e.piece for e in got_a[:-1]] == [f"{seq_a}:{seq_a}"] * 50  # each got its own row back
    assert any(step == sorted([seq_a, seq_b]) for step in backend.steps)  # both advanced in one step
    assert sorted(backend.free) == [0, 1, 2, 3] and owner.slot_stats()["busy"] == 0


def test_each_step_is_told_how_many_requests_wait_for_a_slot():
    """Speculation weighs drafts otherwise when no request waits (``speculate.shares``)."""
    backend = BatchedFake()
    seen = []
    step = backend.evaluate
    backend.evaluate = lambda evals, waiting=0: (seen.append(waiting), step(evals))[1]
    owner = ready_owner(backend)
    held = [owner.reserve() for _ in range(BatchedFake.slots - 1)]
    running = owner.stream(lambda b, cancelled: b.count(10**7, cancelled))
    waiter = threading.Thread(target=lambda: owner.reserve().release())
    waiter.start()
    deadline = time.time() + 5
    while owner.queued < 1 and time.time() < deadline:
        time.sleep(0.001)
    assert owner.queued == 1
    n = len(seen)
    while len(seen) < n + 5 and time.time() < deadline:
        time.sleep(0.001)
    for h in held:
        h.release()
    waiter.join(5)
    n = len(seen)
    while len(seen) < n + 5 and time.time() < deadline:
        time.sleep(0.001)
    running.close()
    assert 1 in seen and seen[-1] == 0  # one waited while the others were held; none once it had its slot


def test_a_cancelled_batched_stream_frees_its_slot_and_sequence():
    backend = BatchedFake()
    owner = ready_owner(backend)
    stream = owner.stream(lambda b, cancelled: b.count(10_000, cancelled))
    next(stream)
    stream.close()
    deadline = time.time() + 5
    while (owner.slot_stats()["busy"] or len(backend.free) < 4) and time.time() < deadline:
        time.sleep(0.01)
    assert owner.slot_stats()["busy"] == 0 and sorted(backend.free) == [0, 1, 2, 3]
    assert len(backend.steps) < 10_000


def test_a_parked_request_lets_the_others_step_and_goes_on_once_woken():
    from disaggregated_inference.backends.base import Eval, Wait

    backend, arrived = BatchedFake(), threading.Event()

    def waiting(b, cancelled):  # a decode whose streamed KV is still on its way
        yield Wait(arrived.is_set)
        ev = Eval(9, [1], 0)
        yield ev
        yield Event(metrics={})

    owner = ready_owner(backend)
    parked = owner.stream(waiting)
    other = list(owner.stream(lambda b, cancelled: b.count(20, cancelled)))  # steps while the first waits
    assert len(other) == 21 and all(9 not in step for step in backend.steps)
    idle = len(backend.steps)
    time.sleep(0.3)
    assert len(backend.steps) == idle  # parked alone: no stepping, no spinning
    arrived.set()
    owner.wake()
    assert len(list(parked)) == 1
    assert len(backend.steps) == idle + 1 and backend.steps[-1] == [9]  # its own step, once it went on
    assert owner.slot_stats()["busy"] == 0


class TimedFake(BatchedFake):
    """Each step takes ``step_s``; each request's token loop works ``work_s`` between its steps."""

    def __init__(self, step_s=0.02, work_s=0.01):
        super().__init__()
        self.step_s, self.work_s = step_s, work_s

    def evaluate(self, evals, waiting=0):
        time.sleep(self.step_s)
        return super().evaluate(evals, waiting)

    def count(self, n, cancelled):
        for event in super().count(n, cancelled):
            if not hasattr(event, "tokens"):
                time.sleep(self.work_s)  # sampling and the rest, on the owner thread between two steps
            yield event

    def set_threads(self, threads, shared=False):
        pass


def test_each_step_reports_its_seconds_and_the_owners_seconds_since_the_last():
    backend, seen = TimedFake(step_s=0.02, work_s=0.01), []
    owner = ready_owner(backend)
    owner.on_step = lambda sequences, tokens, seconds, between: seen.append((seconds, between))
    assert len(list(owner.stream(lambda b, cancelled: b.count(5, cancelled)))) == 6
    assert len(seen) == 5
    assert seen[0][1] is None  # the first step after the owner had nothing to step
    assert all(seconds >= 0.02 for seconds, _ in seen)
    assert all(between >= 0.01 for _, between in seen[1:])
    time.sleep(0.2)  # idle between two requests: not time between steps
    assert len(list(owner.stream(lambda b, cancelled: b.count(2, cancelled)))) == 3
    assert seen[5][1] is None and seen[6][1] >= 0.01


def test_a_wait_for_the_cores_share_is_not_time_between_steps():
    class SlowCores:  # another server's step holds more than its share: this one waits before each of its own
        def threads(self):
            time.sleep(0.2)
            return 2

        def sharing(self):
            return False

        def stepped(self, threads, wall, cpu):
            pass

        def idle(self):
            pass

        def busy_peers(self):
            return False

        def close(self):
            pass

    backend, seen = TimedFake(step_s=0.01, work_s=0.0), []
    owner = ready_owner(backend, cores=SlowCores())
    owner.on_step = lambda sequences, tokens, seconds, between: seen.append(between)
    assert len(list(owner.stream(lambda b, cancelled: b.count(4, cancelled)))) == 5
    assert len(seen) == 4 and seen[0] is None
    assert all(between < 0.15 for between in seen[1:])  # each step came 0.2 s after the last: all of it waiting


def test_a_parked_request_that_is_cancelled_frees_its_slot():
    from disaggregated_inference.backends.base import Wait

    backend, cleaned = BatchedFake(), []

    def waiting(b, cancelled):
        try:
            yield Wait(lambda: False)
        finally:
            cleaned.append(True)

    owner = ready_owner(backend)
    stream = owner.stream(waiting)
    time.sleep(0.1)
    stream.close()
    owner.wake()
    deadline = time.time() + 5
    while (owner.slot_stats()["busy"] or not cleaned) and time.time() < deadline:
        time.sleep(0.01)
    assert cleaned == [True] and owner.slot_stats()["busy"] == 0


def test_a_freed_slot_goes_to_the_longest_waiter_not_to_a_newcomer():
    # threading.Semaphore lets a request arriving just after a release take the slot from the waiter
    # it woke, which then queues again at the back
    owner = ready_owner(FakeBackend())
    held = owner.reserve()
    order = []

    def wait_in_line(name):
        reservation = owner.reserve()
        order.append(name)
        reservation.release()

    first = threading.Thread(target=wait_in_line, args=("first",))
    first.start()
    deadline = time.time() + 5
    while owner.queued < 1 and time.time() < deadline:
        time.sleep(0.001)
    assert owner.queued == 1
    held.release()
    newcomer = owner._free.acquire(timeout=0)  # arrives between the release and the waiter's wake-up
    first.join(5)
    assert newcomer is False and order == ["first"]

    held = owner.reserve()  # several waiters are served in the order they came
    threads = [threading.Thread(target=wait_in_line, args=(f"w{i}",)) for i in range(4)]
    for i, t in enumerate(threads):
        t.start()
        while owner.queued < i + 1 and time.time() < deadline:
            time.sleep(0.001)
    held.release()
    for t in threads:
        t.join(5)
    assert order == ["first", "w0", "w1", "w2", "w3"]


def test_a_waiter_whose_time_runs_out_leaves_the_line():
    owner = ready_owner(FakeBackend(), queue_timeout=0.05)
    held = owner.reserve()
    with pytest.raises(Overloaded):
        owner.reserve()
    held.release()
    again = owner.reserve()  # the slot is free, not promised to the waiter that gave up
    assert owner.slot_stats()["busy"] == 1
    again.release()


class CalibratingFake(BatchedFake):
    """Records each ``calibrate`` (the thread, whether a request waited by its end); wants ``wants`` of them."""

    def __init__(self, wants=2, takes=0.0):
        super().__init__()
        self.calibrations, self.wants, self.takes = [], wants, takes

    def calibrate(self, interrupted):
        deadline = time.monotonic() + self.takes
        while time.monotonic() < deadline and not interrupted():
            time.sleep(0.005)
        self.calibrations.append((threading.current_thread().name, interrupted()))
        return len(self.calibrations) < self.wants


def test_an_idle_owner_calibrates_its_backend_until_it_wants_no_more(monkeypatch):
    from disaggregated_inference.server import owner as owner_module

    monkeypatch.setattr(owner_module, "CALIBRATE_AFTER_IDLE", (0.05, 0.05, 0.05, 0.05))
    backend = CalibratingFake(wants=2)
    owner = ready_owner(backend)
    try:
        deadline = time.time() + 10
        while len(backend.calibrations) < 2 and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(2.5)  # two delays of up to 1.05 s (jittered): the backend said no more after its second
        assert [name for name, _ in backend.calibrations] == ["model-owner", "model-owner"]
    finally:
        owner.close()


def test_an_idle_owner_goes_on_asking_after_its_schedule_while_the_backend_wants_more(monkeypatch):
    """A decode server whose measurements all ran beside other programs' work (a benchmark's llama-servers
    warming up) has no step cost and drafts nothing: the owner asks again after the schedule's last delay
    for as long as the backend wants, not only as many times as the schedule has delays."""
    from disaggregated_inference.server import owner as owner_module

    monkeypatch.setattr(owner_module, "CALIBRATE_AFTER_IDLE", (0.05,))
    backend = CalibratingFake(wants=3)
    owner = ready_owner(backend)
    try:
        deadline = time.time() + 10
        while len(backend.calibrations) < 3 and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(1.2)  # one more delay of up to 1.05 s (jittered): the backend said no more after its third
        assert [name for name, _ in backend.calibrations] == ["model-owner"] * 3
    finally:
        owner.close()


def test_a_request_that_comes_during_a_calibration_stops_it(monkeypatch):
    from disaggregated_inference.server import owner as owner_module

    monkeypatch.setattr(owner_module, "CALIBRATE_AFTER_IDLE", (0.05,))
    backend = CalibratingFake(wants=5, takes=30.0)
    owner = ready_owner(backend)
    try:
        time.sleep(0.3)  # the calibration is under way
        started = time.monotonic()
        got = list(owner.stream(lambda b, cancelled: b.count(3, cancelled)))
        assert len(got) == 4 and time.monotonic() - started < 5
        assert backend.calibrations == [("model-owner", True)]
    finally:
        owner.close()

