"""bench.md: the success-metric table, then per-model figures, then the peer comparison."""
from __future__ import annotations

from .table import fmt


def _cell(value, unit="") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}{unit}"
    return f"{value}{unit}"


def _metric_rows(rows: list[dict]) -> list[str]:
    lines = ["| metric | target | value | status | note |", "|---|---|---|---|---|"]
    for r in rows:
        target = ("< " if r["better"] == "lower" else "> ") + fmt(r["target"], r["unit"])
        label = r["value"] is not None and r.get("basis") == "estimated"
        value = fmt(r["value"], r["unit"]) + (" (estimated)" if label else "")
        lines.append(f"| {r['name']} | {target} | {value} | {r['status'].replace('_', ' ')} | "
                     f"{(r.get('reason') or '').replace('|', '/')} |")
    return lines


def _model_rows(models: dict) -> list[str]:
    lines = ["| model | sent | completed | failed | mean TTFT | p95 TTFT | mean TPOT | p95 E2EL | prefill | "
             "KV transfer | decode | methods | energy / request |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for model, m in models.items():
        s = m.get("serving") or {}
        h = m["handoff"]
        ms = lambda k: _cell(s.get(k), " ms")  # noqa: E731
        sec = lambda v: _cell(v, " s")  # noqa: E731
        methods = ", ".join(f"{k} {v}" for k, v in h["methods"].items()) or "-"
        lines.append(f"| {model} | {m['requests']['sent']} | {m['requests']['completed']} | "
                     f"{m['requests']['failed']} | {ms('mean_ttft_ms')} | {ms('p95_ttft_ms')} | {ms('mean_tpot_ms')} | "
                     f"{ms('p95_e2el_ms')} | {sec(h['mean_prefill_s'])} | {sec(h['mean_kv_transfer_s'])} | "
                     f"{sec(h['mean_decode_s'])} | {methods} | {_cell(m['energy_j_per_request'], ' J')} |")
    return lines


def render(report: dict) -> str:
    req = report["requests"]
    out = ["# disagg bench", ""]
    if not report["complete"]:
        out += [f"**Incomplete:** {report['incomplete_reason']}. The figures cover what was measured until then.", ""]
    out += [f"- started {report['started_at']}; config `{report['cluster']['config']}`"
            f"{' (started by the bench)' if report['cluster']['local'] else ''}, via {report['cluster']['via']}",
            f"- workload `{report['workload']['name']}`: {report['workload']['units']} units, "
            f"{report['workload']['requests_per_pass']} requests a pass, models {', '.join(report['workload']['models'])}",
            f"- requests: {req['sent']} sent, {req['completed']} completed, {req['failed']} failed in "
            f"{report['duration_s']:.2f} s (the cluster's phases)",
            f"- command: `{report['command']}`", "",
            "## Seed 004's success metrics", ""]
    out += _metric_rows(report["success_metrics"]) + [""]
    out += ["## Per model", ""] + _model_rows(report["models"]) + [""]
    energy = report.get("energy") or {}
    if energy.get("machines"):
        out += ["## Machines", "", "| machine | servers | energy | basis | CPU busy | GPU busy | hardware cost |",
                "|---|---|---|---|---|---|---|"]
        for m in energy["machines"]:
            out.append(f"| {m['machine']} | {', '.join(m['servers'])} | {_cell(m['energy_j'], ' J')} | "
                       f"{m['energy_basis'] or (m['energy_reason'] or '-').replace('|', '/')} | "
                       f"{_cell(m['cpu_busy'])} | {_cell(m['gpu_busy'])} | {_cell(m['hardware_cost_usd'], ' USD')} |")
        out.append("")
    if report.get("failover"):
        f = report["failover"]
        out += ["## Failover (--chaos)", "",
                f"Stopped `{f.get('server')}` ({f.get('model')}) {f.get('stopped_after_s', '-')} s into the load, "
                f"started it again at {f.get('restarted_after_s', '-')} s, healthy at {f.get('healthy_after_s', '-')} s. "
                f"Requests sent in the {f.get('window_s', '-')} s after the stop: {f.get('window_requests', 0)}, "
                f"failed {f.get('window_failed', 0)}.", ""]
    if report.get("stages") and len(report["stages"]) > 1:
        out += ["## Load stages", "", "| stage | load | offered | answered | p50 TTFT | p95 TTFT | p95 E2EL | errors | "
                "SLOs |", "|---|---|---|---|---|---|---|---|---|"]
        for s in report["stages"]:
            out.append(f"| {s['stage']} | {s['load']} | {_cell(s['offered_req_s'], ' req/s')} | "
                       f"{_cell(s['throughput_req_s'], ' req/s')} | "
                       f"{_cell(s['p50_ttft_s'], ' s')} | {_cell(s['p95_ttft_s'], ' s')} | {_cell(s['p95_e2el_s'], ' s')} | "
                       f"{_cell(s['error_rate'])} | {'hold' if s['slo_ok'] else 'broken'} |")
        knee = report.get("knee")
        out += ["", f"Knee: {knee['stage']}, offered {knee['offered_req_s']:.3g} req/s, answered "
                    f"{knee['throughput_req_s']:.3g} req/s." if knee else
                "Knee: the SLOs held at no stage.", ""]
    for peer in report["peers"]:
        out += [f"## Against {peer['name']} ({peer['protocol']}, {peer['url']})", "",
                f"{peer['requests']['sent']} sent, {peer['requests']['completed']} completed, "
                f"{peer['requests']['failed']} failed in {peer['duration_s']:.2f} s; the same requests, phases "
                "alternating with the cluster's.", "",
                "| metric | ours | peer | ours / peer | better |", "|---|---|---|---|---|"]
        for c in peer["comparison"]:
            out.append(f"| {c['name']} | {fmt(c['ours'], c['unit'])} | {fmt(c['peer'], c['unit'])} | "
                       f"{_cell(c['ours_over_peer'])} | {c['better'] or '-'} |")
        out += ["", "Per model on the peer:", ""] + _model_rows(peer["models"]) + [""]
    if report["failures"]["by_reason"]:
        out += ["## Failures", ""] + [f"- {n} x {reason}" for reason, n in report["failures"]["by_reason"].items()]
        out.append("")
    if report.get("charts"):
        out += ["## Charts", ""] + [f"![{c}]({c})" for c in report["charts"]] + [""]
    return "\n".join(out)
