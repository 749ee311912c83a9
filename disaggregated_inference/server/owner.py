"""One thread owns the model; requests hold slots.

HTTP threads never touch the backend: they reserve one of the backend's slots
(``parallel`` in the config), hand a job to the owner and wait for its events.
A request that cannot get a slot within ``queue_timeout``, or that finds
``max_queue`` requests already waiting, gets 503 (``Overloaded``, with
Retry-After) so the client can go elsewhere. A decode server reserves its slot
before it pulls a KV bundle, so it never consumes a lease it cannot serve.

A batched backend (``BatchedBackend``, backends/base.py: llama.cpp) runs every
admitted request as a generator on the owner thread: each step the owner collects
the ``Eval`` requests of all of them and the backend evaluates them in one batch
(continuous batching: requests join and leave between steps). A request that
waits for something else (a streamed KV bundle's next pieces) yields a ``Wait``
and is parked, the others going on, until its ``ready()`` holds; whoever makes it
hold calls ``wake``. Other backends (Ollama, which batches behind its own API)
run each request to its end on one of ``slots`` worker threads.

With ``cores`` (a ``cores.CoreShare``), the owner takes its share of the machine's cores before
every step and says when it has nothing to compute, so that servers sharing a machine compute
with as many threads as fit its cores (``server/cores.py``).

The owner thread also loads the model, so a server answers /health while loading.
At interpreter exit (a worker told to stop) the owner is stopped and joined, so the
model is freed on its own thread before the process finalizes: an engine whose state
belongs to the thread that created it aborts the process when that thread is still
running then (MLX: "terminate called without an active exception"), and a server
must end cleanly on SIGTERM.
"""
from __future__ import annotations

import atexit
import logging
import queue
import random
import threading
import time
import weakref
from collections import deque
from typing import Callable, Iterator

from ..errors import BackendUnavailable, Overloaded

log = logging.getLogger(__name__)
_STOP = object()
_WAKE = object()
PARKED_POLL_SECONDS = 1.0  # a parked request's ready() is checked at least this often, woken or not
# idle this long (and the other servers on its cores too), the backend measures again (BatchedBackend.calibrate):
# once after each of these, counted from the last request or measurement, then after the last one as long as the
# backend wants more (a server that has found no step cost yet drafts nothing: every measurement so far ran beside
# other programs' work, as beside a benchmark's other servers, and three measurements did not end that)
CALIBRATE_AFTER_IDLE = (2.0, 15.0, 120.0)


def _is_eval(item) -> bool:
    return hasattr(item, "seq") and hasattr(item, "tokens")


class FairSlots:
    """A counting semaphore that hands a freed slot to the request that has waited longest.

    ``threading.Semaphore`` lets a newcomer take a slot between a release and the wake-up of the
    waiter it notified, and a waiter that loses goes to the back of the line: with more requests
    than slots and clients that send their next request as soon as the last is answered, one can
    wait again and again. Here a release gives the slot to the first waiter directly; a newcomer
    takes a free slot only when nobody waits."""

    def __init__(self, slots: int):
        self._lock = threading.Lock()
        self._free = slots
        self._waiters: deque[threading.Event] = deque()

    def acquire(self, timeout: float | None = None) -> bool:
        with self._lock:
            if self._free and not self._waiters:
                self._free -= 1
                return True
            turn = threading.Event()
            self._waiters.append(turn)
        if turn.wait(timeout):
            return True
        with self._lock:
            if turn.is_set():  # handed a slot as the wait ran out
                return True
            self._waiters.remove(turn)
            return False

    def release(self) -> None:
        with self._lock:
            if self._waiters:
                self._waiters.popleft().set()
            else:
                self._free += 1


class Reservation:
    """A slot held for one request, from before its work starts until it ends (or is given back)."""

    def __init__(self, owner: "ModelOwner", waited: float):
        self._owner, self.waited, self._held = owner, waited, True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._owner._release_slot()


class _Job:
    def __init__(self, fn, streaming: bool, reservation: Reservation, progress=None):
        self.fn, self.streaming, self.reservation = fn, streaming, reservation
        self.progress = progress  # a request's Progress (progress.py): the prompt tokens evaluated are counted
        self.out: queue.SimpleQueue = queue.SimpleQueue()  # C: a put and a get without a Condition (one a token)
        self.cancelled = False
        self.queue_time = reservation.waited

    def is_cancelled(self) -> bool:
        return self.cancelled

    def run(self, backend) -> None:
        """Run the whole job here (unbatched backends)."""
        try:
            if self.streaming:
                for event in self.fn(backend, self.is_cancelled):
                    self.out.put(("item", event))
                    if self.cancelled:
                        break
            else:
                self.out.put(("value", self.fn(backend)))
            self.out.put(("end", None))
        except BaseException as exc:  # handed to the waiting HTTP thread
            self.out.put(("error", exc))
        finally:
            self.reservation.release()


class _Task:
    """A job running as a generator on the owner thread, and the Eval it waits for."""

    def __init__(self, job: _Job, gen):
        self.job, self.gen, self.pending = job, gen, None


class ModelOwner:
    def __init__(self, backend, queue_timeout: float = 30.0, max_queue: int = 64, cores=None):
        self.backend = backend
        self.cores = cores
        self.compute_threads: int | None = None  # set through cores before each step
        self.cores_shared = False  # whether another server on the cores computed a moment ago
        self.queue_timeout = queue_timeout
        self.max_queue = max_queue
        self.slots = getattr(backend, "slots", 1)
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._free = FairSlots(self.slots)
        self._busy = 0
        self._waiting = 0
        self.state = "loading"
        self.progress = "queued"
        self.error: str | None = None
        self.loaded_at: float | None = None
        self.active = 0  # requests the model is working on now
        self.steps = 0
        self.batch_tokens = deque(maxlen=256)  # tokens per llama_decode of the latest steps
        # each step: requests advanced, tokens evaluated, its seconds, and the owner's seconds since the last step
        # (None: the first since it had nothing to step), a wait for the cores' share not counted (``_serve_batched``)
        self.on_step: Callable[[int, int, float, float | None], None] = lambda sequences, tokens, seconds, between: None
        # what the batched loop has for the HTTP threads, handed over as the next step starts (``_deliver``)
        self._outbox: list[tuple[queue.SimpleQueue, tuple]] = []
        self._thread = threading.Thread(target=self._run, name="model-owner", daemon=True)
        self._thread.start()
        atexit.register(_shutdown_at_exit, weakref.ref(self))

    # -- state -----------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def busy(self) -> bool:
        return self._busy > 0

    @property
    def queued(self) -> int:
        return self._waiting

    def slot_stats(self) -> dict:
        with self._lock:
            busy, waiting = self._busy, self._waiting
        recent = list(self.batch_tokens)
        return {"total": self.slots, "busy": busy, "free": self.slots - busy, "queued": waiting,
                "max_queue": self.max_queue, "active": self.active, "steps": self.steps,
                "mean_batch_tokens": round(sum(recent) / len(recent), 2) if recent else None}

    def _set_progress(self, message: str) -> None:
        self.progress = message
        log.info("model load: %s", message)

    def require_ready(self) -> None:
        if self.state == "failed":
            raise BackendUnavailable(f"model failed to load: {self.error}")
        if self.state != "ready":
            raise BackendUnavailable(f"model is still loading ({self.progress})", retry_after=5)

    # -- slots -----------------------------------------------------------------------------------

    def reserve(self) -> Reservation:
        """Hold a slot for one request; 503 when the queue is full or no slot frees up in time."""
        self.require_ready()
        with self._lock:
            if self._waiting >= self.max_queue and self._busy >= self.slots:
                raise Overloaded(f"{self._waiting} requests already wait for one of {self.slots} slots",
                                 retry_after=1)
            self._waiting += 1
        started = time.perf_counter()
        try:
            got = self._free.acquire(timeout=self.queue_timeout)
        finally:
            with self._lock:
                self._waiting -= 1
        if not got:
            raise Overloaded(f"no slot of {self.slots} came free within {self.queue_timeout:g}s", retry_after=1)
        with self._lock:
            self._busy += 1
        return Reservation(self, time.perf_counter() - started)

    def _release_slot(self) -> None:
        with self._lock:
            self._busy -= 1
        self._free.release()

    # -- submitting work -------------------------------------------------------------------------

    def _submit(self, fn, streaming: bool, reservation: Reservation | None, progress=None) -> _Job:
        job = _Job(fn, streaming, reservation or self.reserve(), progress)
        self._jobs.put(job)
        return job

    def call(self, fn: Callable, reservation: Reservation | None = None, progress=None):
        """Run ``fn(backend)`` with a slot and return its result (a batched backend's generator is driven).
        With ``progress`` (a request's ``Progress``), the prompt tokens a batched backend evaluates for it
        are counted there as they are."""
        job = self._submit(fn, False, reservation, progress)
        kind, value = job.out.get()
        if kind == "error":
            raise value
        return value

    def stream(self, fn: Callable, reservation: Reservation | None = None, progress=None) -> Iterator:
        """Run ``fn(backend, cancelled)`` (a generator) with a slot; yield its events.

        The slot is held (or a full queue or a loading model reported) before this
        returns; closing the iterator early (a client went away) cancels the job.
        ``progress`` as for ``call``.
        """
        return _JobStream(self._submit(fn, True, reservation, progress))

    def wake(self) -> None:
        """Have the owner check its parked requests (a ``Wait``'s condition may hold now)."""
        self._jobs.put(_WAKE)

    def close(self) -> None:
        self._jobs.put(_STOP)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the owner thread and wait (up to ``timeout``) until it has closed the backend."""
        self.close()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # -- the owner thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.backend.load(progress=self._set_progress)
            self.state, self.progress, self.loaded_at = "ready", "loaded", time.time()
        except Exception as exc:  # the server stays up and reports the failure on /health
            log.exception("model failed to load")
            self.state, self.error = "failed", f"{type(exc).__name__}: {exc}"
            return
        try:
            if getattr(self.backend, "batched", False):
                self._serve_batched()
            else:
                self._serve_threads()
        finally:
            self.backend.close()
            if self.cores is not None:
                self.cores.close()

    def _serve_threads(self) -> None:
        def worker():
            while True:
                job = self._jobs.get()
                if job is _STOP:
                    self._jobs.put(_STOP)  # let the other workers see it
                    return
                if job is _WAKE:  # nothing parks here: each request has its thread
                    continue
                with self._lock:
                    self.active += 1
                try:
                    job.run(self.backend)
                finally:
                    with self._lock:
                        self.active -= 1

        workers = [threading.Thread(target=worker, name=f"model-worker-{i}", daemon=True) for i in range(self.slots)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    def _serve_batched(self) -> None:
        active: list[_Task] = []
        calibrations = iter(CALIBRATE_AFTER_IDLE)
        calibrate_after = next(calibrations)  # None once the backend wants no more (BatchedBackend.calibrate)
        stepped_at = None  # when the last step ended, while requests have gone on stepping since
        while True:
            stepping = any(_is_eval(t.pending) for t in active)
            if not stepping:  # nothing to compute (parked requests wait on the network)
                stepped_at = None
                self._deliver()
                if self.cores is not None:
                    self.cores.idle()
            try:  # wait for work only when there is nothing to step (parked requests are looked at now and then)
                job = self._jobs.get(block=not stepping, timeout=PARKED_POLL_SECONDS if active
                                     else calibrate_after)
            except queue.Empty:
                job = None
                if not active and calibrate_after is not None and (self.cores is None or not self.cores.busy_peers()):
                    more = self._calibrate()
                    calibrate_after = next(calibrations, CALIBRATE_AFTER_IDLE[-1]) if more else None
                    if calibrate_after is not None:  # the servers of a machine load together: not in step
                        calibrate_after += random.uniform(0, 1)
            while job is not None:
                if job is _STOP:
                    self._deliver()
                    for task in active:
                        task.gen.close()
                        task.job.reservation.release()
                    return
                if job is not _WAKE:
                    self._start(job, active)
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    job = None
            for task in [t for t in active if t.job.cancelled]:
                self._finish(task, active, None)
            for task in [t for t in active if t.pending is not None and not _is_eval(t.pending)]:
                if task.pending.ready():
                    self._advance(task, active)
            pending = [t for t in active if _is_eval(t.pending)]  # in the order the requests started
            self.active = len(active)
            if not pending:
                continue
            before = [t.pending.done for t in pending]
            held = 0.0  # waiting for this server's share of the cores: not the owner's own time between steps
            if self.cores is not None:
                held = time.perf_counter()
                self._take_cores()
                held = time.perf_counter() - held
            self._deliver()
            if self.cores is not None:
                cpu = time.thread_time()
            started = time.perf_counter()
            between = None if stepped_at is None else started - stepped_at - held
            try:
                n = self.backend.evaluate([t.pending for t in pending], waiting=self._waiting)
            except Exception as exc:
                log.exception("batch evaluation failed")
                for task in pending:
                    self._finish(task, active, ("error", exc))
                continue
            stepped_at = time.perf_counter()
            if self.cores is not None:
                self.cores.stepped(self.compute_threads, stepped_at - started, time.thread_time() - cpu)
            self.steps += 1
            self.batch_tokens.append(n)
            self.on_step(len(pending), n, stepped_at - started, between)
            for task, done in zip(pending, before):
                if task.job.progress is not None:
                    task.job.progress.evaluated += task.pending.done - done
                if task.pending.complete:
                    self._advance(task, active)

    def _calibrate(self) -> bool:
        """The backend's measurements again, the server idle (a request that comes meanwhile stops them)."""
        calibrate = getattr(self.backend, "calibrate", None)
        if calibrate is None:
            return False
        if self.cores is not None:  # busy on the board: the other servers' own calibrations wait for this one
            self._take_cores()
        try:
            return calibrate(interrupted=lambda: not self._jobs.empty())
        except Exception:  # a measurement is not worth the server
            log.exception("calibration failed")
            return False
        finally:
            if self.cores is not None:
                self.cores.idle()

    def _take_cores(self) -> None:
        """This step's share of the machine's cores (the backend keeps a count until it changes)."""
        threads, shared = self.cores.threads(), self.cores.sharing()
        if (threads, shared) != (self.compute_threads, self.cores_shared):
            self.backend.set_threads(threads, shared=shared)
            self.compute_threads, self.cores_shared = threads, shared

    def _deliver(self) -> None:
        """Hand the HTTP threads what the last step made, as the next one starts.

        A put wakes the request's thread, which wants the GIL at once; each of the owner's ctypes calls
        between two steps (the logits, detokenizing) lets it go, and the owner then waited out that thread's
        line and socket write before its next call: the two threads took turns on one core while the other
        core's OpenMP thread waited for the step. Handed over just before ``llama_decode`` (which lets the
        GIL go for the step), the HTTP threads run while the step computes. An answer's items keep their
        order: its end goes through here too."""
        outbox, self._outbox = self._outbox, []
        for out, item in outbox:
            out.put(item)

    def _start(self, job: _Job, active: list) -> None:
        try:
            gen = job.fn(self.backend, job.is_cancelled) if job.streaming else job.fn(self.backend)
        except BaseException as exc:
            self._outbox.append((job.out, ("error", exc)))
            job.reservation.release()
            return
        if not job.streaming and not hasattr(gen, "send"):  # a plain value: nothing to batch
            self._outbox.append((job.out, ("value", gen)))
            job.reservation.release()
            return
        task = _Task(job, gen)
        active.append(task)
        self._advance(task, active)

    def _advance(self, task: _Task, active: list) -> None:
        """Run the task's generator until it asks for an evaluation, or ends."""
        job, task.pending = task.job, None
        try:
            while True:
                item = task.gen.send(None)
                if _is_eval(item) or hasattr(item, "ready"):  # an Eval, or a Wait: parked until ready()
                    task.pending = item
                    return
                self._outbox.append((job.out, ("item", item)))
                if job.cancelled:
                    self._finish(task, active, None)
                    return
        except StopIteration as stop:
            self._finish(task, active, ("end", None) if job.streaming else ("value", stop.value))
        except BaseException as exc:
            self._finish(task, active, ("error", exc))

    def _finish(self, task: _Task, active: list, outcome) -> None:
        if outcome is None:  # cancelled: the generator's cleanup frees its sequence
            task.gen.close()
        if task in active:
            active.remove(task)
        if not active and self.cores is not None:  # idle before the answer leaves: the next server's turn
            self.cores.idle()
        task.job.reservation.release()
        if outcome is not None:
            self._outbox.append((task.job.out, outcome))


def _shutdown_at_exit(ref) -> None:
    owner = ref()
    if owner is not None and owner._thread.is_alive():
        owner.shutdown()


class _JobStream:
    """The events of a streaming job; closing it early cancels the job."""

    def __init__(self, job: _Job):
        self._job = job
        self.queue_time = job.queue_time
        self._done = False

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        kind, value = self._job.out.get()
        if kind == "item":
            return value
        self._done = True
        self._job.cancelled = True
        if kind == "error":
            raise value
        raise StopIteration

    def close(self) -> None:
        self._done = True
        self._job.cancelled = True
