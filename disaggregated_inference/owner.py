"""One thread owns the model.

HTTP threads never touch the backend: they hand a job to the owner thread and
wait. A job that the owner cannot pick up within ``queue_timeout`` is dropped
and the caller gets 503 (``Overloaded``) so the client can go elsewhere. The
owner thread also loads the model, so a server answers /health while loading.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Iterator

from .errors import BackendUnavailable, Overloaded

log = logging.getLogger(__name__)


class _Job:
    def __init__(self, fn, streaming: bool):
        self.fn = fn
        self.streaming = streaming
        self.out: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._started = threading.Event()
        self.cancelled = False
        self.enqueued_at = time.perf_counter()

    def claim(self) -> bool:
        with self._lock:
            if self.cancelled:
                return False
            self._started.set()
            return True

    def wait_started(self, timeout: float) -> bool:
        if self._started.wait(timeout):
            return True
        with self._lock:
            if self._started.is_set():
                return True
            self.cancelled = True
            return False

    def run(self, backend) -> None:
        try:
            if self.streaming:
                for event in self.fn(backend, lambda: self.cancelled):
                    self.out.put(("item", event))
                    if self.cancelled:
                        break
            else:
                self.out.put(("value", self.fn(backend)))
            self.out.put(("end", None))
        except BaseException as exc:  # handed to the waiting HTTP thread
            self.out.put(("error", exc))


class ModelOwner:
    def __init__(self, backend, queue_timeout: float = 30.0, depth: int = 64):
        self.backend = backend
        self.queue_timeout = queue_timeout
        self._jobs: queue.Queue = queue.Queue(maxsize=depth)
        self.state = "loading"
        self.progress = "queued"
        self.error: str | None = None
        self.loaded_at: float | None = None
        self.busy = False
        self._thread = threading.Thread(target=self._run, name="model-owner", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def queued(self) -> int:
        return self._jobs.qsize()

    def _set_progress(self, message: str) -> None:
        self.progress = message
        log.info("model load: %s", message)

    def _run(self) -> None:
        try:
            self.backend.load(progress=self._set_progress)
            self.state, self.progress, self.loaded_at = "ready", "loaded", time.time()
        except Exception as exc:  # the server stays up and reports the failure on /health
            log.exception("model failed to load")
            self.state, self.error = "failed", f"{type(exc).__name__}: {exc}"
            return
        while True:
            job = self._jobs.get()
            if job is None:
                break
            if not job.claim():
                continue
            self.busy = True
            try:
                job.run(self.backend)
            finally:
                self.busy = False
        self.backend.close()

    def require_ready(self) -> None:
        if self.state == "failed":
            raise BackendUnavailable(f"model failed to load: {self.error}")
        if self.state != "ready":
            raise BackendUnavailable(f"model is still loading ({self.progress})", retry_after=5)

    def _submit(self, fn, streaming: bool) -> _Job:
        self.require_ready()
        job = _Job(fn, streaming)
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise Overloaded("model queue is full", retry_after=1) from None
        if not job.wait_started(self.queue_timeout):
            raise Overloaded(f"model thread did not pick the request up within {self.queue_timeout:g}s",
                             retry_after=1)
        return job

    def call(self, fn: Callable):
        """Run ``fn(backend)`` on the owner thread and return its result."""
        job = self._submit(fn, streaming=False)
        kind, value = job.out.get()
        if kind == "error":
            raise value
        return value

    def stream(self, fn: Callable) -> Iterator:
        """Run ``fn(backend, cancelled)`` (a generator) on the owner thread; yield its items.

        The job is queued (and a full queue or a loading model reported) before
        this returns; closing the iterator early (a client went away) cancels it.
        """
        return self._drain(self._submit(fn, streaming=True))

    @staticmethod
    def _drain(job: _Job) -> Iterator:
        try:
            while True:
                kind, value = job.out.get()
                if kind == "item":
                    yield value
                elif kind == "error":
                    raise value
                else:
                    return
        finally:
            job.cancelled = True

    def close(self) -> None:
        try:
            self._jobs.put_nowait(None)
        except queue.Full:
            pass
