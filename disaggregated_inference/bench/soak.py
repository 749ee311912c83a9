"""The soak: a local cluster under steady load for a long time, with faults injected one after the other.

``SoakCluster`` starts, on free ports of its own, two prefill and two decode servers per model and a gateway
(``ops/cluster.LocalCluster``), kept running by the supervisor that restarts what dies (``ops/supervise``).
Where root and iproute2 are there, the second prefill server of the first model runs behind a link of its
own (``netns.DataLink``) for the link faults. ``run`` sends each model's requests on three paths
(``faults.PATHS``: the client's stream, the gateway's OpenAI SSE stream and its Ollama NDJSON stream) at a
steady Poisson rate (the bench's load generator, ``load.Phase``: one phase per model and path), injects the
faults of the schedule (``faults.Injector``) one every ``fault_every_s`` seconds after the warm-up, samples
every server's resources (``ResourceSampler``) and returns a ``SoakRun``, which ``soak_figures.build`` makes
figures of. Everything it started is stopped on every way out (an error, Ctrl-C, or SIGTERM or SIGHUP raised
as ``KeyboardInterrupt`` by the script).
"""
from __future__ import annotations

import copy
import os
import secrets
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace

import psutil
import requests

from .. import config as cluster_config
from ..errors import ConfigError
from ..ops.cluster import LocalCluster
from ..ops.supervise import Supervisor
from ..server.settings import from_cluster
from . import netns
from .endpoints import ClientEndpoint, HttpEndpoint
from .faults import KINDS, PATHS, Injector
from .load import LoadShape, Phase
from .periodic import Periodic
from .workloads import BenchRequest, Unit, chat_workload

ROLES = ("prefill", "decode")


@dataclass
class SoakOptions:
    config: object  # a cluster config (path, dict or ClusterConfig): its models, client and server sections
    duration_s: float = 1800.0
    rate: float = 0.5  # requests a second, per model and path (three paths)
    max_tokens: int = 16
    faults: tuple = KINDS
    fault_every_s: float = 60.0
    warmup_s: float = 60.0  # no fault, and no growth figure, before this
    settle_s: float = 5.0  # a request ending this long after a window is still counted inside it
    sample_every_s: float = 5.0
    stop_s: float = 10.0  # a SIGSTOP's length
    link_s: float = 10.0  # a link fault's length
    lease_s: float = 15.0  # the lease of a lease_fill's prefills
    fill_max: int = 200
    slow_mbit: float = 100.0
    grace_s: float = 120.0  # after the load, for the requests in flight
    startup_timeout_s: float = 600.0
    progress_every_s: float = 30.0
    use_link: bool = True  # a namespaced prefill server for the link faults, where root and the tools allow
    log_dir: str | None = None
    seed: int = 0


class SoakCluster:
    """The soak's servers and gateway; ``config`` (a dict) is the cluster as the client and gateway see it."""

    def __init__(self, base, *, use_link: bool = True, log_dir=None, say=lambda m: None):
        self.base = cluster_config.coerce(base)
        self.say = say
        self.link, self.link_server, self.link_skipped = None, None, None
        self.token = None
        if use_link:
            self.link_skipped = netns.unavailable()
        else:
            self.link_skipped = "the link faults were not asked for (no namespaced prefill server)"
        self.log_dir = log_dir
        self.cluster = None
        self.supervisor = None
        self._stop = threading.Event()
        self._supervising: threading.Thread | None = None

    # -- the config -----------------------------------------------------------------------------------
    def _source(self, link) -> dict:
        models = {key: copy.deepcopy(entry) for key, entry in self.base.models.items()}
        data = {"models": models, "client": dict(self.base.client), "server": dict(self.base.server),
                "gateway": {**self.base.gateway, "host": "127.0.0.1"}}
        for role in ROLES:
            data[f"{role}_servers"] = [{"name": f"soak-{role}-{model}-{i + 1}", "host": "127.0.0.1", "port": 1,
                                        "model": model} for model in models for i in range(2)]
        if link is not None:
            first = data["prefill_servers"][1]  # the first model's second prefill server: behind the link
            first.update(host=link.ctl, port=netns.PORT, data_url=f"http://{link.data}:{netns.PORT}")
            # it listens beyond loopback (in its namespace): every server and caller then needs the token
            self.token = self.base.server.get("api_token") or secrets.token_urlsafe(16)
            data["server"]["api_token"] = data["client"]["api_token"] = self.token
        return data

    @property
    def config(self) -> dict:
        """The cluster with the ports bound, the gateway's included (what the client and the gateway get)."""
        data = copy.deepcopy(self._data)
        ports = {p.entry.name: p.entry.port for p in self.cluster.processes}
        for role in ROLES:
            for s in data[f"{role}_servers"]:
                s["port"] = ports.get(s["name"], s["port"])
        if self.cluster.gateway is not None:
            data["gateway"].update(host=self.cluster.gateway.entry.host, port=self.cluster.gateway.entry.port)
        return data

    # -- starting and stopping ------------------------------------------------------------------------
    def start(self, timeout: float = 600.0) -> "SoakCluster":
        try:
            if self.link_skipped is None:
                try:
                    self.link = netns.DataLink().open()
                except netns.LinkUnavailable as exc:
                    self.link_skipped, self.link = str(exc), None
            self._data = self._source(self.link)
            loopback = [s["name"] for r in ROLES for s in self._data[f"{r}_servers"] if s["host"] == "127.0.0.1"]
            self.cluster = LocalCluster(self._data, names=loopback, free_ports=True, log_dir=self.log_dir)
            self.say(f"starting {len(self.cluster.entries) + (self.link is not None)} servers and a gateway "
                     f"(logs in {self.cluster.log_dir})")
            self.cluster.start()
            if self.link is not None:
                self.link_server = self._start_namespaced()
            self._start_gateway()
            self.cluster.wait_healthy(timeout=timeout)
            self.supervisor = Supervisor(self.cluster, self.say, first_delay=1.0, max_delay=5.0, stable_after=30.0)
            self._supervising = threading.Thread(target=self.supervisor.run, args=(self._stop, 0.25), daemon=True,
                                                 name="soak-supervisor")
            self._supervising.start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_namespaced(self):
        cfg = cluster_config.coerce(self._data)
        entry = cfg.prefill_servers[1]
        peers = [replace(e, port=self._port_of(e)) for e in cfg.prefill_servers]
        proc = netns.NamespacedProcess(entry, from_cluster(cfg, entry.name, prefill_entries=peers), self.link,
                                 self.cluster.log_dir / f"{entry.name}.log")
        proc.start(self.cluster.env)
        self.cluster.processes.append(proc)
        return proc

    def _port_of(self, entry) -> int:
        return next((p.entry.port for p in self.cluster.processes if p.entry.name == entry.name), entry.port)

    def _start_gateway(self):
        return self.cluster.start_gateway()  # in front of every server started, the namespaced one included

    def stop(self) -> None:
        self._stop.set()
        if self._supervising is not None:
            self._supervising.join(timeout=5)
        try:
            if self.cluster is not None:
                for proc in self.cluster.processes + ([self.cluster.gateway] if self.cluster.gateway else []):
                    _continue(proc)  # a stopped process cannot stop gracefully
                self.cluster.stop()
        finally:
            if self.link is not None:
                self.link.close()

    # -- what the faults act on -----------------------------------------------------------------------
    @property
    def gateway(self):
        return self.cluster.gateway

    def pick(self, role: str, occurrence: int):
        """The loopback server of ``role`` a fault's ``occurrence`` acts on: the models in turn, the first
        server of each (the namespaced one is the link faults')."""
        models = list(self.base.models)
        model = models[occurrence % len(models)]
        candidates = [p for p in self.cluster.processes
                      if p.entry.role == role and p.entry.model == model and p is not self.link_server]
        return candidates[0]

    def processes(self) -> list:
        return self.cluster.processes + [self.cluster.gateway]


def _continue(proc) -> None:
    if proc.proc is not None and proc.proc.poll() is None:
        try:
            os.killpg(proc.proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


class ResourceSampler(Periodic):
    """Every ``every`` seconds, each server's (and the gateway's) RSS, open files and threads, summed over its
    process group (gunicorn's master and worker: ``/proc`` through psutil), and a prefill server's leases held
    (its ``/health``); with the number of requests finished by then (``finished()``)."""

    thread_name, join_seconds = "soak-sampler", 30.0

    def __init__(self, cluster: SoakCluster, every: float, finished, session: requests.Session):
        self.cluster, self.interval, self.finished, self.session = cluster, every, finished, session
        self.rows: list[dict] = []
        self._rows_lock = threading.Lock()

    def sample(self) -> list[dict]:
        """One row per process, appended to ``rows`` together and returned: the soak's end samples while this
        thread may be sampling too, and a slow sample's rows must not interleave with another's."""
        now, done, rows = time.perf_counter(), self.finished(), []
        for proc in self.cluster.processes():
            row = {"t": now, "server": proc.entry.name, "role": proc.entry.role, "requests_done": done,
                   "pid": None, "rss_bytes": None, "open_files": None, "threads": None, "leases": None}
            if proc.proc is not None and proc.proc.poll() is None:
                read = _group_resources(proc.proc.pid)
                if read:  # a process that dies between the poll and the read is sampled as gone
                    row.update(pid=proc.proc.pid, **read)
            if proc.entry.role == "prefill":
                try:
                    row["leases"] = int(self.session.get(proc.url + "/health", timeout=1).json()["leases"]["held"])
                except (requests.RequestException, ValueError, KeyError, TypeError):
                    pass
            rows.append(row)
        with self._rows_lock:
            self.rows.extend(rows)
        return rows



def _group_resources(pid: int) -> dict:
    """The group's summed figures, or ``{}`` when its top process cannot be read (exited, or a zombie not yet
    reaped: a fault may kill it at any moment); a child that exits mid-read is left out of the sums."""
    out = {"rss_bytes": 0, "open_files": 0, "threads": 0}
    try:
        top = psutil.Process(pid)
        procs = [top] + top.children(recursive=True)
    except psutil.Error:
        return {}
    for p in procs:
        try:
            with p.oneshot():
                if p.status() == psutil.STATUS_ZOMBIE:  # /proc still answers, with zeros
                    raise psutil.ZombieProcess(p.pid)
                read = (p.memory_info().rss, p.num_fds(), p.num_threads())
        except psutil.Error:
            if p is top:
                return {}
            continue
        for key, value in zip(("rss_bytes", "open_files", "threads"), read):
            out[key] += value
    return out


def units_for(config, model: str, max_tokens: int, seed: int) -> list[Unit]:
    """The chat workload's short prompts for one model, each one's seed its own; the phase cycles through them
    (a request's ``index`` is made unique by the phase's count)."""
    prompts = [u.requests[0].kwargs["prompt"] for u in chat_workload(config, max_tokens, seed).units]
    prompts = list(dict.fromkeys(prompts))
    return [Unit((BenchRequest(i, model, {"model": model, "prompt": f"{p}", "max_tokens": max_tokens,
                                          "temperature": 0.0, "seed": seed + i}, source="soak"),), f"{model} {i}")
            for i, p in enumerate(prompts)]


def _cycled(units: list[Unit]):
    while True:
        yield from units


@dataclass
class SoakRun:
    """What ``run`` gathered; ``soak_figures.build`` turns it into the report."""

    options: SoakOptions
    started_wall: float
    origin: float  # perf_counter at the load's start
    phases: list = field(default_factory=list)
    faults: list = field(default_factory=list)
    samples: list = field(default_factory=list)
    log_dir: str = ""  # the servers' logs
    leases_at_drain: dict = field(default_factory=dict)  # right after the load drained
    leases_at_end: dict = field(default_factory=dict)  # after the leases faults left had their time
    link_skipped: str | None = None
    interrupted: str | None = None
    restarts: dict = field(default_factory=dict)
    ended: float = 0.0
    outcomes_recorded: Counter = field(default_factory=Counter)  # id(sample) -> outcomes recorded for it


def schedule(options: SoakOptions) -> list[tuple[float, str]]:
    """(seconds after the load's start, fault kind): one every ``fault_every_s`` after the warm-up, the kinds
    in turn, the last one starting early enough to end (and settle) before the load does."""
    out, t, i = [], options.warmup_s, 0
    room = options.stop_s + options.link_s + options.lease_s + options.settle_s
    while options.faults and t + room <= options.duration_s:
        out.append((t, options.faults[i % len(options.faults)]))
        t += options.fault_every_s
        i += 1
    return out


def run(options: SoakOptions, say) -> SoakRun:
    if not options.faults:
        say("no fault asked for: a steady run")
    unknown = [k for k in options.faults if k not in KINDS]
    if unknown:
        raise ConfigError(f"unknown fault {unknown[0]!r}: one of {', '.join(KINDS)}", field="--faults")
    cluster = SoakCluster(options.config, use_link=options.use_link, log_dir=options.log_dir, say=say)
    cluster.start(options.startup_timeout_s)
    result = SoakRun(options, time.time(), time.perf_counter(), link_skipped=cluster.link_skipped,
                     log_dir=str(cluster.cluster.log_dir))
    endpoints, injector, sampler = [], None, None
    stop = threading.Event()
    try:
        cfg = cluster.config
        client = ClientEndpoint(cfg)
        gateway = HttpEndpoint("gateway", f"http://127.0.0.1:{cfg['gateway']['port']}", "openai", {},
                               float(cfg["client"].get("decode_timeout", 180.0)), role="gateway")
        ollama = HttpEndpoint("gateway-ollama", gateway.url, "ollama", {}, gateway.timeout, role="gateway")
        if cluster.token:
            for http in (gateway, ollama):
                http.session.headers["Authorization"] = f"Bearer {cluster.token}"
        endpoints = [client, gateway, ollama]
        seen, seen_lock = result.outcomes_recorded, threading.Lock()

        def recorded(sample) -> None:  # every outcome the load records, counted per request sent
            with seen_lock:
                seen[id(sample)] += 1

        phases = []
        for model in cfg["models"]:
            units = units_for(cluster.base, model, options.max_tokens, options.seed)
            for path, endpoint in zip(PATHS, endpoints):
                shape = LoadShape(rate=options.rate, duration_s=options.duration_s)
                phases.append(Phase(endpoint, _cycled(units), shape,
                                    side=path, stage=model, phase=0, seed=options.seed, grace_s=options.grace_s,
                                    stop=stop, on_sample=recorded))
        finished = lambda: sum(1 for p in phases for s in list(p.result.samples) if s.done)  # noqa: E731
        sampler = ResourceSampler(cluster, options.sample_every_s, finished, injector_session(cluster))
        injector = Injector(cluster, stop_s=options.stop_s, link_s=options.link_s, lease_s=options.lease_s,
                            fill_max=options.fill_max, slow_mbit=options.slow_mbit,
                            heal_timeout=options.startup_timeout_s, say=say)
        result.origin = time.perf_counter()
        sampler.start()
        threading.Thread(target=_progress, args=(phases, result, stop, say, options.progress_every_s), daemon=True,
                         name="soak-progress").start()
        runners = [threading.Thread(target=p.run, daemon=True, name=f"soak-{p.side}-{p.stage}") for p in phases]
        for t in runners:
            t.start()
        result.phases = [p.result for p in phases]
        _inject_all(options, injector, result, stop, say, phases)
        for t in runners:
            while t.is_alive():
                t.join(timeout=0.5)
        stop.set()  # the progress lines end with the load
        result.ended = time.perf_counter()
        result.leases_at_end = _leases_at_end(cluster, sampler, result, options)
    except KeyboardInterrupt:
        result.interrupted = "interrupted (Ctrl-C or a stop signal)"
        stop.set()
    finally:
        stop.set()
        if sampler is not None:
            sampler.stop()
            result.samples = sampler.rows
        if cluster.supervisor is not None:
            result.restarts = dict(cluster.supervisor.restarts)
        for endpoint in endpoints:
            endpoint.close()
        if injector is not None:
            injector.close()
        say("stopping the soak cluster...")
        cluster.stop()
    result.ended = result.ended or time.perf_counter()
    return result


def _progress(phases, result: SoakRun, stop: threading.Event, say, every: float) -> None:
    while not stop.wait(every):
        samples = [s for p in phases for s in list(p.result.samples)]
        done = [s for s in samples if s.done]
        ok = sum(1 for s in done if s.ok)
        say(f"  {time.perf_counter() - result.origin:.0f} s: {len(samples)} sent, {ok} answered, "
            f"{len(done) - ok} failed, {len(samples) - len(done)} in flight; {len(result.faults)} faults so far")


def injector_session(cluster: SoakCluster) -> requests.Session:
    session = requests.Session()
    if cluster.token:
        session.headers["Authorization"] = f"Bearer {cluster.token}"
    return session


def _inject_all(options: SoakOptions, injector: Injector, result: SoakRun, stop, say, phases) -> None:
    started = result.origin
    for n, (at, kind) in enumerate(schedule(options)):
        while time.perf_counter() - started < at:
            if stop.is_set():
                return
            time.sleep(0.1)
        fault = injector.inject(kind, occurrence=sum(1 for f in result.faults if f.kind == kind))
        if fault.skipped and fault.start is not None:  # it failed half-way: what it did is undone, no window
            fault.start = fault.end = None
        result.faults.append(fault)
        if fault.skipped:
            say(f"fault {kind} skipped: {fault.skipped}")
        else:
            done = sum(1 for p in phases for s in list(p.result.samples) if s.done)
            say(f"fault {kind} on {fault.target}: {fault.end - fault.start:.1f} s; {done} requests finished so far")


def _prefill_leases(cluster: SoakCluster, sampler: ResourceSampler) -> dict:
    return {r["server"]: r["leases"] for r in sampler.sample() if r["role"] == "prefill"}


def _leases_at_end(cluster: SoakCluster, sampler: ResourceSampler, result: SoakRun, options: SoakOptions) -> dict:
    """Each prefill server's leases once the load has drained (``result.leases_at_drain``) and then once every
    lease a fault may have left has had its time: the cluster's ``lease_seconds`` after the last fault's end (a
    transfer cut off, a decode server stopped before its pull), a fill's own lease after the last fill."""
    result.leases_at_drain = _prefill_leases(cluster, sampler)
    ttl = float(cluster.base.server.get("lease_seconds", 30.0))
    due = [f.end + ttl for f in result.faults if f.end is not None]
    due += [f.end + options.lease_s for f in result.faults if f.kind == "lease_fill" and f.end is not None]
    if any(result.leases_at_drain.values()) and due:  # none held: nothing to wait for
        wait = max(due) + 2.0 - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
    time.sleep(1.5)  # the sweeper runs every second
    return _prefill_leases(cluster, sampler)


FLAGS = {"duration_s": "--duration", "rate": "--rate", "fault_every_s": "--fault-every", "warmup_s": "--warmup",
         "sample_every_s": "--sample-every", "stop_s": "--stop-seconds", "link_s": "--link-seconds",
         "lease_s": "--lease-seconds", "slow_mbit": "--slow-mbit"}


def check_options(options: SoakOptions) -> None:
    """Each option in range, named by its flag (``benchmarks/soak.py``'s), before anything starts."""
    for name, flag in FLAGS.items():
        value = getattr(options, name)
        if not value > 0 and not (name == "warmup_s" and value == 0):
            raise ConfigError(f"{flag} must be positive, got {value!r}", field=flag)
    if options.settle_s < 0:
        raise ConfigError(f"--settle must not be negative, got {options.settle_s!r}", field="--settle")
    if options.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be at least 1, got {options.max_tokens}", field="--max-tokens")
