"""The figures the dashboards show, as plain data: no drawing, no I/O.

Two sources, named in every panel that uses them:

- a client's request history (``DisaggregatedClient.history``: one record per request this client
  made, with the client's end-to-end timings): per-model percentiles, the method mix including
  fallbacks (only the client knows a decode-only request was a fallback), each handoff's KV
  throughput per prefill -> decode pair;
- the sampler's sweeps of every server's ``/metrics`` and ``/health`` (every client's requests):
  per-model percentiles from the servers' histograms, decode tokens per second, slots and queues,
  canary checks and refusals, the prefix cache's hit share, KV pulls against the capacity
  ``disagg doctor`` measured (``disagg_kv_probe_bytes_per_second``).

Windowed server figures are the difference between the newest sweep and a baseline sweep (None:
since the servers started), as PromQL's ``increase`` over a range would give.
"""
from __future__ import annotations

import math

from . import scrape

RECENT_S = 300.0  # the window of the "recent" percentiles and rates

# what the decode server or the client calls a request's path -> the panels' four kinds
METHOD_GROUPS = {"kv_handoff": "kv_handoff", "token_ids_recompute": "recompute", "ollama_context": "recompute",
                 "decode_only": "decode_only", "decode_only_fallback": "fallback"}
METHODS = ("kv_handoff", "recompute", "decode_only", "fallback")
PHASES = (("prefill_time", "prefill_speed"), ("decode_time", "decode_speed"))


def method_group(method: str | None) -> str:
    return METHOD_GROUPS.get(method or "", method or "unknown")


def quantile(values, q: float) -> float | None:
    """The q-quantile (0..1) of ``values``, interpolated linearly between ranks (numpy's default)."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    pos = (len(xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def spread(values) -> dict:
    """``{"p50", "p95", "n"}`` of the values that are not None."""
    xs = [v for v in values if v is not None]
    return {"p50": quantile(xs, 0.5), "p95": quantile(xs, 0.95), "n": len(xs)}


def gbps(n_bytes: float, seconds: float) -> float | None:
    return n_bytes * 8 / seconds / 1e9 if seconds and seconds > 0 else None


# -- a client's request history ---------------------------------------------------------------------

def recent(history, now: float, window: float = RECENT_S) -> list:
    return [h for h in history if (h.get("time") or 0) >= now - window]


def served(history) -> list:
    """The requests that were answered (the history also holds those no server could serve: ``error``)."""
    return [h for h in history if not h.get("error")]


def request_figures(history) -> dict:
    """Per model: requests answered and failed, completion tokens, and the p50/p95 of prefill and decode
    time and speed, time to first token (end to end, as the client saw it) and total time."""
    out = {}
    for model in sorted({h.get("model") for h in history if h.get("model")}):
        mine = served(h for h in history if h.get("model") == model)
        out[model] = {"requests": len(mine), "failed": sum(1 for h in history if h.get("model") == model
                                                           and h.get("error")),
                      "completion_tokens": sum(h.get("completion_tokens") or 0 for h in mine),
                      **{key: spread(h.get(key) for h in mine)
                         for key in ("prefill_time", "prefill_speed", "decode_time", "decode_speed",
                                     "ttft_end_to_end", "total_time")}}
    return out


def combined_throughput(history) -> dict:
    """Completion tokens of these requests over the wall time they spanned (first start to last end),
    overlapping requests together: the client's aggregate tokens per second."""
    history = served(history)
    spans = [(h["time"] - (h.get("total_time") or 0), h["time"]) for h in history if h.get("time")]
    tokens = sum(h.get("completion_tokens") or 0 for h in history)
    if not spans:
        return {"requests": 0, "completion_tokens": 0, "wall_time": None, "tokens_per_second": None}
    wall = max(end for _, end in spans) - min(start for start, _ in spans)
    return {"requests": len(spans), "completion_tokens": tokens, "wall_time": wall,
            "tokens_per_second": tokens / wall if wall > 0 else None}


def method_mix(history) -> dict:
    """``{kind: requests}`` over METHODS (and any other method seen), in that order."""
    counts = dict.fromkeys(METHODS, 0)
    for h in served(history):
        kind = method_group(h.get("method"))
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def request_points(history) -> list:
    """One row per request and phase, for charts: time, model, phase, seconds, tokens per second."""
    rows = []
    for h in history:
        for phase, (t_key, s_key) in zip(("prefill", "decode"), PHASES):
            if h.get(t_key) is not None:
                rows.append({"time": h["time"], "model": h.get("model"), "phase": phase, "seconds": h[t_key],
                             "tokens_per_second": h.get(s_key), "method": method_group(h.get("method"))})
    return rows


def handoff_links(history, names: dict | None = None) -> dict:
    """Per (prefill, decode) pair that handed KV over: handoffs, bytes, transfer seconds, Gb/s over all
    of them (bytes / seconds) and the median handoff's Gb/s. ``names`` maps addresses to server names."""
    names = names or {}
    out: dict = {}
    for h in history:
        if not (h.get("kv_bytes") and h.get("kv_transfer_time") and h.get("prefill_server")):
            continue
        pair = (names.get(h["prefill_server"], h["prefill_server"]), names.get(h["decode_server"], h["decode_server"]))
        row = out.setdefault(pair, {"handoffs": 0, "kv_bytes": 0, "seconds": 0.0, "each": []})
        row["handoffs"] += 1
        row["kv_bytes"] += h["kv_bytes"]
        row["seconds"] += h["kv_transfer_time"]
        row["each"].append(gbps(h["kv_bytes"], h["kv_transfer_time"]))
    for row in out.values():
        row["gbps"] = gbps(row["kv_bytes"], row["seconds"])
        row["gbps_p50"] = quantile(row.pop("each"), 0.5)
    return out


# -- the servers' /metrics, swept ---------------------------------------------------------------------

def delta(new: scrape.Scrape, old: scrape.Scrape | None, name: str, **labels) -> float:
    """A counter's increase since ``old`` (all of it when ``old`` is None or the server restarted)."""
    now = scrape.total(new, name, **labels)
    if old is None:
        return now
    before = scrape.total(old, name, **labels)
    return now - before if now >= before else now


def histogram_quantile(q: float, cumulative: list) -> float | None:
    """PromQL's ``histogram_quantile`` over cumulative ``[(upper bound, count), ...]``: linear within
    the bucket that holds the rank; the largest finite bound when the rank falls in +Inf."""
    if not cumulative or cumulative[-1][1] <= 0:
        return None
    rank = q * cumulative[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in cumulative:
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def bucket_delta(new: scrape.Scrape, old: scrape.Scrape | None, histogram: str) -> list:
    now = scrape.buckets(new, histogram)
    if old is None:
        return now
    before = dict(scrape.buckets(old, histogram))
    diff = [(le, n - before.get(le, 0.0)) for le, n in now]
    return now if any(d < 0 for _, d in diff) else diff


def _histogram_spread(readings_now, readings_then, histogram: str) -> dict:
    summed: dict = {}
    for r in readings_now:
        for le, n in bucket_delta(r.metrics, readings_then.get(r.name), histogram):
            summed[le] = summed.get(le, 0.0) + n
    cumulative = sorted(summed.items())
    return {"p50": histogram_quantile(0.5, cumulative), "p95": histogram_quantile(0.95, cumulative),
            "n": cumulative[-1][1] if cumulative else 0}


def _then(baseline) -> dict:
    return {r.name: r.metrics for r in baseline.readings if not r.error} if baseline is not None else {}


def span(newest, baseline) -> float | None:
    """Seconds the windowed server figures cover (None: since the servers started)."""
    return newest.time - baseline.time if baseline is not None else None


def server_model_figures(newest, baseline=None) -> dict:
    """Per model, every client's requests, from the servers' histograms over the window: prefill time and
    speed (prefill servers), decode time and speed and time to first token (decode servers; measured
    from the request's arrival there), requests decoded and decode tokens per second."""
    then = _then(baseline)
    seconds = span(newest, baseline)
    out = {}
    for model in sorted({r.model for r in newest.readings}):
        pre = [r for r in newest.readings if r.model == model and r.role == "prefill" and not r.error]
        dec = [r for r in newest.readings if r.model == model and r.role == "decode" and not r.error]
        tokens = sum(delta(r.metrics, then.get(r.name), "disagg_completion_tokens_total") for r in dec)
        out[model] = {
            "prefill_time": _histogram_spread(pre, then, "disagg_prefill_seconds"),
            "prefill_speed": _histogram_spread(pre, then, "disagg_prefill_tokens_per_second"),
            "decode_time": _histogram_spread(dec, then, "disagg_decode_seconds"),
            "decode_speed": _histogram_spread(dec, then, "disagg_decode_tokens_per_second"),
            "ttft": _histogram_spread(dec, then, "disagg_time_to_first_token_seconds"),
            "requests": sum(delta(r.metrics, then.get(r.name), "disagg_decode_seconds_count") for r in dec),
            "completion_tokens": tokens,
            "tokens_per_second": tokens / seconds if seconds else None,
            "prefix_cache": prefix_cache([*pre, *dec], then),
        }
    return out


def prefix_cache(readings, then: dict) -> dict:
    """Prompt tokens served from a slot's kept KV against those evaluated: the prefix cache's hit share."""
    cached = sum(delta(r.metrics, then.get(r.name), "disagg_prompt_tokens_cached_total") for r in readings)
    evaluated = sum(delta(r.metrics, then.get(r.name), "disagg_prompt_tokens_evaluated_total") for r in readings)
    return {"cached": cached, "evaluated": evaluated,
            "share": cached / (cached + evaluated) if cached + evaluated else None}


def server_rows(newest) -> list:
    """One row per server: state, slots busy of total, queue depth, backend, the last error."""
    rows = []
    for r in newest.readings:
        slots = r.health.get("slots") or {}
        rows.append({"name": r.name, "role": r.role, "model": r.model, "url": r.url, "state": r.state,
                     "up": r.up, "busy": slots.get("busy"), "slots": slots.get("total"),
                     "queued": r.health.get("queued"), "backend": r.health.get("backend"),
                     "uptime_s": r.health.get("uptime_s"),
                     "error": r.error or (r.health.get("error") if not r.up else None)})
    return rows


def server_method_mix(newest, baseline=None) -> dict:
    """Decode servers' requests by method over the window (a decode server cannot tell a chosen
    decode-only request from a fallback: both count as decode_only here)."""
    then = _then(baseline)
    counts = dict.fromkeys(METHODS[:3], 0.0)
    for r in newest.readings:
        if r.role != "decode" or r.error:
            continue
        for method in scrape.by_label(r.metrics, "disagg_handoffs_total", "method"):
            kind = method_group(method)
            counts[kind] = counts.get(kind, 0.0) + delta(r.metrics, then.get(r.name), "disagg_handoffs_total",
                                                         method=method)
    return counts


def canary_figures(newest, baseline=None) -> dict:
    """Handoff canaries checked on the decode servers by result, and the handoffs refused for one."""
    then = _then(baseline)
    out: dict = {"passed": 0.0, "failed": 0.0, "absent": 0.0, "unavailable": 0.0, "refused": 0.0}
    for r in newest.readings:
        if r.role != "decode" or r.error:
            continue
        for result in scrape.by_label(r.metrics, "disagg_canary_checks_total", "result"):
            out[result] = out.get(result, 0.0) + delta(r.metrics, then.get(r.name), "disagg_canary_checks_total",
                                                       result=result)
        out["refused"] += delta(r.metrics, then.get(r.name), "disagg_canary_failures_total")
    return out


def server_links(newest, baseline=None, names: dict | None = None) -> dict:
    """Per (prefill, decode) pair as the decode servers saw it: KV pulled over the window and its
    throughput while pulling (every client's handoffs), and the path's capacity as last probed."""
    names = names or {}
    then = _then(baseline)
    out: dict = {}
    for r in newest.readings:
        if r.role != "decode" or r.error:
            continue
        sources = set(scrape.by_label(r.metrics, "disagg_kv_pull_bytes_total", "source"))
        sources |= set(scrape.by_label(r.metrics, "disagg_kv_probe_bytes_per_second", "source"))
        for source in sources:
            pulled = delta(r.metrics, then.get(r.name), "disagg_kv_pull_bytes_total", source=source)
            seconds = delta(r.metrics, then.get(r.name), "disagg_kv_pull_seconds_total", source=source)
            probe = scrape.total(r.metrics, "disagg_kv_probe_bytes_per_second", source=source)
            measured = scrape.total(r.metrics, "disagg_kv_probe_timestamp_seconds", source=source)
            out[(names.get(source, source), r.name)] = {
                "kv_bytes": pulled, "seconds": seconds, "gbps": gbps(pulled, seconds),
                "capacity_gbps": probe * 8 / 1e9 if probe else None, "probed_at": measured or None}
    return out


def link_rows(history_links: dict, server_links_: dict) -> list:
    """Both views of each pair in one row: this client's handoffs, every client's pulls, the capacity."""
    rows = []
    for pair in sorted(set(history_links) | set(server_links_)):
        mine, theirs = history_links.get(pair, {}), server_links_.get(pair, {})
        capacity = theirs.get("capacity_gbps")
        observed = mine.get("gbps") or theirs.get("gbps")
        rows.append({"prefill": pair[0], "decode": pair[1], "handoffs": mine.get("handoffs", 0),
                     "kv_bytes": mine.get("kv_bytes", 0), "gbps": mine.get("gbps"), "gbps_p50": mine.get("gbps_p50"),
                     "server_gbps": theirs.get("gbps"), "capacity_gbps": capacity, "probed_at": theirs.get("probed_at"),
                     "utilisation": observed / capacity if observed and capacity else None})
    return rows


COMBINED = "all models"


def throughput_series(sweeps, average_s: float = 30.0) -> list:
    """Decode tokens per second per model at each sweep, averaged over the ``average_s`` before it (as
    ``rate(disagg_completion_tokens_total[30s])``: a request's tokens are counted when it finishes, so
    sweep-to-sweep differences would be spikes). One row per sweep and model, and one for all models
    together (``COMBINED``), for a chart over time."""
    rows, first = [], 0
    for i, after in enumerate(sweeps):
        while first < i and sweeps[first].time < after.time - average_s:
            first += 1
        before = sweeps[first]
        if first == i or after.time <= before.time:
            continue
        then = {r.name: r.metrics for r in before.readings if not r.error}
        per_model: dict = {}
        for r in after.readings:
            if r.role == "decode" and not r.error and r.name in then:
                tokens = delta(r.metrics, then[r.name], "disagg_completion_tokens_total")
                per_model[r.model] = per_model.get(r.model, 0.0) + tokens
        dt = after.time - before.time
        rows += [{"time": after.time, "model": m, "tokens_per_second": n / dt} for m, n in sorted(per_model.items())]
        if per_model:
            rows.append({"time": after.time, "model": COMBINED, "tokens_per_second": sum(per_model.values()) / dt})
    return rows


def slot_series(sweeps) -> list:
    """Slots busy and queue depth per server at each sweep, for a chart over time."""
    rows = []
    for s in sweeps:
        for r in s.readings:
            if not r.error and r.metrics:
                rows.append({"time": s.time, "server": r.name,
                             "busy": scrape.total(r.metrics, "disagg_slots_busy"),
                             "queued": scrape.total(r.metrics, "disagg_queue_depth")})
    return rows
