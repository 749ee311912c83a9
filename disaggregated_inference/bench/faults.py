"""The soak's faults: each injected into a running local cluster and recorded as a window of time.

Every fault is a ``Fault``: its kind, its target (a server, the gateway, a link), the model and the paths
it can disturb, and the window from its ``start`` (the signal sent, the first lease taken, the link cut) to
its ``end`` (the process continued, the restarted server healthy again, the leases expired, the link
restored), on ``time.perf_counter``'s clock, the clock of the load's samples. A fault that cannot be made
here is recorded with ``skipped`` and the reason, and has no window.

Kinds:

- ``kill_prefill``, ``kill_decode``, ``kill_gateway``: SIGKILL to the server's process group (gunicorn's
  master and worker); the cluster's supervisor (``ops/supervise.py``, what systemd's ``Restart=`` is in
  production) starts it again; the window ends when its ``/health`` says loaded;
- ``stop_prefill``, ``stop_decode``, ``stop_gateway``: SIGSTOP to the process group, SIGCONT after
  ``stop_s`` (a hung machine that keeps its sockets open); the window ends at the SIGCONT;
- ``lease_fill``: a prefill server's lease store filled by prefills that are never decoded (``POST
  /prefill``, raw prompts, each leased ``lease_s``) until it refuses one (503) or ``fill_max`` were taken;
  the window ends when its ``/health`` holds no more leases than before the fill;
- ``gateway_restart``: the gateway stopped gracefully (SIGTERM) under load and started again by the
  supervisor; the window ends when it answers ``/health``;
- ``link_cut``, ``link_slow``: the prefill→decode data path of the cluster's namespaced prefill server
  (``netns.DataLink``) cut (both ends of its veth pair down) while a KV transfer is in flight on it, or slowed to
  ``slow_mbit``; each restored after ``link_s``.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import asdict, dataclass, field

import requests

KINDS = ("kill_prefill", "kill_decode", "kill_gateway", "stop_prefill", "stop_decode", "stop_gateway",
         "lease_fill", "gateway_restart", "link_cut", "link_slow")
PATHS = ("client", "gateway", "gateway-ollama")  # the load's: soak.py
GATEWAY_PATHS = PATHS[1:]
CRAWL_MBIT = 0.25  # the link_cut's wait for a transfer in flight: a tiny model's bundle then takes a second


@dataclass
class Fault:
    kind: str
    target: str = ""  # a server's name, "gateway" or the link's
    model: str | None = None  # the model whose requests it can disturb (None: every model)
    paths: tuple = PATHS  # the load's paths it can disturb
    start: float | None = None  # perf_counter
    end: float | None = None
    skipped: str | None = None
    detail: dict = field(default_factory=dict)

    @property
    def window(self) -> tuple[float, float] | None:
        return None if self.start is None or self.end is None else (self.start, self.end)

    def as_dict(self, origin: float) -> dict:
        out = asdict(self)
        out["paths"] = list(self.paths)
        for key in ("start", "end"):
            out[f"{key}_s"] = None if out[key] is None else round(out.pop(key) - origin, 3)
            out.pop(key, None)
        out["duration_s"] = None if self.window is None else round(self.end - self.start, 3)
        return out


def _group_signal(proc, sig: int) -> None:
    if proc.proc is not None and proc.proc.poll() is None:
        os.killpg(proc.proc.pid, sig)


def _healthy(url: str, session: requests.Session) -> bool:
    try:
        return bool(session.get(url + "/health", timeout=2).json().get("loaded"))
    except (requests.RequestException, ValueError):
        return False


class Injector:
    """Makes the faults on one soak cluster (``soak.SoakCluster``): ``inject(kind, occurrence)`` returns the
    recorded ``Fault`` once its window has closed (or it was skipped)."""

    def __init__(self, cluster, *, stop_s: float, link_s: float, lease_s: float, fill_max: int, slow_mbit: float,
                 heal_timeout: float = 300.0, stop_event=None, say=lambda m: None):
        self.cluster, self.say = cluster, say
        self.stop_s, self.link_s, self.lease_s, self.fill_max = stop_s, link_s, lease_s, fill_max
        self.slow_mbit, self.heal_timeout = slow_mbit, heal_timeout
        self.stop_event = stop_event
        self.session = requests.Session()
        if cluster.token:
            self.session.headers["Authorization"] = f"Bearer {cluster.token}"

    def _sleep(self, seconds: float) -> None:
        if self.stop_event is not None:
            self.stop_event.wait(seconds)
        else:
            time.sleep(seconds)

    def inject(self, kind: str, occurrence: int = 0) -> Fault:
        if kind not in KINDS:
            raise ValueError(f"unknown fault {kind!r}: one of {', '.join(KINDS)}")
        role = kind.split("_", 1)[1] if kind.startswith(("kill_", "stop_")) else None
        if role in ("prefill", "decode"):
            proc = self.cluster.pick(role, occurrence)
            fault = Fault(kind, proc.entry.name, proc.entry.model)
        elif role == "gateway" or kind == "gateway_restart":
            proc = self.cluster.gateway
            fault = Fault(kind, "gateway", None, GATEWAY_PATHS)
        elif kind == "lease_fill":
            proc = self.cluster.pick("prefill", occurrence)
            fault = Fault(kind, proc.entry.name, proc.entry.model)
        else:
            return self._link(kind)
        self.say(f"fault {kind} on {fault.target}")
        if kind.startswith("kill_"):
            self._kill(proc, fault)
        elif kind.startswith("stop_"):
            self._stop(proc, fault)
        elif kind == "lease_fill":
            self._fill(proc, fault)
        else:
            self._restart(proc, fault)
        return fault

    # -- processes ------------------------------------------------------------------------------------
    def _wait_back(self, proc, fault: Fault) -> None:
        """The window's end: the process restarted (by the supervisor) and its /health loaded."""
        deadline = time.perf_counter() + self.heal_timeout
        old = fault.detail.get("pid")
        while time.perf_counter() < deadline:
            running = proc.proc is not None and proc.proc.poll() is None and proc.proc.pid != old
            if running and _healthy(proc.url, self.session):
                fault.end = time.perf_counter()
                fault.detail["new_pid"] = proc.proc.pid
                return
            time.sleep(0.1)
        fault.end = time.perf_counter()
        fault.detail["not_back"] = f"not healthy again within {self.heal_timeout:g} s"

    def _kill(self, proc, fault: Fault) -> None:
        fault.detail["pid"] = proc.proc.pid
        fault.start = time.perf_counter()
        _group_signal(proc, signal.SIGKILL)
        self._wait_back(proc, fault)

    def _stop(self, proc, fault: Fault) -> None:
        fault.start = time.perf_counter()
        _group_signal(proc, signal.SIGSTOP)
        try:
            time.sleep(self.stop_s)  # not cut short by a stop of the run: the process must be continued
        finally:
            _group_signal(proc, signal.SIGCONT)
            fault.end = time.perf_counter()
        fault.detail["stopped_s"] = round(fault.end - fault.start, 3)

    def _restart(self, proc, fault: Fault) -> None:
        fault.detail["pid"] = proc.proc.pid
        fault.start = time.perf_counter()
        _group_signal(proc, signal.SIGTERM)  # a graceful stop; the supervisor starts it again
        self._wait_back(proc, fault)

    def _fill(self, proc, fault: Fault) -> None:
        url = proc.url
        before = self._leases(url) or 0
        fault.detail.update(leases_before=before, fills=0, refused=None)
        fault.start = time.perf_counter()
        for i in range(self.fill_max):
            body = {"prompt": f"Lease fill {fault.start:.3f} #{i}: " + "the store holds this prefill. " * 20,
                    "raw": True, "lease_seconds": self.lease_s}
            try:
                resp = self.session.post(url + "/prefill", json=body, timeout=30)
            except requests.RequestException as exc:
                fault.detail["refused"] = f"{type(exc).__name__}"
                break
            if resp.status_code != 200:
                fault.detail["refused"] = f"HTTP {resp.status_code}: {resp.text[:160]}"
                break
            fault.detail["fills"] += 1
        fault.detail["leases_filled"] = self._leases(url)
        deadline = time.perf_counter() + self.lease_s + 30
        while time.perf_counter() < deadline:  # the leases run out: the store is back where it was
            held = self._leases(url)
            if held is not None and held <= before:
                break
            time.sleep(0.25)
        fault.end = time.perf_counter()
        fault.detail["leases_after"] = self._leases(url)

    def _leases(self, url: str) -> int | None:
        try:
            return int(self.session.get(url + "/health", timeout=3).json()["leases"]["held"])
        except (requests.RequestException, ValueError, KeyError, TypeError):
            return None

    # -- the link ---------------------------------------------------------------------------------------
    def _link(self, kind: str) -> Fault:
        link = self.cluster.link
        server = self.cluster.link_server
        fault = Fault(kind, link.name if link else "prefill→decode link",
                      server.entry.model if server is not None else None)
        if link is None:
            fault.skipped = self.cluster.link_skipped or "no namespaced link in this cluster"
            return fault
        self.say(f"fault {kind} on {fault.target}")
        try:
            self._link_fault(link, kind, fault)
        except Exception as exc:  # noqa: BLE001 - a tool that fails here (tc without tbf): skipped, said why
            link.restore()
            fault.skipped = f"{type(exc).__name__}: {exc}"
        return fault

    def _link_fault(self, link, kind: str, fault: Fault) -> None:
        if kind == "link_slow":
            fault.start = time.perf_counter()
            link.slow(self.slow_mbit)
            fault.detail["rate_mbit"] = self.slow_mbit
        else:
            # in the middle of a KV transfer: the link slowed to a crawl so that a transfer lasts, then cut as soon
            # as bytes of one are in flight on the data path (up to 3 link_s, at least 15 s, of waiting: else it
            # is cut all the same, and detail.mid_transfer says it was not)
            link.slow(CRAWL_MBIT)
            deadline = time.perf_counter() + max(3 * self.link_s, 15.0)
            in_flight = 0
            while time.perf_counter() < deadline and not in_flight:
                in_flight = link.bytes_in_flight()
                if not in_flight:
                    time.sleep(0.002)
            fault.start = time.perf_counter()
            link.cut()
            fault.detail["kv_bytes_in_flight_at_cut"] = in_flight
            fault.detail["mid_transfer"] = bool(in_flight)
        try:
            time.sleep(self.link_s)
        finally:
            link.restore()
            fault.end = time.perf_counter()

    def close(self) -> None:
        self.session.close()
