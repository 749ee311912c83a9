"""Every server of a config, read every few seconds; the last minutes kept for charts and rates.

Each sweep reads every server (``scrape.read``). The newest sweep is kept whole; older ones keep
only what the charts draw over time (``CHART_SAMPLES``), except one whole sweep every
``anchor_seconds``: the baselines that windowed rates and percentiles subtract (a counter's
value now minus its value at the window's start). Memory stays a few MB for 15 minutes.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

import requests

from . import scrape

CHART_SAMPLES = ("disagg_slots_busy", "disagg_slots_total", "disagg_queue_depth", "disagg_completion_tokens_total")


@dataclass
class Sweep:
    time: float
    readings: list = field(default_factory=list)  # scrape.Reading, one per server
    whole: bool = True  # every sample kept (an anchor, or the newest)

    def thinned(self) -> "Sweep":
        keep = [replace(r, health={k: r.health[k] for k in ("status", "loaded") if k in r.health},
                        metrics={k: v for k, v in r.metrics.items() if k[0] in CHART_SAMPLES}) for r in self.readings]
        return Sweep(self.time, keep, whole=False)


def server_names(cfg) -> dict:
    """``{address: server name}`` for every address a server is known by: host:port (the client's
    history) and its data URL's host:port (the ``source`` of a decode server's KV pulls)."""
    names = {}
    for e in cfg.servers:
        names[e.address] = e.name
        names[urlsplit(e.url).netloc] = e.name
        if e.data_url:
            names[urlsplit(e.data_url).netloc] = e.name
    return names


class Sampler:
    def __init__(self, cfg, interval: float = 2.0, keep_seconds: float = 900.0, anchor_seconds: float = 15.0,
                 timeout: float = 3.0, api_token: str | None = None, clock=time.time):
        self.cfg = cfg
        self.clock = clock
        self.interval = interval
        self.keep_seconds = keep_seconds
        self.anchor_seconds = anchor_seconds
        self.timeout = timeout
        self.names = server_names(cfg)
        self._sweeps: deque = deque()
        self._lock = threading.Lock()
        self._sweeping = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        self._http = requests.Session()
        token = api_token or cfg.client.get("api_token")
        if token:  # /health and /metrics are open; a token does no harm
            self._http.headers["Authorization"] = f"Bearer {token}"

    def sweep(self) -> Sweep:
        """Read every server once, now, and keep the result (one sweep at a time: the thread's, or a
        caller's that wants figures fresher than the last one)."""
        with self._sweeping:
            return self._sweep()

    def _sweep(self) -> Sweep:
        readings = [scrape.read(e, self._http, self.timeout) for e in self.cfg.servers]
        now = self.clock()
        new = Sweep(now, readings)
        with self._lock:
            if self._sweeps:
                last = self._sweeps[-1]
                anchors = [s.time for s in self._sweeps if s.whole and s is not last]
                if anchors and last.time - anchors[-1] < self.anchor_seconds:
                    self._sweeps[-1] = last.thinned()
            self._sweeps.append(new)
            while self._sweeps and self._sweeps[0].time < now - self.keep_seconds:
                self._sweeps.popleft()
        return new

    def sweeps(self) -> list:
        with self._lock:
            return list(self._sweeps)

    def latest(self) -> Sweep | None:
        with self._lock:
            return self._sweeps[-1] if self._sweeps else None

    def baseline(self, window: float) -> Sweep | None:
        """The oldest whole sweep within ``window`` seconds of the newest (None with fewer than two)."""
        with self._lock:
            if len(self._sweeps) < 2:
                return None
            newest = self._sweeps[-1]
            for s in self._sweeps:
                if s.whole and s is not newest and s.time >= newest.time - window:
                    return s
            return None

    def start(self) -> "Sampler":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="observe-sampler", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.sweep()
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout * 2 + self.interval)
        self._http.close()
