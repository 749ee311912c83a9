"""The soak's figures, from what ``soak.run`` gathered (every request sent, every fault, every resource sample).

Definitions (times on the client's clock, ``time.perf_counter``):

- **sent**: requests the load sent (each model, each path: ``client`` is ``DisaggregatedClient.stream``,
  ``gateway`` the gateway's OpenAI-API stream, ``gateway-ollama`` its Ollama-API stream); **answered**:
  their stream ended with its final line (an empty answer, the model's end-of-text first, counts:
  ``answered_empty``); **failed**: the caller got an
  error (its text is kept, by path); **lost**: the caller got neither: a request still unanswered when
  the run had to give it up (``grace_s`` after the load stopped, or a stop of the run), or a stream that
  ended without its final line and without an error. ``sent = answered + failed + lost`` always.
- **duplicated**: a request with more than one outcome recorded, or an answer that streamed more pieces
  than any answer to the same prompt on the same model outside every fault window (the steps are
  deterministic and greedy: the same prompt streams the same pieces, on every path; one more is a piece
  delivered twice). Not the server's token count: a token may stream as two pieces (Gemma's tokenizer).
- **fault window**: from the fault's start to its end (``faults.py`` defines both for each kind). A request
  is *inside* a window when its lifetime (sent to outcome) overlaps ``[start, end + settle_s]`` and the fault
  can disturb it (its model, or every model for the gateway's faults, and its path); *outside* otherwise.
  ``settle_s`` covers what a fault leaves for a moment after it ends (a server marked down until its next
  health check). The error rates: failed (lost included) over the requests, outside and inside.
- **failover time** of one fault, for one model and path it can disturb: from the fault's start to the
  answer of the first request of that model and path *sent at or after the start* (so a request the fault
  caught does not count, and one answered by a server the fault left alone does: that is the failover).
  Per kind: p50 and max over every fault of the kind and every model and path. None where no request was
  answered after the fault before the run ended.
- **leases at the end**: each prefill server's leases held once the load has drained and every lease a
  fault may have left has had its time (the cluster's ``lease_seconds`` after the last fault, a fill's
  lease after the last fill), goal 0: a lease left then is a bundle nobody freed; ``leases_at_drain``:
  the same right after the load drained (leases a late fault left, still within their time).
- **growth per 1,000 requests**: for each server, the least-squares slope of its RSS (MiB), open files and
  threads against the requests finished (all paths), over the samples after the warm-up taken from its
  longest-lived process (a restart starts a new process, whose figures start over after a warm-up of its
  own); null with fewer than three samples or fewer than 20 requests in that span.
"""
from __future__ import annotations

import statistics
from collections import Counter

CUT_MARKS = ("still running", "interrupted", "the stream ended without its final line")
EMPTY = "no piece streamed before the final line"


def outcome(sample) -> tuple[str, str | None]:
    """("answered" | "failed" | "lost", the error) of one request."""
    t = sample.timing
    if t is None:
        return "lost", "no outcome when the run ended"
    if t.ended is not None and t.error in (None, EMPTY):
        return "answered", None
    if any(t.error.startswith(mark) for mark in CUT_MARKS):
        return "lost", t.error
    return "failed", t.error


def _short(error: str) -> str:
    return error if len(error) <= 160 else error[:157] + "..."


def _disturbs(fault, model: str, path: str) -> bool:
    return (fault.model is None or fault.model == model) and path in fault.paths


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def _prompt(sample) -> str:
    return str(sample.request.kwargs.get("prompt") or sample.request.kwargs.get("messages"))


def _baseline_pieces(samples, hits) -> dict:
    """(model, prompt) -> the pieces its answers streamed outside every fault window (the most of them)."""
    out: dict = {}
    for s, hit in zip(samples, hits):
        if not hit and outcome(s)[0] == "answered":
            key = (s.stage, _prompt(s))
            out[key] = max(out.get(key, 0), len(s.timing.pieces))
    return out


def _rate(failed: int, n: int) -> float | None:
    return None if n == 0 else round(failed / n, 6)


def build(run) -> dict:
    opts = run.options
    samples = [s for p in run.phases for s in p.samples]
    windows = [f for f in run.faults if f.window is not None]
    rows, by_path, errors = [], {}, Counter()
    inside = {"requests": 0, "failed": 0}
    outside = {"requests": 0, "failed": 0}
    counts = Counter()
    duplicated = sum(n - 1 for n in run.outcomes_recorded.values() if n > 1)
    hits = [any(_disturbs(f, s.stage, s.side) and s.sent_at <= f.end + opts.settle_s
                and (s.finished or run.ended) >= f.start for f in windows) for s in samples]
    baseline = _baseline_pieces(samples, hits)
    for s, hit in zip(samples, hits):
        kind, error = outcome(s)
        counts[kind] += 1
        model, path = s.stage, s.side
        t = s.timing
        repeated = run.outcomes_recorded.get(id(s), 1) > 1
        if kind == "answered":
            if t.error == EMPTY:
                counts["answered_empty"] += 1
            usual = baseline.get((model, _prompt(s)))
            if usual is not None and len(t.pieces) > usual:
                duplicated += 1
                repeated = True
        else:
            errors[f"{path}: {_short(error)}"] += 1
        bucket = inside if hit else outside
        bucket["requests"] += 1
        bucket["failed"] += kind != "answered"
        side = by_path.setdefault(path, Counter())
        side["sent"] += 1
        side[kind] += 1
        rows.append({"sent_s": round(s.sent_at - run.origin, 3), "path": path, "model": model,
                     "outcome": kind, "error": error, "e2el_s": round(t.e2el, 3) if kind == "answered" else None,
                     "in_fault_window": hit, "duplicated": repeated,
                     "pieces": len(t.pieces) if t is not None else 0,
                     "tokens": t.output_tokens if t is not None else 0})
    faults, failover = [], {}
    for f in run.faults:
        d = f.as_dict(run.origin)
        if f.window is not None:
            d["failover_s"] = {}
            for model, path in sorted({(s.stage, s.side) for s in samples}):  # the load's streams
                if not _disturbs(f, model, path):
                    continue
                firsts = [s.timing.ended for s in samples if s.stage == model and s.side == path
                          and s.sent_at >= f.start and outcome(s)[0] == "answered"]
                value = round(min(firsts) - f.start, 3) if firsts else None
                d["failover_s"][f"{model}/{path}"] = value
                if value is not None:
                    failover.setdefault(f.kind, []).append(value)
            d["requests_inside"] = sum(1 for r, s in zip(rows, samples) if r["in_fault_window"]
                                       and s.sent_at <= f.end + opts.settle_s and (s.finished or run.ended) >= f.start
                                       and _disturbs(f, s.stage, s.side))
        faults.append(d)
    leases_end = run.leases_at_end or {}
    sent = len(samples)
    report = {
        "complete": run.interrupted is None,
        "incomplete_reason": run.interrupted,
        "duration_s": round(run.ended - run.origin, 1),
        "requests": {"sent": sent, "answered": counts["answered"], "failed": counts["failed"],
                     "lost": counts["lost"], "duplicated": duplicated, "answered_empty": counts["answered_empty"],
                     "accounted": sent == counts["answered"] + counts["failed"] + counts["lost"]},
        "by_path": {p: dict(c) for p, c in sorted(by_path.items())},
        "error_rate": {"outside_fault_windows": {**outside, "rate": _rate(outside["failed"], outside["requests"])},
                       "inside_fault_windows": {**inside, "rate": _rate(inside["failed"], inside["requests"])}},
        "errors": dict(errors.most_common()),
        "failover_s": {kind: {"p50": round(statistics.median(v), 3), "max": round(max(v), 3), "n": len(v)}
                       for kind, v in sorted(failover.items())},
        "faults": faults,
        "faults_skipped": {f.kind: f.skipped for f in run.faults if f.skipped},
        "link": {"used": run.link_skipped is None, "skipped": run.link_skipped},
        "leases_at_drain": run.leases_at_drain,
        "leases_at_end": leases_end,
        "leases_held_at_end": sum(v for v in leases_end.values() if v) if leases_end else None,
        "restarts": run.restarts,
        "logs": run.log_dir,
        "growth_per_1000_requests": growth(run.samples, run.origin + opts.warmup_s, opts.warmup_s),
        "resources": [{"t_s": round(r["t"] - run.origin, 2), **{k: r[k] for k in
                       ("server", "role", "pid", "requests_done", "rss_bytes", "open_files", "threads", "leases")}}
                      for r in run.samples],
        "outcomes": rows,
    }
    report["growth_max"] = _growth_max(report["growth_per_1000_requests"])
    return report


def _slope(xs: list[float], ys: list[float]) -> float | None:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def growth(rows: list[dict], after: float, warmup: float) -> dict:
    out = {}
    for server in dict.fromkeys(r["server"] for r in rows):
        segments: dict = {}
        for r in rows:
            if r["server"] == server and r["pid"] is not None and r.get("rss_bytes"):
                segments.setdefault(r["pid"], []).append(r)
        # each process after a warm-up of its own (a restarted one loads its model again)
        segments = {pid: [r for r in seg if r["t"] >= max(after, seg[0]["t"] + warmup)]
                    for pid, seg in segments.items()}
        seg = max(segments.values(), key=len, default=[])
        xs = [r["requests_done"] for r in seg]
        if len(seg) < 3 or max(xs) - min(xs) < 20:
            out[server] = {"samples": len(seg), "requests": (max(xs) - min(xs)) if xs else 0,
                           "rss_mib": None, "open_files": None, "threads": None}
            continue
        entry = {"samples": len(seg), "requests": max(xs) - min(xs)}
        for key, name, scale in (("rss_bytes", "rss_mib", 1 / (1 << 20)), ("open_files", "open_files", 1),
                                 ("threads", "threads", 1)):
            slope = _slope(xs, [r[key] * scale for r in seg])
            entry[name] = None if slope is None else round(slope * 1000, 3)
        out[server] = entry
    return out


def _growth_max(per_server: dict) -> dict:
    out = {}
    for key in ("rss_mib", "open_files", "threads"):
        values = [(v[key], name) for name, v in per_server.items() if v.get(key) is not None]
        top = max(values, default=None)
        out[key] = None if top is None else {"per_1000_requests": top[0], "server": top[1]}
    return out


def draw(report: dict, path) -> str | None:
    """The resources over time with the fault windows shaded (a PNG at ``path``); why none, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no chart (pip install matplotlib)"
    rows = report["resources"]
    if not rows:
        return "no resource sample: nothing to draw"
    panels = (("rss_bytes", "RSS (MiB)", 1 / (1 << 20)), ("open_files", "open files", 1), ("threads", "threads", 1),
              ("leases", "leases held", 1))
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 10), sharex=True)
    servers = list(dict.fromkeys(r["server"] for r in rows))
    colors = {server: plt.get_cmap("tab10")(i % 10) for i, server in enumerate(servers)}  # one per server, every panel
    for ax, (key, label, scale) in zip(axes, panels):
        for server in servers:
            pts = [(r["t_s"], r[key] * scale) for r in rows if r["server"] == server and r[key] is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], linewidth=1, label=server, color=colors[server])
        ax.set_ylabel(label)
        for f in report["faults"]:
            if f.get("start_s") is None:
                continue
            ax.axvspan(f["start_s"], f["end_s"], color=_COLORS.get(f["kind"].split("_")[0], "#dddddd"), alpha=0.3,
                       linewidth=0)
    top = axes[0]
    for f in report["faults"]:
        if f.get("start_s") is not None:
            top.annotate(f["kind"], (f["start_s"], 1.0), xycoords=("data", "axes fraction"), rotation=60,
                         fontsize=7, va="bottom")
    axes[-1].set_xlabel("seconds from the start of the load")
    axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    r = report["requests"]
    fig.suptitle(f"Soak: {r['sent']} sent, {r['answered']} answered, {r['failed']} failed, {r['lost']} lost "
                 f"(fault windows shaded)", y=1.02)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return None


_COLORS = {"kill": "#e41a1c", "stop": "#377eb8", "lease": "#4daf4a", "gateway": "#984ea3", "link": "#ff7f00"}
