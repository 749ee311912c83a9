"""A bench run from start to report: check the input, (start the cluster), load it and its peers in alternating
phases, check parallel efficiency, (stop a server and time the failover), then write the report.

Everything that can be wrong with the input is found before any load is sent (``prepare``). Ctrl-C at any
point after that still writes what was measured, marked incomplete.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .. import config as cluster_config
from ..errors import ConfigError
from . import report as bench_report
from .endpoints import ClientEndpoint, HttpEndpoint, peer_endpoint
from .options import BenchOptions
from .load import LoadShape, Phase, run_group
from .machines import MachineMonitor
from .workloads import Workload, load_workload, pairs_for_efficiency


@dataclass
class Prepared:
    options: BenchOptions
    config: object  # ClusterConfig
    workload: Workload
    peers: list
    shape: LoadShape


def prepare(options: BenchOptions) -> Prepared:
    """Everything checked before any load: options, config, workload (every JSONL line), peers answering."""
    options.check()
    cfg = cluster_config.load(options.config)
    if options.chaos_server:
        cfg.find_server(options.chaos_server)
    workload = load_workload(options.workload, cfg, options.max_tokens, options.seed, options.notebooks,
                             options.rubric)
    for key in options.peer_models:
        if key not in cfg.models:
            raise ConfigError(f"--peer-model {key}=...: {key!r} is not a model of {cfg.source} "
                              f"({', '.join(cfg.models)})", field="--peer-model")
    timeout = float(cfg.client.get("decode_timeout", 180.0))
    peers = [peer_endpoint(spec, cfg, options.peer_models, timeout) for spec in options.peers]
    for peer in peers:
        peer.check()
    n_requests = options.requests
    if options.duration_s is None and n_requests is None:  # one pass over the workload
        n_requests = sum(len(u.requests) for u in workload.units)
    shape = LoadShape(concurrency=None if options.rate else (options.concurrency or 1), rate=options.rate,
                      duration_s=options.duration_s, requests=n_requests)
    return Prepared(options, cfg, workload, peers, shape)


class Progress:
    def __init__(self, say):
        self.say = say

    def __call__(self, phase: Phase) -> None:
        samples = list(phase.result.samples)
        done = [s for s in samples if s.timing is not None]
        ok = [s for s in done if s.ok]
        elapsed = time.perf_counter() - phase.result.started
        left = ""
        if phase.shape.duration_s:
            left = f", {max(0.0, phase.shape.duration_s - elapsed):.0f} s left"
        elif phase.shape.requests:
            left = f" of {phase.shape.requests}"
        e2el = sorted(s.timing.e2el for s in ok)
        p95 = f", p95 E2EL {e2el[int(0.95 * (len(e2el) - 1))]:.2f} s" if e2el else ""
        self.say(f"  [{phase.side} {phase.stage} {phase.phase + 1}] {len(samples)} sent{left}, {len(ok)} done, "
                 f"{len(done) - len(ok)} failed, {len(ok) / elapsed if elapsed > 0 else 0:.2f} req/s{p95}")


class Chaos:
    """Stop one server of the local cluster mid-load, then start it again (``--chaos``)."""

    def __init__(self, cluster, name: str, down_s: float, say):
        self.cluster, self.name, self.down_s, self.say = cluster, name, down_s, say
        self.record: dict = {"server": name}
        self.thread: threading.Thread | None = None

    def attach(self, phase: Phase) -> None:
        self.thread = threading.Thread(target=self._run, args=(phase,), daemon=True, name="bench-chaos")
        self.thread.start()

    def _when(self, phase: Phase) -> bool:
        shape = phase.shape
        if shape.duration_s:
            return time.perf_counter() - phase.result.started >= shape.duration_s / 3
        return len(phase.result.samples) >= max(1, (shape.requests or 3) // 3)

    def _run(self, phase: Phase) -> None:
        while not self._when(phase):
            if phase.stop.is_set() or phase.sending_over.is_set():
                self.record["skipped"] = "the phase ended before the stop was due"
                return
            time.sleep(0.05)
        proc = self.cluster.process(self.name)
        self.record["model"] = proc.entry.model
        self.say(f"  chaos: stopping {self.name}")
        self.record["stopped_at"] = time.perf_counter()
        proc.kill()
        time.sleep(self.down_s)
        self.say(f"  chaos: starting {self.name} again")
        self.record["restarted_at"] = time.perf_counter()
        try:
            proc.restart()
            self.cluster.wait_healthy(timeout=300, names=[self.name])
            self.record["healthy_at"] = time.perf_counter()
        except Exception as exc:  # noqa: BLE001 - reported, the run goes on
            self.record["restart_error"] = f"{type(exc).__name__}: {exc}"


def _start_local(cfg, options: BenchOptions, say):
    from ..ops.cluster import LocalCluster

    cluster = LocalCluster(cfg, free_ports=True, gateway=options.via == "gateway")
    say(f"starting the local cluster: {len(cluster.entries)} servers from {cfg.source} (logs in {cluster.log_dir})")
    cluster.start()
    try:
        cluster.wait_healthy(timeout=options.startup_timeout_s, progress=lambda n, m: say(f"  [{n}] {m}"))
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _our_endpoint(prepared: Prepared, cluster):
    options, cfg = prepared.options, prepared.config
    if options.via == "gateway":
        url = cluster.gateway.url if cluster is not None else \
            f"http://{cfg.gateway['host']}:{cfg.gateway['port']}"
        gateway = HttpEndpoint("ours", url, "openai", {}, float(cfg.client.get("decode_timeout", 180.0)), role="gateway")
        gateway.check()
        return gateway
    return ClientEndpoint(cluster.config if cluster is not None else cfg)


def _server_entries(prepared: Prepared, cluster) -> list:
    if cluster is None:
        return list(prepared.config.servers)
    return [p.entry for p in cluster.processes]


def _check_cluster(endpoint) -> None:
    """Through the client: every model needs a decode server that answers, else nothing is sent."""
    client = getattr(endpoint, "client", None)
    if client is None:
        return
    rows = client.check_health()  # the client logs each server it finds down
    for model in client.config.models:
        if not any(r["up"] for r in rows if r["model"] == model and r["role"] == "decode"):
            raise ConfigError(f"no decode server of model {model!r} answers: nothing to measure "
                              "(disagg status shows the cluster)", field="--config")


def _sweep_shapes(prepared: Prepared, first: list) -> list[LoadShape]:
    """The rates between one at a time and as fast as the cluster takes them, from ours' first two stages."""
    per_unit = sum(len(u.requests) for u in prepared.workload.units) / max(1, len(prepared.workload.units))
    rates = [p.counts()["completed"] / p.wall_s / per_unit for p in first if p.wall_s > 0]
    if len(rates) < 2 or not all(rates):
        return []
    low, high = sorted(rates[:2])
    n = prepared.options.sweep_rates
    base = prepared.shape
    return [LoadShape(rate=round(low + (high - low) * (i + 1) / (n + 1), 4), duration_s=base.duration_s,
                      requests=base.requests) for i in range(n)]


def execute(prepared: Prepared, say) -> dict:
    """Run the bench; return the report (also when interrupted: ``complete`` false)."""
    options = prepared.options
    started_wall, started = time.time(), time.perf_counter()
    cluster = _start_local(prepared.config, options, say) if options.local_cluster else None
    ours = None
    state = {"phases": [], "efficiency": {}, "interrupted": None, "chaos": None, "monitor": None}
    try:
        ours = _our_endpoint(prepared, cluster)
        _check_cluster(ours)
        monitor = MachineMonitor(_server_entries(prepared, cluster), token=os.environ.get("DISAGG_API_TOKEN"))
        monitor.discover()
        monitor.start()
        state["monitor"] = monitor
        chaos = None
        if options.chaos:
            name = options.chaos_server or prepared.config.prefill_servers[0].name
            chaos = state["chaos"] = Chaos(cluster, name, options.chaos_down_s, say)
        try:
            _load(prepared, ours, chaos, state, say)
            if not state["interrupted"]:
                _efficiency(prepared, ours, state, say)
        except KeyboardInterrupt:
            state["interrupted"] = "interrupted (Ctrl-C)"
        if chaos is not None and chaos.thread is not None:
            chaos.thread.join(timeout=options.chaos_down_s + 310)
        monitor.stop()
    finally:
        for endpoint in [ours, *prepared.peers]:
            if endpoint is not None:
                endpoint.close()
        if cluster is not None:
            say("stopping the local cluster...")
            cluster.stop()
    return bench_report.build(prepared, state, started_wall, started)


def _load(prepared: Prepared, ours, chaos, state: dict, say) -> None:
    options = prepared.options
    sides = [("ours", ours)] + [(p.name, p) for p in prepared.peers]
    phases = options.phases or (2 if prepared.peers else 1)
    if options.sweep:
        top = options.concurrency or 16
        stages = [("sync", LoadShape(concurrency=1, duration_s=prepared.shape.duration_s,
                                     requests=prepared.shape.requests)),
                  ("throughput", LoadShape(concurrency=top, duration_s=prepared.shape.duration_s,
                                           requests=prepared.shape.requests))]
    else:
        stages = [("load", prepared.shape)]
    units = prepared.workload.units
    progress = Progress(say)
    i = 0
    while i < len(stages):
        stage, base = stages[i]
        shape = LoadShape(base.concurrency, base.rate, base.duration_s / phases if base.duration_s else None,
                          -(-base.requests // phases) if base.requests else None)
        for p in range(phases):
            offset = (p * len(units)) // phases
            for side, endpoint in sides:
                say(f"{side}: {stage} ({shape.label}), phase {p + 1} of {phases}")
                phase = Phase(endpoint, _rotated(prepared.workload, offset),
                              shape, side=side, stage=stage, phase=p, seed=options.seed, grace_s=options.grace_s,
                              progress=progress)
                if chaos is not None and side == "ours" and chaos.thread is None:
                    chaos.attach(phase)
                if state.get("monitor") is not None:
                    state["monitor"].sample()  # a reading at each phase's edges: its busy share is its own
                result = phase.run()
                state["phases"].append(result)
                if state.get("monitor") is not None:
                    state["monitor"].sample()
                if result.interrupted:
                    state["interrupted"] = "interrupted (Ctrl-C)"
                    return
        if options.sweep and stage == "throughput":
            first = [r for r in state["phases"] if r.side == "ours" and r.stage in ("sync", "throughput")]
            stages += [(f"sweep {k + 1}", s) for k, s in enumerate(_sweep_shapes(prepared, first))]
        i += 1


def _rotated(workload: Workload, offset: int):
    units = workload.units[offset:] + workload.units[:offset]
    while True:
        yield from units


def _efficiency(prepared: Prepared, ours, state: dict, say) -> None:
    """Seed 004's parallel efficiency: each group of requests on different models sent all at once, and the same
    one after the other; the sum of the sequential walls over the sum of the parallel ones. The order alternates
    group by group, so that a server's prefix cache favours neither."""
    groups = pairs_for_efficiency(prepared.workload, prepared.options.efficiency_groups)
    sides = [("ours", ours)] + [(p.name, p) for p in prepared.peers]
    for side, endpoint in sides:
        runs = []
        if groups:
            say(f"{side}: parallel efficiency, {len(groups)} group(s) in parallel and one model after the other")
        for k, group in enumerate(groups):
            order = (True, False) if k % 2 == 0 else (False, True)
            walls, samples = {}, []
            for parallel in order:
                wall, got = run_group(endpoint, group, parallel, side, "efficiency")
                walls["parallel" if parallel else "sequential"] = wall
                samples += got
            runs.append({"models": [r.model for r in group], **{k2: round(v, 4) for k2, v in walls.items()},
                         "failed": [s.timing.error for s in samples if not s.ok]})
        state["efficiency"][side] = {"groups": runs, "available": bool(groups)}


def main(options: BenchOptions, say, show) -> int:
    """``disagg bench``: check, run, write the report, show the table (``show``: standard output). 0 when the run
    completed (whatever the figures), 130 when it was interrupted (the report written all the same)."""
    from .table import render

    prepared = prepare(options)
    report = execute(prepared, say)
    bench_report.write(report, Path(options.out), say)
    show(render(report["success_metrics"]))
    for peer in report["peers"]:
        show(f"\nagainst {peer['name']}: " + ", ".join(
            f"{c['name']} {c['ours_over_peer']:.3g}x" for c in peer["comparison"] if c["ours_over_peer"] is not None)
             + " (ours / peer)")
    if not report["complete"]:
        say(f"incomplete: {report['incomplete_reason']} (the report has what was measured)")
        return 130
    return 0
