"""The client's servers: their health, which one to try, reviving the ones marked down.

Each configured server is a ``TrackedServer``: up or down, its last ``/health``,
the requests this client has in flight there. ``ServerPool`` (a part of
``DisaggregatedClient``) chooses among them (most free slots first, round-robin
among ties), marks them down after failures and probes them again as requests come
(``_revive``), with or without the background health checker (``_monitor_loop``).
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import requests

from .. import config as cluster_config

log = logging.getLogger(__name__)

# A server marked down is probed again (GET /health) this long after, then twice as long after each
# probe it fails, up to REVIVE_MAX_INTERVAL; at once when a request finds no server of its role up.
REVIVE_INTERVAL = 1.0
REVIVE_MAX_INTERVAL = 30.0


@dataclass
class TrackedServer:
    entry: cluster_config.ServerEntry
    up: bool = True           # optimistic until a check or a request says otherwise
    failures: int = 0
    last_error: str | None = None
    last_checked: float | None = None
    latency_s: float | None = None
    outstanding: int = 0
    prompting: int = 0  # this client's prompts it is evaluating: a prefill, or a decode-only request not yet answering
    served: int = 0
    health: dict = field(default_factory=dict)
    revive_at: float = 0.0  # monotonic: when a server marked down is probed again
    revive_interval: float = 0.0
    probe: object = None  # the thread probing it now (threading.Thread), if any

    @property
    def slots(self) -> int:
        """Requests the server serves at once, as its last /health said (1 until it has said)."""
        return int((self.health.get("slots") or {}).get("total") or 1)

    @property
    def free_slots(self) -> int:
        return self.slots - self.outstanding

    def as_dict(self) -> dict:
        e = self.entry
        return {"name": e.name, "role": e.role, "model": e.model, "url": e.url, "up": self.up,
                "failures": self.failures, "last_error": self.last_error, "last_checked": self.last_checked,
                "latency_s": self.latency_s, "outstanding": self.outstanding, "slots": self.slots,
                "served": self.served,
                "loaded": self.health.get("loaded"), "backend": self.health.get("backend"),
                "handoff": self.health.get("handoff")}


class ServerPool:
    """The servers' states and the choice among them (``DisaggregatedClient``'s part; it sets ``servers``,
    ``_lock``, ``_rr``, ``_stop``, the timeouts, ``failures_before_down``, ``handoff_mode`` and ``session``)."""

    def _kv_kind(self, model_key: str) -> dict:
        """The bundle kind to ask the prefill server for: nothing when every decode server of the model
        continues what its prefill servers hand over (their last /health ``handoff`` and ``accepts``), else
        ``{"kv_kind": "neutral_kv"}`` when every one of them reads that (an MLX decode server behind a
        llama.cpp prefill server). Before the prefill servers' health is known: ``neutral_kv`` when no decode server
        reads llama.cpp state, else nothing (the prefill backend's own kind)."""
        with self._lock:  # not _candidates(): that advances the round-robin
            accepts = [s.health.get("accepts") for s in self.servers.values()
                       if s.entry.role == "decode" and s.entry.model == model_key and s.up]
            handed = {s.health.get("handoff") for s in self.servers.values()
                      if s.entry.role == "prefill" and s.entry.model == model_key and s.up}
        handed.discard(None)
        if not accepts or not all(accepts):
            return {}
        if handed:  # what the prefill servers hand over is known
            if all(kind in a for a in accepts for kind in handed):
                return {}
            return {"kv_kind": "neutral_kv"} if all("neutral_kv" in a for a in accepts) else {}
        if all("neutral_kv" in a and "llama_seq_state" not in a for a in accepts):
            return {"kv_kind": "neutral_kv"}
        return {}

    def _streams(self, model_key: str) -> bool:
        """Whether to ask for the overlapped handoff: ``client.handoff_mode`` is "streamed" and no decode server
        of the model said (in its last /health) that it takes only whole bundles (an older server)."""
        if self.handoff_mode != "streamed":
            return False
        with self._lock:
            modes = [s.health.get("handoff_modes") for s in self.servers.values()
                     if s.entry.role == "decode" and s.entry.model == model_key and s.up and s.health]
        return all(m is not None and "streamed" in m for m in modes)

    @contextmanager
    def _counted(self, server: TrackedServer, count: str):
        """One more of this client's requests in ``server``'s ``count`` (``outstanding`` or ``prompting``) for the
        body, counted under the client's lock, whatever way the body ends."""
        with self._lock:
            setattr(server, count, getattr(server, count) + 1)
        try:
            yield server
        finally:
            with self._lock:
                setattr(server, count, getattr(server, count) - 1)

    def _candidates(self, role: str, model_key: str, wait: bool = False) -> list[TrackedServer]:
        """The servers of a role to try, in order. Servers marked down are probed again as their time comes
        (``_revive``); with ``wait``, when none is up, every one marked down is probed now and waited for
        (a request with no other way to go)."""
        with self._lock:
            pool = [s for s in self.servers.values() if s.entry.role == role and s.entry.model == model_key]
        self._revive([s for s in pool if not s.up], now=wait and not any(s.up for s in pool))
        with self._lock:
            healthy = [s for s in pool if s.up]
            self._rr += 1
            rr = self._rr
        # most free slots first (a server's slots, from /health, less what this client has in flight there);
        # round-robin among ties
        order = sorted(range(len(healthy)), key=lambda i: (-healthy[i].free_slots, (i - rr) % max(1, len(healthy))))
        return [healthy[i] for i in order]

    def _revive(self, down: list[TrackedServer], now: bool = False) -> None:
        """Probe the servers marked ``down`` whose time has come (all of them with ``now``, and wait for
        those probes): a server that answers its /health is up again, whether or not the background health
        checker runs. The probes run on threads of their own, so a request does not wait for a server it
        does not need."""
        started = time.monotonic()
        probes = []
        with self._lock:
            for server in down:
                # a server checked a moment ago (a probe that failed just now) waits for its time even when
                # ``now``: a request would otherwise pay for the same probe twice
                just_checked = server.last_checked is not None and time.time() - server.last_checked < REVIVE_INTERVAL
                if server.probe is None and (started >= server.revive_at or (now and not just_checked)):
                    server.probe = threading.Thread(target=self._probe, args=(server,), name="revive", daemon=True)
                    server.probe.start()
                if now and server.probe is not None:
                    probes.append(server.probe)
        for probe in probes:
            probe.join(max(0.0, self.connect_timeout + self.health_timeout - (time.monotonic() - started)))

    def _probe(self, server: TrackedServer) -> None:
        try:
            self._check_one(server)
        finally:
            with self._lock:
                server.probe = None

    def _peek(self, role: str, model_key: str) -> TrackedServer | None:
        """The server ``_candidates`` would try first (without advancing its round-robin)."""
        with self._lock:
            healthy = [s for s in self.servers.values() if s.entry.role == role and s.entry.model == model_key and s.up]
        return max(healthy, key=lambda s: s.free_slots, default=None)

    def _mark_failure(self, server: TrackedServer, error: str, hard: bool = False) -> None:
        with self._lock:
            server.failures += 1
            server.last_error = error
            if hard or server.failures >= self.failures_before_down:
                if server.up:
                    log.warning("server marked down: name=%s error=%s", server.entry.name, error)
                    server.revive_interval = REVIVE_INTERVAL
                else:  # a probe failed: the next one later
                    server.revive_interval = min(REVIVE_MAX_INTERVAL, 2 * (server.revive_interval or REVIVE_INTERVAL))
                server.up = False
                server.revive_at = time.monotonic() + server.revive_interval

    def _mark_ok(self, server: TrackedServer) -> None:
        with self._lock:
            if not server.up:
                log.warning("server marked up: name=%s", server.entry.name)
            server.up, server.failures, server.last_error, server.revive_interval = True, 0, None, 0.0

    def check_health(self) -> list[dict]:
        """Check every server once, now; update their states; return them."""
        for server in list(self.servers.values()):
            self._check_one(server)
        return self.status()

    def _check_one(self, server: TrackedServer) -> None:
        started = time.perf_counter()
        refused = False
        try:
            resp = self.session.get(server.entry.url + "/health", timeout=(self.connect_timeout, self.health_timeout))
            data = resp.json()
            ok = resp.status_code == 200 and data.get("loaded") is True
            error = None if ok else f"health: {data.get('status')} {data.get('error') or data.get('progress') or ''}".strip()
        except (requests.RequestException, ValueError) as exc:
            ok, data, error = False, {}, f"health check failed: {type(exc).__name__}"
            refused = isinstance(exc, requests.ConnectionError) and not isinstance(exc, requests.Timeout)
        server.last_checked = time.time()
        server.latency_s = round(time.perf_counter() - started, 4)
        server.health = data
        if ok:
            self._mark_ok(server)
        else:  # a refused connection is conclusive; a slow or loading server gets another chance
            self._mark_failure(server, error, hard=refused)

    def _monitor_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            for server in list(self.servers.values()):
                if self._stop.is_set():
                    return
                self._check_one(server)

    def status(self) -> list[dict]:
        with self._lock:
            return [s.as_dict() for s in self.servers.values()]

    def close(self) -> None:
        self._stop.set()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
