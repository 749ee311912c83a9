"""A reading taken now and then every ``interval`` seconds on a thread of its own, until stopped: what the
bench's machine monitor (energy, busy shares) and the soak's resource sampler (RSS, files, threads) share."""
from __future__ import annotations

import threading


class Periodic:
    """Subclasses set ``interval`` (seconds) and define ``sample()``; ``start()`` takes one reading at once."""

    interval: float = 1.0
    thread_name = "periodic"
    join_seconds = 10.0

    def sample(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._stop = threading.Event()
        self.sample()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=self.thread_name)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        thread = getattr(self, "_thread", None)
        if thread is not None:
            self._stop.set()
            thread.join(timeout=self.join_seconds)
