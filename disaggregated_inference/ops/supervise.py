"""Keep a local cluster's servers running: restart one that died, with backoff, and say so.

What systemd's ``Restart=on-failure`` does in production (deploy/), for ``disagg up``:
a server that exits is started again on its own port after a delay that doubles
with each death in quick succession (1 s, 2 s, 4 s ... up to ``max_delay``) and
starts over once a server has stayed up for ``stable_after`` seconds.
"""
from __future__ import annotations

import threading
import time
from typing import Callable


class Supervisor:
    def __init__(self, cluster, say: Callable[[str], None], first_delay: float = 1.0, max_delay: float = 30.0,
                 stable_after: float = 60.0, clock=time.monotonic):
        self.cluster, self.say, self.clock = cluster, say, clock
        self.first_delay, self.max_delay, self.stable_after = first_delay, max_delay, stable_after
        self._delay: dict[str, float] = {}
        self._started: dict[str, float] = {p.entry.name: clock() for p in self._watched()}
        self._due: dict[str, float] = {}  # server -> when it is to be started again
        self.restarts: dict[str, int] = {}

    def step(self) -> None:
        """Look once: note servers that died, start those whose delay has passed."""
        now = self.clock()
        for proc in self._watched():
            name = proc.entry.name
            if proc.proc is None or proc.proc.poll() is None:
                continue
            if name not in self._due:
                quick = now - self._started.get(name, now) < self.stable_after
                delay = min(self.max_delay, self._delay.get(name, self.first_delay / 2) * 2) if quick \
                    else self.first_delay
                self._delay[name] = delay
                self._due[name] = now + delay
                self.say(f"server {name} exited (code {proc.proc.returncode}); restarting it in {delay:g}s "
                         f"(log: {proc.log_path})")
            elif now >= self._due[name]:
                del self._due[name]
                try:
                    proc.restart()
                except Exception as exc:  # its port taken, say: try again after a longer delay
                    self.say(f"server {name} could not be restarted: {exc}")
                    continue
                self._started[name] = now
                self.restarts[name] = self.restarts.get(name, 0) + 1
                self.say(f"server {name} restarted (restart {self.restarts[name]})")

    def _watched(self) -> list:
        """The servers, and the gateway when the cluster runs one."""
        gateway = getattr(self.cluster, "gateway", None)
        return list(self.cluster.processes) + ([gateway] if gateway is not None else [])

    def run(self, stop: threading.Event, every: float = 0.5) -> None:
        while not stop.wait(every):
            self.step()
