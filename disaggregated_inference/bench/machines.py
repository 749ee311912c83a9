"""The cluster's machines while the bench runs: energy, CPU and GPU busy share, and what the hardware costs.

Each machine is watched through one of its servers' ``/health`` once a second (``MachineMonitor``): the
``energy`` block (server/energy.py: cumulative joules by device, or why there are none), and the GPU's
utilization; the CPU's busy share is read here from the kernel's counters when the machine is this one
(loopback servers), else from ``/health``'s ``system_cpu_pct``. Servers are put on one machine when their
``energy.machine`` says so (else when their config host is the same), and a machine is counted once however
many servers it runs (the embedded cluster runs five on this one).

Where a machine has no energy counter and its servers' config gives ``power_watts``, its energy is estimated
as that draw times the time, and labelled ``estimated``; with neither, it is not measured and the reason is
the server's own. Energy is then given to requests: each interval's energy is shared among the requests in
flight in proportion to the tokens each handled in it (its prompt's tokens when its first piece arrived, one
for each piece after); an interval with no token is shared evenly among those in flight, and energy with no
request in flight is spread over all of them at the end.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import psutil
import requests

from .periodic import Periodic


@dataclass
class Machine:
    key: str
    servers: list = field(default_factory=list)  # ServerEntry
    url: str = ""  # the server whose /health is read
    local: bool = False
    power_watts: float | None = None
    cost_per_hour: float | None = None
    reason: str | None = None  # why its energy is not measured
    basis: str | None = None  # measured, estimated or None
    readings: list = field(default_factory=list)  # (t, joules or None, cpu busy 0..1 or None, gpu busy 0..1 or None)


def _gpu_busy(health: dict) -> float | None:
    gpu = (health.get("resources") or {}).get("gpu") or {}
    values = [d.get("utilization_pct") for d in gpu.get("devices") or [] if d.get("utilization_pct") is not None]
    return sum(values) / len(values) / 100.0 if values else None


class MachineMonitor(Periodic):
    thread_name = "bench-machines"

    def __init__(self, entries, interval: float = 1.0, token: str | None = None):
        self.entries, self.interval = list(entries), interval
        self.session = requests.Session()
        if token:
            self.session.headers["Authorization"] = f"Bearer {token}"
        self.machines: dict[str, Machine] = {}
        self._cpu_last = None
        self._lock = threading.Lock()

    def _health(self, url: str) -> dict | None:
        try:
            resp = self.session.get(url + "/health", timeout=3)
            return resp.json()
        except (requests.RequestException, ValueError):
            return None

    def _machine_health(self, m: Machine) -> dict:
        """The /health of the machine's first server that answers (one may be down: --chaos stops one)."""
        for url in dict.fromkeys([m.url] + [e.url for e in m.servers]):
            health = self._health(url)
            if health is not None:
                return health
        return {}

    def discover(self) -> None:
        """Group the servers by machine (their ``energy.machine``, else their host)."""
        from ..config import is_loopback

        for entry in self.entries:
            health = self._health(entry.url) or {}
            energy = health.get("energy") or {}
            key = energy.get("machine") or entry.machine
            m = self.machines.setdefault(key, Machine(key, url=entry.url, local=is_loopback(entry.host)))
            m.servers.append(entry)
            for attr in ("power_watts", "cost_per_hour"):
                value = getattr(entry, attr, None)
                if value is not None:
                    setattr(m, attr, max(value, getattr(m, attr) or 0.0))
            if energy.get("joules"):
                m.basis = "measured"
            elif m.basis is None:
                m.reason = energy.get("reason") or ("no answer from its /health" if not health else
                                                    "its servers report no energy (an older version?)")
        for m in self.machines.values():
            if m.basis is None and m.power_watts is not None:
                m.basis = "estimated"

    def _cpu_busy_here(self) -> float | None:
        times = psutil.cpu_times()
        idle = times.idle + getattr(times, "iowait", 0.0)
        total = sum(times)
        last, self._cpu_last = self._cpu_last, (idle, total)
        if last is None or total <= last[1]:
            return None
        return max(0.0, min(1.0, 1.0 - (idle - last[0]) / (total - last[1])))

    def sample(self) -> None:
        """One reading of every machine (the monitor's thread, and the run at each phase's edges)."""
        with self._lock:
            healths = {key: self._machine_health(m) for key, m in self.machines.items()}
            now = time.perf_counter()
            here = self._cpu_busy_here()
            for key, m in self.machines.items():
                health = healths[key]
                joules = (health.get("energy") or {}).get("joules")
                cpu = here if m.local else (health.get("resources") or {}).get("system_cpu_pct")
                if cpu is not None and not m.local:
                    cpu = cpu / 100.0
                m.readings.append((now, sum(joules.values()) if joules else None, cpu, _gpu_busy(health)))

    def start(self) -> None:
        if not self.machines:
            self.discover()
        super().start()

    def stop(self) -> None:
        super().stop()
        self.sample()
        self.session.close()

    # -- what the readings say about a set of windows (the cluster's phases) ---------------------------------
    def intervals(self, windows) -> list[tuple[float, float, float]]:
        """(start, end, joules of every machine with a basis) for each reading interval inside ``windows``."""
        out = []
        for m in self.machines.values():
            if m.basis is None:
                continue
            for (t0, j0, _, _), (t1, j1, _, _) in zip(m.readings, m.readings[1:]):
                share = _inside(t0, t1, windows)
                if share <= 0:
                    continue
                if m.basis == "measured":
                    if j0 is None or j1 is None or j1 < j0:
                        continue
                    joules = (j1 - j0) * share
                else:
                    joules = m.power_watts * (t1 - t0) * share
                out.append((t0, t1, joules))
        return out

    def summary(self, windows) -> dict:
        """Energy (J), busy shares and the hardware's cost over ``windows`` ([(start, end)] perf_counter)."""
        seconds = sum(max(0.0, b - a) for a, b in windows)
        machines = []
        for m in self.machines.values():
            joules = None
            if m.basis is not None:
                joules = 0.0
                for (t0, j0, _, _), (t1, j1, _, _) in zip(m.readings, m.readings[1:]):
                    share = _inside(t0, t1, windows)
                    if share > 0 and m.basis == "measured" and j0 is not None and j1 is not None and j1 >= j0:
                        joules += (j1 - j0) * share
                    elif share > 0 and m.basis == "estimated":
                        joules += m.power_watts * (t1 - t0) * share
            cpu, gpu = _busy(m.readings, 2, windows), _busy(m.readings, 3, windows)
            machines.append({
                "machine": m.key, "servers": [e.name for e in m.servers], "local": m.local,
                "energy_j": None if joules is None else round(joules, 3), "energy_basis": m.basis,
                "energy_reason": None if m.basis == "measured" else (
                    f"estimated from power_watts {m.power_watts:g} W (no counter: {m.reason})"
                    if m.basis == "estimated" else f"not measured on {m.servers[0].name}: {m.reason}"),
                "power_watts": m.power_watts, "cost_per_hour": m.cost_per_hour,
                "hardware_cost_usd": None if m.cost_per_hour is None else round(m.cost_per_hour * seconds / 3600, 10),
                "cpu_busy": None if cpu is None else round(cpu, 4),
                "gpu_busy": None if gpu is None else round(gpu, 4),
            })
        return {"seconds": round(seconds, 3), "machines": machines}


def _busy(readings, column: int, windows) -> float | None:
    """The busy share over the windows: each reading covers the time since the one before it, weighted by how
    much of that time lies inside them."""
    weighted = seconds = 0.0
    for before, now in zip(readings, readings[1:]):
        if now[column] is None:
            continue
        inside = _inside(before[0], now[0], windows) * (now[0] - before[0])
        weighted += now[column] * inside
        seconds += inside
    return weighted / seconds if seconds > 0 else None


def _inside(t0: float, t1: float, windows) -> float:
    """The share of [t0, t1] inside the windows."""
    if t1 <= t0:
        return 0.0
    covered = sum(max(0.0, min(t1, b) - max(t0, a)) for a, b in windows)
    return covered / (t1 - t0)


def attribute_energy(samples, intervals) -> dict[int, float]:
    """Joules per sample (by ``id``): each interval's energy shared among the samples in flight by their tokens."""
    share = {id(s): 0.0 for s in samples}
    idle = 0.0
    for t0, t1, joules in intervals:
        weights = {}
        for s in samples:
            t = s.timing
            end = s.finished or (t.ended if t else None) or t1
            if s.sent_at >= t1 or end <= t0:
                continue
            w = sum(1 for p in (t.pieces if t else []) if t0 <= p < t1)
            if t and t.pieces and t0 <= t.pieces[0] < t1:
                w += t.prompt_tokens
            weights[id(s)] = w
        if not weights:
            idle += joules
            continue
        total = sum(weights.values())
        for key, w in weights.items():
            share[key] += joules * (w / total if total else 1 / len(weights))
    if samples and idle:
        for key in share:
            share[key] += idle / len(samples)
    return share
