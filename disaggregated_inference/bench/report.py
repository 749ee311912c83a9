"""The bench's report: bench.json (schema ``disagg-bench/1``, docs/bench.md), bench.md and the charts.

Figures under vLLM's names where vLLM has one (``serving``: ``request_throughput``, ``mean_ttft_ms``,
``p99_e2el_ms``, ...); the success-metric table under seed 004's names (``table.py``). Every figure is
computed from the requests this run sent: ``throughput_req_s`` is ``requests.completed / duration_s``, where
``duration_s`` is the time the cluster's phases took (from each phase's first request sent to its last
answered or cut).
"""
from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import numpy as np

from . import table
from .machines import attribute_energy
from .measure import handoff_parts, summarize

FORMAT = "disagg-bench/1"
PERCENTILES = (50, 95, 99)
TIMELINE_REQUESTS = 12


def _p(values, q):
    return round(float(np.percentile(values, q)), 6) if values else None


def _side(prepared, state, side: str) -> dict:
    """What one side's load phases measured: counts, duration, serving figures, the samples."""
    phases = [r for r in state["phases"] if r.side == side]
    samples = [s for r in phases for s in r.samples]
    duration = sum(r.wall_s for r in phases)
    done = [s for s in samples if s.ok]
    slo = {"e2el": prepared.options.targets.get("e2e_latency_p95_s", table.BY_NAME["e2e_latency_p95_s"].target)
           * 1000}
    serving = summarize([s.timing for s in samples], duration, slo, PERCENTILES) if duration > 0 else None
    return {"phases": phases, "samples": samples, "done": done, "duration_s": round(duration, 6),
            "requests": {"sent": len(samples), "completed": len(done), "failed": len(samples) - len(done)},
            "serving": serving}


def _efficiency(state, side: str) -> tuple[float | None, str | None, dict]:
    record = state["efficiency"].get(side)
    if record is None:
        return None, "not run (the run was interrupted before it)" if state["interrupted"] else "not run", {}
    if not record["available"]:
        return None, "the workload has requests of one model only: nothing to run in parallel", record
    good = [g for g in record["groups"] if not g["failed"]]
    if not good:
        return None, "every group had a failed request", record
    seq, par = sum(g["sequential"] for g in good), sum(g["parallel"] for g in good)
    record = {**record, "sequential_s": round(seq, 4), "parallel_s": round(par, 4),
              "definition": "seed 004: both models' requests at once against the same requests one model after "
                            "the other; sum of sequential walls / sum of parallel walls"}
    return seq / par if par > 0 else None, None, record


def _failover(state, ours: dict) -> tuple[float | None, str | None, dict | None]:
    chaos = state.get("chaos")
    if chaos is None:
        return None, "measured only with --local-cluster --chaos (the bench stops a server it started)", None
    rec = dict(chaos.record)
    if "stopped_at" not in rec:
        return None, rec.get("skipped") or "the server was not stopped", rec
    t_kill = rec["stopped_at"]
    after = sorted((s for s in ours["samples"] if s.request.model == rec.get("model") and s.sent_at >= t_kill
                    and s.ok), key=lambda s: s.finished)
    end_window = rec.get("healthy_at", rec.get("restarted_at", t_kill)) + 5.0
    around = [s for s in ours["samples"] if t_kill <= s.sent_at <= end_window]
    rec["window_s"] = round(end_window - t_kill, 3)
    rec["window_requests"] = len(around)
    rec["window_failed"] = sum(1 for s in around if not s.ok)
    rec["window_error_rate"] = round(rec["window_failed"] / len(around), 6) if around else None
    rec["failures"] = dict(Counter(s.timing.error for s in around if s.timing and not s.ok))
    for key in ("stopped_at", "restarted_at", "healthy_at"):
        if key in rec:
            rec[key.replace("_at", "_after_s")] = round(rec.pop(key) - ours_start(ours), 3)
    if not after:
        return None, f"no request of {rec.get('model')} sent after the stop was answered in this run", rec
    value = after[0].finished - t_kill
    rec["definition"] = ("from the stop to the end of the first answered request of the stopped server's model "
                         "sent after it (that request's own latency included)")
    return value, None, rec


def ours_start(side: dict) -> float:
    return min((r.started for r in side["phases"]), default=0.0)


def _energy_cost_util(prepared, state, ours: dict, targets: dict) -> tuple[list, dict]:
    monitor = state.get("monitor")
    options = prepared.options
    completed = ours["requests"]["completed"]
    if monitor is None:
        why = "the run ended before the machines were watched"
        return [table.row(n, None, targets, why) for n in ("cost_per_request_usd", "requests_per_kwh",
                                                            "hardware_utilization")], {}
    windows = [(r.started, r.ended) for r in ours["phases"]]
    summary = monitor.summary(windows)
    machines = summary["machines"]
    missing = [m for m in machines if m["energy_basis"] is None]
    bases = {m["energy_basis"] for m in machines} - {None}
    total_j = sum(m["energy_j"] or 0.0 for m in machines)
    kwh = total_j / 3.6e6
    energy = {"machines": machines, "total_j": round(total_j, 3) if machines and not missing else None,
              "basis": ("estimated" if "estimated" in bases else "measured") if bases and not missing else None}
    rows = []
    if missing:
        why = "; ".join(m["energy_reason"] for m in missing)
        rows.append(table.row("requests_per_kwh", None, targets, why))
    elif kwh <= 0 or not completed:
        rows.append(table.row("requests_per_kwh", None, targets, "no energy or no completed request in the run"))
    else:
        rows.append(table.row("requests_per_kwh", completed / kwh, targets,
                              "estimated from the config's power_watts" if energy["basis"] == "estimated" else None,
                              basis=energy["basis"]))
    # cost: the energy at --price-kwh plus each machine's hardware at its cost_per_hour
    hardware = [m["hardware_cost_usd"] for m in machines if m["hardware_cost_usd"] is not None]
    energy_usd = kwh * options.price_kwh if options.price_kwh is not None and not missing else None
    cost = {"price_kwh": options.price_kwh, "energy_usd": None if energy_usd is None else round(energy_usd, 10),
            "hardware_usd": round(sum(hardware), 10) if hardware else None}
    if not completed:
        rows.append(table.row("cost_per_request_usd", None, targets, "no completed request"))
    elif options.price_kwh is None and not hardware:
        rows.append(table.row("cost_per_request_usd", None, targets,
                              "give --price-kwh and/or the servers' cost_per_hour in the config"))
    elif options.price_kwh is not None and missing:
        rows.append(table.row("cost_per_request_usd", None, targets,
                              "the energy is not measured (see requests_per_kwh)" +
                              (f"; hardware alone: ${sum(hardware) / completed:.5f}" if hardware else "")))
    else:
        parts = [x for x in (energy_usd, sum(hardware) if hardware else None) if x is not None]
        note = None if energy_usd is not None and hardware else (
            "hardware only (no --price-kwh)" if energy_usd is None else "energy only (no server's cost_per_hour)")
        rows.append(table.row("cost_per_request_usd", sum(parts) / completed, targets, note,
                              basis=energy["basis"] if energy_usd is not None else None))
    busy = [m["gpu_busy"] if m["gpu_busy"] is not None else m["cpu_busy"] for m in machines]
    busy = [b for b in busy if b is not None]
    rows.append(table.row("hardware_utilization", sum(busy) / len(busy) if busy else None, targets,
                          None if busy else "no CPU or GPU reading from the cluster's machines",
                          detail="mean over machines of the GPU's busy share where it has one, else the CPU's"))
    # per request: each interval's energy shared by tokens among the requests in flight
    if energy["total_j"]:
        shares = attribute_energy(ours["samples"], monitor.intervals(windows))
        for s in ours["samples"]:
            s.energy_j = shares.get(id(s))
    energy["cost"] = cost
    return rows, energy


def _per_model(side: dict) -> dict:
    out = {}
    duration = side["duration_s"] or 0.0
    for model in sorted({s.request.model for s in side["samples"]}):
        samples = [s for s in side["samples"] if s.request.model == model]
        done = [s for s in samples if s.ok]
        parts = [handoff_parts(s.timing.metrics) for s in done]
        mean = lambda key: (round(sum(p[key] for p in parts if p[key] is not None) /  # noqa: E731
                                  max(1, sum(1 for p in parts if p[key] is not None)), 6)
                            if any(p[key] is not None for p in parts) else None)
        joules = [s.energy_j for s in done if s.energy_j is not None]
        out[model] = {
            "requests": {"sent": len(samples), "completed": len(done), "failed": len(samples) - len(done)},
            "serving": summarize([s.timing for s in samples], duration, None, PERCENTILES) if duration else None,
            "handoff": {"methods": dict(Counter(p["method"] for p in parts if p["method"])),
                        "mean_prefill_s": mean("prefill_s"), "mean_kv_transfer_s": mean("kv_transfer_s"),
                        "mean_decode_s": mean("decode_s")},
            "energy_j_per_request": round(sum(joules) / len(joules), 3) if joules else None,
        }
    return out


def _basic_rows(side: dict, targets: dict) -> list:
    done, req = side["done"], side["requests"]
    e2el = [s.timing.e2el for s in done]
    return [
        table.row("e2e_latency_p95_s", _p(e2el, 95), targets, None if e2el else "no request completed"),
        table.row("throughput_req_s", req["completed"] / side["duration_s"] if side["duration_s"] else None,
                  targets, None if side["duration_s"] else "nothing was sent"),
        table.row("error_rate", req["failed"] / req["sent"] if req["sent"] else None, targets,
                  None if req["sent"] else "nothing was sent"),
    ]


def _ordered(rows: list) -> list:
    order = {m.name: i for i, m in enumerate(table.METRICS)}
    return sorted(rows, key=lambda r: order[r["name"]])


def _stages(side: dict, targets: dict, per_unit: float) -> list:
    """Each load stage's figures; ``offered_req_s``: its Poisson rate in requests (a unit may hold several), and
    for a closed loop (concurrency) what it reached."""
    out = []
    e2e_target = targets.get("e2e_latency_p95_s", table.BY_NAME["e2e_latency_p95_s"].target)
    err_target = targets.get("error_rate", table.BY_NAME["error_rate"].target)
    for stage in dict.fromkeys(r.stage for r in side["phases"]):
        phases = [r for r in side["phases"] if r.stage == stage]
        samples = [s for r in phases for s in r.samples]
        done = [s for s in samples if s.ok]
        wall = sum(r.wall_s for r in phases)
        ttft = [s.timing.ttft for s in done]
        e2el = [s.timing.e2el for s in done]
        error_rate = (len(samples) - len(done)) / len(samples) if samples else None
        p95 = _p(e2el, 95)
        out.append({"stage": stage, "load": phases[0].shape.label, "offered_rate": phases[0].shape.rate,
                    "concurrency": phases[0].shape.concurrency, "sent": len(samples), "completed": len(done),
                    "throughput_req_s": round(len(done) / wall, 6) if wall else None,
                    "offered_req_s": round(phases[0].shape.rate * per_unit, 6) if phases[0].shape.rate else (
                        round(len(done) / wall, 6) if wall else None),
                    "p50_ttft_s": _p(ttft, 50), "p95_ttft_s": _p(ttft, 95), "p95_e2el_s": p95,
                    "error_rate": error_rate,
                    "slo_ok": bool(done) and p95 is not None and p95 < e2e_target and error_rate < err_target})
    return out


def _knee(stages: list) -> dict | None:
    """The highest offered load at which the SLOs (the latency and error-rate targets) still held."""
    ok = [s for s in stages if s["slo_ok"] and s["offered_req_s"]]
    if not ok:
        return None
    best = max(ok, key=lambda s: s["offered_req_s"])
    return {"stage": best["stage"], "offered_req_s": best["offered_req_s"],
            "throughput_req_s": best["throughput_req_s"], "p95_e2el_s": best["p95_e2el_s"]}


def _timeline(side: dict, t0: float) -> list:
    done = sorted(side["done"], key=lambda s: s.sent_at)
    step = max(1, len(done) // TIMELINE_REQUESTS)
    out = []
    for s in done[::step][:TIMELINE_REQUESTS]:
        out.append({"index": s.request.index, "model": s.request.model, "start_s": round(s.sent_at - t0, 4),
                    "ttft_s": round(s.timing.ttft, 4), "e2el_s": round(s.timing.e2el, 4),
                    **handoff_parts(s.timing.metrics)})
    return out


def _failures(samples) -> dict:
    failed = [s for s in samples if not s.ok]
    return {"by_reason": dict(Counter(s.timing.error if s.timing else "in flight" for s in failed).most_common(20)),
            "first": [{"index": s.request.index, "model": s.request.model, "phase": s.phase, "stage": s.stage,
                       "reason": s.timing.error if s.timing else "in flight"} for s in failed[:20]]}


def _detail(samples, t0: float) -> list:
    """Every request: who, what, when (seconds from the run's start), and its figures (vLLM's ``--save-detailed``)."""
    out = []
    for s in samples:
        t = s.timing
        ok = s.ok
        out.append({"side": s.side, "stage": s.stage, "phase": s.phase + 1, "index": s.request.index,
                    "model": s.request.model, "sent_s": round(s.sent_at - t0, 4), "ok": ok,
                    "ttft_s": round(t.ttft, 5) if ok else None, "e2el_s": round(t.e2el, 5) if ok else None,
                    "tpot_s": round(t.tpot, 6) if ok and t.tpot is not None else None,
                    "prompt_tokens": t.prompt_tokens if t else None, "output_tokens": t.output_tokens if t else None,
                    "energy_j": None if s.energy_j is None else round(s.energy_j, 4),
                    "error": None if ok else (t.error if t else "in flight")})
    return out


def build(prepared, state, started_wall: float, started: float) -> dict:
    options, targets = prepared.options, prepared.options.targets
    units = prepared.workload.units
    per_unit = sum(len(u.requests) for u in units) / max(1, len(units))
    ours = _side(prepared, state, "ours")
    rows = _basic_rows(ours, targets)
    value, why, efficiency = _efficiency(state, "ours")
    rows.append(table.row("parallel_efficiency", value, targets, why))
    value, why, failover = _failover(state, ours)
    rows.append(table.row("failover_time_s", value, targets, why))
    more, energy = _energy_cost_util(prepared, state, ours, targets)
    rows = _ordered(rows + more)
    peers = []
    for peer in prepared.peers:
        side = _side(prepared, state, peer.name)
        prow = _basic_rows(side, targets)
        value, why, peer_eff = _efficiency(state, peer.name)
        prow.append(table.row("parallel_efficiency", value, targets, why))
        prow.append(table.row("failover_time_s", None, targets, "the bench never stops a peer's server"))
        for name in ("cost_per_request_usd", "requests_per_kwh", "hardware_utilization"):
            prow.append(table.row(name, None, targets, "a peer exports no energy or utilization counter"))
        prow = _ordered(prow)
        peers.append({"name": peer.name, "url": peer.url, "protocol": peer.protocol,
                      "requests": side["requests"], "duration_s": side["duration_s"], "success_metrics": prow,
                      "comparison": table.comparison(rows, prow), "serving": side["serving"],
                      "models": _per_model(side), "parallel_efficiency": peer_eff, "stages": _stages(side, targets, per_unit),
                      "failures": _failures(side["samples"])})
    stages = _stages(ours, targets, per_unit)
    report = {
        "format": FORMAT,
        "complete": not state["interrupted"],
        "incomplete_reason": state["interrupted"],
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started_wall)),
        "command": options.command,
        "cluster": {"config": prepared.config.source, "local": options.local_cluster, "via": options.via,
                    "servers": [{"name": e.name, "role": e.role, "model": e.model, "host": e.host}
                                for e in prepared.config.servers]},
        "workload": {"name": prepared.workload.name, "units": len(prepared.workload.units),
                     "requests_per_pass": sum(len(u.requests) for u in prepared.workload.units),
                     "models": prepared.workload.models, "notes": prepared.workload.notes,
                     "max_tokens_cap": options.max_tokens, "seed": options.seed},
        "load": {"concurrency": prepared.shape.concurrency, "rate": prepared.shape.rate, "sweep": options.sweep,
                 "duration_s": options.duration_s, "requests": prepared.shape.requests,
                 "phases_per_side": options.phases or (2 if prepared.peers else 1), "grace_s": options.grace_s},
        "duration_s": ours["duration_s"],
        "requests": ours["requests"],
        "success_metrics": rows,
        "serving": ours["serving"],
        "models": _per_model(ours),
        "parallel_efficiency": efficiency,
        "failover": failover,
        "energy": energy,
        "utilization": {m["machine"]: {"cpu_busy": m["cpu_busy"], "gpu_busy": m["gpu_busy"]}
                        for m in energy.get("machines", [])},
        "stages": stages,
        "knee": _knee(stages) if options.sweep else None,
        "timeline": _timeline(ours, ours_start(ours)),
        "failures": _failures(ours["samples"]),
        "phases": [{"side": r.side, "stage": r.stage, "phase": r.phase + 1, "load": r.shape.label,
                    "started_s": round(r.started - started, 3), "wall_s": round(r.wall_s, 4), **r.counts(),
                    "cut": r.cut} for r in state["phases"]],
        "peers": peers,
        "requests_detail": _detail([s for r in state["phases"] for s in r.samples], started),
        "charts": [],
    }
    return report


def write(report: dict, out: Path, say) -> Path:
    """bench.json, bench.md and the charts under ``out``."""
    from . import charts
    from .markdown import render

    out.mkdir(parents=True, exist_ok=True)
    report["charts"], report["charts_skipped"] = charts.draw(report, out)
    (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "bench.md").write_text(render(report))
    say(f"report: {out / 'bench.json'}, {out / 'bench.md'}" + "".join(f", {out / c}" for c in report["charts"]))
    return out
