"""How the bench sends its requests: phases of load, each bounded by time or by a number of requests.

A phase sends a workload's units to one endpoint, in one of two shapes:

- ``concurrency N``: N senders, each sending its next unit as soon as its last one is answered;
- ``rate R``: units arrive as a Poisson process of R a second (exponential gaps from a seeded generator, so the
  same arrivals for every endpoint), whatever is still in flight.

A unit of several requests (the grader's pair) sends them all at once and counts each. A phase stops sending at
its ``duration_s`` or after ``requests`` requests; then it waits ``grace_s`` for those in flight and cuts the
rest (failed, "still running ... after the phase ended"), so a server that stops answering never holds the run
past its time. Ctrl-C ends the phase the same way, its requests failed as "interrupted". Every request is a
``Sample``: what was sent, to whom, in which phase, and its ``measure.RequestTiming``.
"""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

from .measure import RequestTiming, time_stream
from .workloads import BenchRequest, Unit


@dataclass(frozen=True)
class LoadShape:
    concurrency: int | None = None
    rate: float | None = None  # units (a grader pair is one) per second, Poisson arrivals
    duration_s: float | None = None
    requests: int | None = None

    @property
    def label(self) -> str:
        return f"rate {self.rate:.3g}/s" if self.rate else f"concurrency {self.concurrency}"


@dataclass
class Sample:
    request: BenchRequest
    side: str  # "ours" or a peer's name
    stage: str
    phase: int
    sent_at: float  # perf_counter
    timing: RequestTiming | None = None  # None while in flight
    finished: float | None = None  # perf_counter when its timing was set
    energy_j: float | None = None  # its share of the cluster's energy (machines.attribute_energy)

    @property
    def done(self) -> bool:
        return self.timing is not None

    @property
    def ok(self) -> bool:
        return self.timing is not None and self.timing.ok


@dataclass
class PhaseResult:
    side: str
    stage: str
    phase: int
    shape: LoadShape
    started: float
    ended: float = 0.0
    samples: list = field(default_factory=list)
    interrupted: bool = False
    cut: int = 0

    @property
    def wall_s(self) -> float:
        return max(0.0, self.ended - self.started)

    def counts(self) -> dict:
        done = sum(1 for s in self.samples if s.ok)
        return {"sent": len(self.samples), "completed": done, "failed": len(self.samples) - done}


class Phase:
    """One phase of load on one endpoint (``run()`` returns its ``PhaseResult``)."""

    def __init__(self, endpoint, units, shape: LoadShape, *, side: str, stage: str, phase: int, seed: int = 0,
                 grace_s: float = 30.0, progress=None, on_sample=None, stop: threading.Event | None = None):
        self.endpoint, self.units, self.shape = endpoint, iter(units), shape
        self.side, self.stage, self.phase = side, stage, phase
        self.rng = random.Random(f"{seed}:{stage}:{phase}")
        self.grace_s, self.progress = grace_s, progress
        self.on_sample = on_sample  # called with each request's Sample once it is answered or failed (the soak)
        self.stop = stop or threading.Event()
        self.lock = threading.Lock()
        self.sending_over = threading.Event()
        self.cut_reason: str | None = None
        self.result = PhaseResult(side, stage, phase, shape, time.perf_counter())
        self.threads: list[threading.Thread] = []
        self.pause_after_failure_s = 0.2

    # -- what one request does ------------------------------------------------------------------------
    def _send(self, request: BenchRequest) -> Sample:
        sample = Sample(request, self.side, self.stage, self.phase, time.perf_counter())
        with self.lock:
            self.result.samples.append(sample)
            self._reserved -= 1
        try:
            events = self.endpoint.stream(request)
            timing = time_stream(events, started=sample.sent_at, cut=lambda: self.cut_reason)
        except Exception as exc:  # noqa: BLE001 - a request that could not start is a failed request
            timing = RequestTiming(started=sample.sent_at, error=f"{type(exc).__name__}: "
                                   f"{getattr(exc, 'message', None) or exc}")
        with self.lock:
            if sample.timing is None:  # not already cut
                sample.timing, sample.finished = timing, time.perf_counter()
        if self.on_sample is not None:
            self.on_sample(sample)
        return sample

    def _send_unit(self, unit: Unit) -> list[Sample]:
        if len(unit.requests) == 1:
            return [self._send(unit.requests[0])]
        samples: list[Sample] = []
        threads = [threading.Thread(target=lambda r=r: samples.append(self._send(r)), daemon=True)
                   for r in unit.requests]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return samples

    # -- when to send ---------------------------------------------------------------------------------
    def _next_unit(self) -> Unit | None:
        with self.lock:
            if self.sending_over.is_set() or self.stop.is_set():
                return None
            if self.shape.duration_s is not None and time.perf_counter() - self.result.started >= self.shape.duration_s:
                self.sending_over.set()
                return None
            sent = len(self.result.samples) + self._reserved
            if self.shape.requests is not None and sent >= self.shape.requests:
                self.sending_over.set()
                return None
            unit = next(self.units, None)
            if unit is None:
                self.sending_over.set()
                return None
            self._reserved += len(unit.requests)
            return unit

    def _worker(self) -> None:
        while True:
            unit = self._next_unit()
            if unit is None:
                return
            if not all(s.ok for s in self._send_unit(unit)):  # a caller that got an error does not retry at once
                self.stop.wait(self.pause_after_failure_s)

    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        self.threads.append(t)
        t.start()

    def run(self) -> PhaseResult:
        self._reserved = 0
        self.result.started = time.perf_counter()
        try:
            if self.shape.rate:
                self._poisson()
            else:
                for _ in range(max(1, self.shape.concurrency or 1)):
                    self._spawn(self._worker)
                # senders stuck on an endpoint that stopped answering do not hold the phase past its time
                deadline = self.result.started + self.shape.duration_s if self.shape.duration_s else None
                self._wait(lambda: self.sending_over.is_set() or self.stop.is_set(), deadline=deadline)
                self.sending_over.set()
            self._drain()
        except KeyboardInterrupt:
            self.result.interrupted = True
            self.stop.set()
            self._cut("interrupted (Ctrl-C) before it was answered")
        return self.result

    def _poisson(self) -> None:
        due = self.result.started
        while True:
            due += self.rng.expovariate(self.shape.rate)
            while time.perf_counter() < due:
                if self.stop.is_set():
                    return
                time.sleep(min(0.05, max(0.0, due - time.perf_counter())))
                self._tick()
            unit = self._next_unit()
            if unit is None:
                return
            self._spawn(self._send_unit, unit)

    def _wait(self, until, deadline: float | None = None) -> bool:
        """Sleep in short steps (Ctrl-C stays responsive) until ``until()`` or the deadline; progress on the way."""
        while not until():
            if deadline is not None and time.perf_counter() >= deadline:
                return False
            time.sleep(0.05)
            self._tick()
        return True

    def _drain(self) -> None:
        end = time.perf_counter() + self.grace_s
        if self.shape.duration_s is not None:
            end = max(end, self.result.started + self.shape.duration_s + self.grace_s)
        finished = self._wait(lambda: all(not t.is_alive() for t in self.threads), deadline=end)
        if not finished:
            self._cut(f"still running {self.grace_s:g} s after the phase stopped sending (cut)")
        else:
            self.result.ended = max([self.result.started] + [s.finished for s in self.result.samples if s.finished])

    def _cut(self, reason: str) -> None:
        now = time.perf_counter()
        self.cut_reason = reason
        self.sending_over.set()
        with self.lock:
            for sample in self.result.samples:
                if sample.timing is None:
                    sample.timing, sample.finished = RequestTiming(started=sample.sent_at, error=reason), now
                    self.result.cut += 1
        self.result.ended = now

    _last_tick = 0.0

    def _tick(self) -> None:
        now = time.perf_counter()
        if self.progress is not None and now - self._last_tick >= 2.0:
            self._last_tick = now
            self.progress(self)


class BackgroundLoad:
    """A phase of ``concurrency`` senders in a thread of its own, from the ``with`` block's start to its end, when
    it stops sending and waits for what is in flight (benchmarks/failover.py's load around a fault)."""

    def __init__(self, endpoint, units, concurrency: int, stage: str = "background"):
        self.phase = Phase(endpoint, units, LoadShape(concurrency=concurrency), side="ours", stage=stage, phase=0,
                           grace_s=3600)
        self.thread = threading.Thread(target=self.phase.run, daemon=True, name=f"bench-{stage}")

    def __enter__(self) -> "BackgroundLoad":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.phase.stop.set()
        self.thread.join()

    @property
    def samples(self) -> list:
        return [s for s in self.phase.result.samples if s.timing is not None]


def run_group(endpoint, unit: tuple[BenchRequest, ...], parallel: bool, side: str, stage: str) -> tuple[float, list]:
    """One group of requests (the parallel-efficiency check): all at once, or one after the other; the wall time
    and the samples."""
    phase = Phase(endpoint, [], LoadShape(concurrency=1), side=side, stage=stage, phase=0)
    phase._reserved = len(unit)
    started = time.perf_counter()
    if parallel:
        phase._send_unit(Unit(unit))
    else:
        for request in unit:
            phase._send(request)
    return time.perf_counter() - started, phase.result.samples
