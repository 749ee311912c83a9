"""Servers on one machine share its cores: each computes with its share of them while the others are busy.

llama.cpp's CPU threads meet at a barrier after every op of the graph (hundreds per step). A
thread that spins there keeps a decode step at the engine's speed when its partner runs on
another core, and wastes its core when the partner is waiting for one: four servers of two
threads each on two cores collapsed when they spun, and slept their way to a quarter of the
engine's speed when one request ran alone (docs/benchmarks.md, "Against llama.cpp's own server").
Neither wait policy is right for both; the thread count is. With ``n_threads`` 1 ggml runs no
parallel region at all (no barrier to wait at), and llama.cpp reads the count at every step
(``llama_set_n_threads``).

So the servers of a cluster that share a machine publish on a board (a small shared-memory file
of slots: pid, group, threads wanted, threads of the step under way) whether they are computing,
and before every step each takes ``thread_share`` of the machine's cores: all its configured threads
while the busy servers' threads fit the cores, its proportional share (at least one) when they do
not. One server busy runs at the engine's speed with spinning threads; two busy on two cores run one
thread each, side by side, with no barrier to wait at.

A step keeps the count it started with. A server that becomes busy while a peer's step holds more
than its share waits for that step to end (``CoreShare.threads``), and while the cores are shared
the llama.cpp backend cuts prompt chunks into short steps (``llama_slots.SHARED_PIECE``), so that
neither that wait nor a step started at one thread after the peer went idle lasts long.

The board is one file per user on a RAM file system (``/dev/shm`` where there is one); a slot is
claimed under ``flock`` and tagged with the cluster's group (``ServerSettings.core_group``), so
servers of other clusters on the machine neither count nor are counted; a slot whose process
died is taken over, and a dead process's busy flag is ignored. Reads are plain memory reads:
a step costs a few microseconds of bookkeeping.

Other programs on the machine are not on the board. A server whose own multi-threaded steps
collapse (its stepping thread off a CPU most of the step: the partner it waits for has no core)
computes with one thread for a while (``Contention``).

A thread count also changes llama.cpp's CPU numerics past a few hundred cells (attention splits a
query's cells across threads): the backend names the count a canary was computed with, and a
check against another count uses the same-engine tolerance (kv/canary.py).
"""
from __future__ import annotations

import hashlib
import logging
import mmap
import os
import tempfile
import time
from pathlib import Path

from ..tuning import STEP_ON_CPU
from .settings import engine_threads

log = logging.getLogger(__name__)

SLOTS = 128
FIELDS = 4  # pid, group tag, threads wanted, busy: the threads of its step under way, 0 when idle (int64 each)
PID, GROUP, WANT, BUSY = range(FIELDS)
LIVENESS_SECONDS = 1.0  # how long a peer's "alive" answer is trusted
RESCAN_SECONDS = 1.0  # how often the board is scanned for the group's members
SHARING_SECONDS = 2.0  # a peer seen computing this recently: the cores count as shared (``CoreShare.sharing``)
DEFER_SECONDS = 0.5  # the longest a server waits for a peer's step that holds more than its share (``threads``)
DEFER_OFF_SECONDS = 5.0  # after a wait that ran out: how long a server computes without waiting


def thread_share(cores: int, mine: int, others: list[int]) -> int:
    """Compute threads for a server configured with ``mine`` while servers wanting ``others`` threads
    compute beside it on ``cores`` cores: ``mine`` when all fit, else its proportional share of the
    cores, rounded down (so the shares never add up to more than the cores), at least 1."""
    total = mine + sum(others)
    if total <= cores:
        return mine
    return max(1, cores * mine // total)


def machine_cores() -> int:
    """Cores this process may run on (its CPU affinity where the platform says, else every core)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def group_tag(group: str) -> int:
    """A nonzero 63-bit tag for a group name (0 marks a free slot's group)."""
    return int.from_bytes(hashlib.sha256(group.encode()).digest()[:8], "little") >> 1 or 1


def default_board_path() -> Path:
    """One board per user: ``DISAGG_CORE_BOARD``, else in ``/dev/shm`` (RAM) or the temp directory."""
    if os.environ.get("DISAGG_CORE_BOARD"):
        return Path(os.environ["DISAGG_CORE_BOARD"])
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else \
        Path(tempfile.gettempdir())
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return base / f"disagg-cores-{uid}.board"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class Contention:
    """Whether other programs hold the cores a server's threads need, judged from its own steps.

    The board keeps the servers of a cluster from outnumbering the cores; other programs on the
    machine can still do it, and a thread that spins at a barrier while its partner waits for a core
    wastes its own. The thread that runs a step computes or spins through the whole step while it
    has a core; a step it spent less than ``COLLAPSED`` of on a CPU collapsed (it spun, then slept
    until its partner got a core). After ``STEPS`` such multi-threaded steps in a row the server
    computes with one thread, which has no barrier to wait at, for ``hold`` seconds, then tries all
    its threads again; the hold doubles (to ``HOLD_MAX``) each time the try collapses too, and starts
    again from ``HOLD_MIN`` once the steps have run on a CPU ``FREE`` of their time for ``HOLD_MIN``.
    """

    COLLAPSED, FREE = 0.4, STEP_ON_CPU
    STEPS = 2
    HOLD_MIN, HOLD_MAX = 2.0, 32.0
    MIN_STEP = 0.001  # shorter steps say too little

    def __init__(self):
        self.collapsed = 0  # collapsed steps in a row
        self.until = 0.0  # one thread until then
        self.hold = self.HOLD_MIN
        self.free_since: float | None = None
        self.count = 0  # holds so far

    def holds(self, now: float) -> bool:
        return now < self.until

    def observe(self, threads: int, wall: float, cpu: float, now: float) -> None:
        if threads <= 1 or wall < self.MIN_STEP:
            return
        on_cpu = cpu / wall
        if on_cpu >= self.FREE:
            self.free_since = self.free_since or now
            if now - self.free_since > self.HOLD_MIN:  # the cores stayed free: the next hold starts short
                self.hold = self.HOLD_MIN
        else:
            self.free_since = None
        self.collapsed = self.collapsed + 1 if on_cpu < self.COLLAPSED else 0
        if self.collapsed >= self.STEPS:
            self.until, self.collapsed = now + self.hold, 0
            self.hold = min(2 * self.hold, self.HOLD_MAX)
            self.count += 1
            log.info("other work holds the cores: computing with one thread for %.0f s", self.until - now)


class CoreShare:
    """This server's slot on the board of its machine; ``threads()`` before each step, ``idle()`` when
    it has nothing to compute. ``close()`` frees the slot."""

    def __init__(self, group: str, threads: int, cores: int | None = None, path: Path | None = None,
                 pid: int | None = None):
        import fcntl

        self.group, self.tag, self.wanted = group, group_tag(group), max(1, threads)
        self.cores = cores or machine_cores()
        self.pid = pid or os.getpid()
        self.path = Path(path or default_board_path())
        size = SLOTS * FIELDS * 8
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if os.fstat(fd).st_size < size:
                    os.ftruncate(fd, size)
                self._map = mmap.mmap(fd, size)
                self._board = memoryview(self._map).cast("q")
                self.slot = self._claim()
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        self._busy = 0  # the threads this server's step under way computes with, as the board says; 0: idle
        self.contention = Contention()
        self.deferred = 0.0  # seconds spent waiting for peers' steps to end (``threads``)
        self._defer_off_until = 0.0
        self._members: list[int] = []
        self._scanned_at = -RESCAN_SECONDS
        self._alive: dict[int, tuple[bool, float]] = {}
        self._peer_busy_at = -SHARING_SECONDS

    def _claim(self) -> int:
        """A free slot (or one whose process is gone), under the board's lock."""
        b = self._board
        for slot in range(SLOTS):
            pid = b[slot * FIELDS + PID]
            if pid == 0 or not _alive(pid):
                base = slot * FIELDS
                b[base + BUSY] = 0
                b[base + WANT] = self.wanted
                b[base + GROUP] = self.tag
                b[base + PID] = self.pid
                return slot
        raise RuntimeError(f"every one of the {SLOTS} slots of {self.path} is held by a running process")

    def _peers_wanting(self, now: float) -> list[int]:
        """Threads wanted by the other busy, living servers of this group."""
        return [want for want, _ in self._busy_peers(now)]

    def _busy_peers(self, now: float) -> list[tuple[int, int]]:
        """(threads wanted, threads of the step under way) of the other busy, living servers of this group."""
        b = self._board
        if now - self._scanned_at >= RESCAN_SECONDS:
            self._members = [s for s in range(SLOTS)
                             if s != self.slot and b[s * FIELDS + GROUP] == self.tag and b[s * FIELDS + PID]]
            self._scanned_at = now
        out = []
        for s in self._members:
            base = s * FIELDS
            if b[base + BUSY] and b[base + GROUP] == self.tag:
                pid = b[base + PID]
                alive, at = self._alive.get(pid, (True, -LIVENESS_SECONDS))
                if now - at >= LIVENESS_SECONDS:
                    alive = _alive(pid)
                    self._alive[pid] = (alive, now)
                if alive:
                    out.append((b[base + WANT], b[base + BUSY]))
        return out

    def threads(self) -> int:
        """Mark this server busy; the compute threads its next step should use.

        A peer whose step started while this server was idle computes it with more than its share of the
        cores now; threads beyond the cores wait at every barrier of a step for a partner without a core (a
        128-token prompt step at 2 threads took 0.97 s instead of 0.26 beside a one-thread decode step). So
        this server waits for such a step to end (``DEFER_SECONDS`` at most): the peer takes its share at its
        next step's start, seeing this one busy."""
        now = time.monotonic()
        others = self._busy_peers(now)
        if others:
            self._peer_busy_at = now
        wanting = [want for want, _ in others]
        threads = 1 if self.contention.holds(now) else thread_share(self.cores, self.wanted, wanting)
        if threads != self._busy:
            self._board[self.slot * FIELDS + BUSY] = threads
            self._busy = threads
        if others and now >= self._defer_off_until and self._overcommitted(others):
            deadline = now + DEFER_SECONDS
            while True:
                time.sleep(0.001)
                at = time.monotonic()
                if not self._overcommitted(self._busy_peers(at)):
                    break
                if at >= deadline:  # a step longer than that (or a peer stuck in one): no waiting for a while
                    self._defer_off_until = at + DEFER_OFF_SECONDS
                    log.debug("a peer's step outlasted %.1f s: not waiting for peers for %.0f s", DEFER_SECONDS,
                              DEFER_OFF_SECONDS)
                    break
            self.deferred += time.monotonic() - now
        return threads

    def _overcommitted(self, others: list[tuple[int, int]]) -> bool:
        """Whether a busy peer's step under way computes with more threads than its share, this server busy."""
        wanting = [want for want, _ in others] + [self.wanted]
        for i, (want, using) in enumerate(others):
            if using > thread_share(self.cores, want, wanting[:i] + wanting[i + 1:]):
                return True
        return False

    def sharing(self) -> bool:
        """Whether another server of the group was computing at one of this server's last steps' starts,
        ``SHARING_SECONDS`` back at most: its share may change at any moment, and a long step would keep the
        thread count it started with (the backend then cuts a prompt's chunk into shorter steps)."""
        return time.monotonic() - self._peer_busy_at < SHARING_SECONDS

    def stepped(self, threads: int, wall: float, cpu: float) -> None:
        """A step took ``wall`` seconds, ``cpu`` of them on a CPU for the thread that ran it."""
        self.contention.observe(threads, wall, cpu, time.monotonic())

    def idle(self) -> None:
        """Nothing to compute until new work comes."""
        if self._busy:
            self._board[self.slot * FIELDS + BUSY] = 0
            self._busy = 0

    def busy_peers(self) -> int:
        """How many other servers of the group are computing now (diagnostics; the owner calibrates only at 0)."""
        return len(self._peers_wanting(time.monotonic()))

    def describe(self) -> dict:
        """For /health: the machine's cores, this server's threads, its busy peers, whether the cores count as
        shared, the seconds it waited for peers' steps, the one-thread holds."""
        now = time.monotonic()
        return {"cores": self.cores, "threads": self.wanted, "busy_peers": len(self._peers_wanting(now)),
                "sharing": self.sharing(), "deferred_s": round(self.deferred, 3),
                "contended": self.contention.holds(now), "contended_holds": self.contention.count}

    def close(self) -> None:
        if self._map is None:
            return
        base = self.slot * FIELDS
        if self._board[base + PID] == self.pid:
            for i in (BUSY, WANT, GROUP, PID):
                self._board[base + i] = 0
        self._board.release()
        self._map.close()
        self._map = None


def for_server(settings, backend) -> CoreShare | None:
    """A server's share of its machine's cores (``settings.core_group``), or None: no group, a backend
    that cannot change its thread count between steps, or no board to be had (logged)."""
    if not settings.core_group or not getattr(backend, "batched", False) or not hasattr(backend, "set_threads"):
        return None
    try:
        return CoreShare(settings.core_group, engine_threads(settings.model))
    except (OSError, RuntimeError) as exc:
        log.warning("computing without sharing the cores with the machine's other servers: %s", exc)
        return None
