"""Seed 004's success metrics: each target, the measured value, and met, not met or not measured (why).

The design documents' "Success Metrics" (seed 004): end-to-end latency < 15 s, throughput > 10 req/s, parallel
efficiency > 1.5x, error rate < 0.1 %, failover time < 5 s, cost per request < $0.01, energy efficiency
> 50 req/kWh, hardware utilization > 60 %. ``--target NAME=VALUE`` overrides a target. The seed's uptime
(> 99.9 %) is not here: a run of minutes cannot measure it.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

MET, NOT_MET, NOT_MEASURED = "met", "not_met", "not_measured"


@dataclass(frozen=True)
class Metric:
    name: str
    target: float
    unit: str
    better: str  # "lower" or "higher": met when value < target, or value > target
    title: str


METRICS = (
    Metric("e2e_latency_p95_s", 15.0, "s", "lower", "End-to-end latency (p95)"),
    Metric("throughput_req_s", 10.0, "req/s", "higher", "Throughput"),
    Metric("parallel_efficiency", 1.5, "x", "higher", "Parallel efficiency"),
    Metric("error_rate", 0.001, "ratio", "lower", "Error rate"),
    Metric("failover_time_s", 5.0, "s", "lower", "Failover time"),
    Metric("cost_per_request_usd", 0.01, "USD", "lower", "Cost per request"),
    Metric("requests_per_kwh", 50.0, "req/kWh", "higher", "Energy efficiency"),
    Metric("hardware_utilization", 0.60, "ratio", "higher", "Hardware utilization"),
)
BY_NAME = {m.name: m for m in METRICS}


def parse_target(text: str) -> tuple[str, float]:
    """``NAME=VALUE`` (argparse ``type``): NAME one of the metrics, VALUE a number in its unit."""
    name, sep, value = text.partition("=")
    name = name.strip()
    if not sep:
        raise argparse.ArgumentTypeError(f"a target is NAME=VALUE, not {text!r}")
    if name not in BY_NAME:
        raise argparse.ArgumentTypeError(f"unknown metric {name!r}: one of {', '.join(BY_NAME)}")
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"target {name}: {value!r} is not a number") from None
    if number != number or number < 0:
        raise argparse.ArgumentTypeError(f"target {name}: {value!r} must be a number >= 0")
    return name, number


def row(name: str, value, targets: dict, reason: str | None = None, **extra) -> dict:
    """One line of the table; ``value`` None means not measured, and ``reason`` must say why."""
    metric = BY_NAME[name]
    target = targets.get(name, metric.target)
    if value is None:
        status = NOT_MEASURED
        reason = reason or "not measured"
    else:
        ok = value < target if metric.better == "lower" else value > target
        status = MET if ok else NOT_MET
        value = float(f"{float(value):.6g}")  # six significant digits: a cost per request may be tiny
    return {"name": name, "target": target, "value": value, "unit": metric.unit, "status": status,
            "reason": reason, "better": metric.better, **extra}


def comparison(ours: list[dict], theirs: list[dict]) -> list[dict]:
    """Each metric for both sides and the ratio ours / peer; ``better`` names the side the metric favours."""
    out = []
    peer_by = {r["name"]: r for r in theirs}
    for mine in ours:
        other = peer_by.get(mine["name"], {})
        a, b = mine.get("value"), other.get("value")
        ratio = round(a / b, 4) if a is not None and b not in (None, 0) else None
        better = None
        if a is not None and b is not None and a != b:
            lower_wins = mine["better"] == "lower"
            better = "ours" if (a < b) == lower_wins else "peer"
        elif a is not None and a == b:
            better = "same"
        out.append({"name": mine["name"], "unit": mine["unit"], "ours": a, "peer": b, "ours_over_peer": ratio,
                    "better": better})
    return out


def fmt(value, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "ratio":
        return f"{100 * value:.2f} %"
    if unit == "USD":
        return f"${value:.5f}"
    return f"{value:.3g} {unit}"


def render(rows: list[dict]) -> str:
    """The table as plain text (the terminal's, at the end of a run)."""
    lines = [f"{'metric':24} {'target':>12} {'value':>14}  status"]
    for r in rows:
        target = ("< " if r["better"] == "lower" else "> ") + fmt(r["target"], r["unit"])
        status = r["status"].replace("_", " ") + (f" ({r['reason']})" if r.get("reason") else "")
        lines.append(f"{r['name']:24} {target:>12} {fmt(r['value'], r['unit']):>14}  {status}")
    return "\n".join(lines)
