"""The report's PNG charts (matplotlib, drawn without a display):

- ``latency.png``: the end-to-end latency of every answered request, by model, for the cluster and each peer;
- ``load.png``: TTFT (p50, p95) and the answered rate against the offered load of each stage, the SLO knee
  marked (a sweep gives several stages; a run of one load, one point a side);
- ``timeline.png``: sampled requests of the cluster on one time axis, each split into prefill, KV transfer
  and decode (seed 003's "Data Flow Timeline", with measured numbers).
"""
from __future__ import annotations

from pathlib import Path

COLORS = {"prefill": "#4c72b0", "kv": "#dd8452", "decode": "#55a868", "wait": "#cccccc"}


def draw(report: dict, out: Path) -> tuple[list[str], str | None]:
    """Draw what the report has data for; the file names, and why none were drawn (or None)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "matplotlib is not installed: no charts (pip install matplotlib)"
    drawn = []
    for name, fn in (("latency.png", _latency), ("load.png", _load), ("timeline.png", _timeline)):
        fig = fn(plt, report)
        if fig is not None:
            fig.savefig(out / name, dpi=110, bbox_inches="tight")
            plt.close(fig)
            drawn.append(name)
    return drawn, None if drawn else "no request was answered: nothing to draw"


def _latency(plt, report: dict):
    detail = [d for d in report["requests_detail"] if d["ok"] and d["stage"] != "efficiency"]
    groups = {}
    for d in detail:
        groups.setdefault(f"{d['side']}\n{d['model']}", []).append(d["e2el_s"])
    if not groups:
        return None
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(groups)), 4))
    labels = sorted(groups, key=lambda k: (not k.startswith("ours"), k))
    ax.boxplot([groups[k] for k in labels], showfliers=True)
    ax.set_xticks(range(1, len(labels) + 1), labels)
    target = next((r["target"] for r in report["success_metrics"] if r["name"] == "e2e_latency_p95_s"), None)
    if target is not None:
        ax.axhline(target, color="red", linestyle="--", linewidth=1, label=f"target p95 < {target:g} s")
        ax.legend(loc="upper right")
    ax.set_ylabel("end-to-end latency (s)")
    ax.set_title("Latency distribution per model")
    return fig


def _load(plt, report: dict):
    sides = [("ours", report.get("stages") or [], report.get("knee"))]
    sides += [(p["name"], p.get("stages") or [], None) for p in report["peers"]]
    if not any(s for _, s, _ in sides):
        return None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for name, stages, knee in sides:
        points = sorted((s for s in stages if s["offered_req_s"]), key=lambda s: s["offered_req_s"])
        if not points:
            continue
        x = [s["offered_req_s"] for s in points]
        top.plot(x, [s["p50_ttft_s"] for s in points], marker="o", label=f"{name} p50")
        top.plot(x, [s["p95_ttft_s"] for s in points], marker="^", linestyle="--", label=f"{name} p95")
        bottom.plot(x, [s["throughput_req_s"] for s in points], marker="o", label=name)
        if knee:
            knee_x = next(s["offered_req_s"] for s in points if s["stage"] == knee["stage"])
            for ax in (top, bottom):
                ax.axvline(knee_x, color="red", linestyle=":", linewidth=1)
            top.annotate("SLO knee", (knee_x, top.get_ylim()[1] * 0.9), color="red")
    top.set_ylabel("TTFT (s)")
    top.legend(fontsize=8)
    bottom.set_ylabel("answered (req/s)")
    bottom.legend(fontsize=8)
    bottom.set_xlabel("offered load (requests/s: the Poisson rate; for a fixed concurrency, what it reached)")
    top.set_title("TTFT and throughput against load")
    return fig


def _timeline(plt, report: dict):
    rows = report.get("timeline") or []
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    for i, r in enumerate(rows):
        start, e2el = r["start_s"], r["e2el_s"]
        prefill, kv, decode = (r.get("prefill_s") or 0.0), (r.get("kv_transfer_s") or 0.0), (r.get("decode_s") or 0.0)
        known = prefill + kv + decode
        wait = max(0.0, e2el - known)  # routing, queueing, the network: the rest of the client's time
        x = start
        for part, width in (("prefill", prefill), ("kv", kv), ("decode", decode), ("wait", wait)):
            if width > 0:
                ax.barh(i, width, left=x, color=COLORS[part], edgecolor="none")
                x += width
    ax.set_yticks(range(len(rows)), [f"#{r['index']} {r['model']} ({r.get('method') or '?'})" for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the first request")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in COLORS]
    ax.legend(handles, ["prefill", "KV transfer", "decode", "other (routing, queue, network)"], fontsize=8,
              loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4, frameon=False)
    ax.set_title("Sampled requests: prefill, KV transfer, decode")
    return fig
