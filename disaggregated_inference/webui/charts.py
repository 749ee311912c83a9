"""The dashboard's charts: Altair specs over the rows ``observe.figures`` computes; nothing is computed here.

Charts draw as SVG (``usermeta.embedOptions.renderer``): every mark is an element with an ARIA label
naming its values, which screen readers and the browser test read.
"""
from __future__ import annotations

from datetime import datetime

import altair as alt
import pandas as pd

SVG = {"embedOptions": {"renderer": "svg"}}
HEIGHT = 240
BAR_STEP = 16  # pixels per bar of a grouped bar chart: its height grows with its rows


def _frame(rows: list) -> pd.DataFrame:
    frame = pd.DataFrame(rows)
    if "time" in frame:
        frame["time"] = [datetime.fromtimestamp(t) for t in frame["time"]]
    return frame


def _time_axis():
    return alt.X("time:T", title=None, axis=alt.Axis(format="%H:%M:%S"))


def request_times(points: list) -> alt.Chart:
    """Each request's prefill and decode time (seconds), by model."""
    return alt.Chart(_frame(points), title="Prefill and decode time per request (s)").mark_point(
        filled=True, size=70).encode(
        x=_time_axis(), y=alt.Y("seconds:Q", title="seconds"), color=alt.Color("model:N", title="model"),
        shape=alt.Shape("phase:N", title="phase"),
        tooltip=["model", "phase", alt.Tooltip("seconds:Q", format=".3f"), "method",
                 alt.Tooltip("time:T", format="%H:%M:%S")]).properties(height=HEIGHT, usermeta=SVG)


def request_speeds(points: list) -> alt.Chart:
    """Each request's prefill and decode speed (tokens/s; log scale: prefill is 10-100x faster)."""
    rows = [p for p in points if p.get("tokens_per_second")]
    return alt.Chart(_frame(rows), title="Prefill and decode speed per request (tok/s)").mark_point(
        filled=True, size=70).encode(
        x=_time_axis(), y=alt.Y("tokens_per_second:Q", title="tokens/s (log)", scale=alt.Scale(type="log")),
        color=alt.Color("model:N", title="model"), shape=alt.Shape("phase:N", title="phase"),
        tooltip=["model", "phase", alt.Tooltip("tokens_per_second:Q", format=".0f"),
                 alt.Tooltip("time:T", format="%H:%M:%S")]).properties(height=HEIGHT, usermeta=SVG)


def decode_throughput(rows: list) -> alt.Chart:
    """Tokens generated per second by every decode server, per model and all together."""
    return alt.Chart(_frame(rows), title="Decode tokens/s, all decode servers (30 s average)").mark_line(
        point=alt.OverlayMarkDef(size=10)).encode(
        x=_time_axis(), y=alt.Y("tokens_per_second:Q", title="tokens/s"),
        color=alt.Color("model:N", title="model"),
        tooltip=["model", alt.Tooltip("tokens_per_second:Q", format=".1f"),
                 alt.Tooltip("time:T", format="%H:%M:%S")]).properties(height=HEIGHT, usermeta=SVG)


def slots(rows: list) -> alt.Chart:
    """Slots busy (solid) and requests queued (dashed) per server."""
    long = [{"time": r["time"], "server": r["server"], "what": what, "requests": r[key]}
            for r in rows for what, key in (("slots busy", "busy"), ("queued", "queued"))]
    return alt.Chart(_frame(long), title="Slots busy and queue depth per server").mark_line(
        interpolate="step-after", point=alt.OverlayMarkDef(size=12)).encode(
        x=_time_axis(), y=alt.Y("requests:Q", title="requests", axis=alt.Axis(tickMinStep=1)),
        color=alt.Color("server:N", title="server"), strokeDash=alt.StrokeDash("what:N", title=None),
        tooltip=["server", "what", "requests", alt.Tooltip("time:T", format="%H:%M:%S")]
    ).properties(height=HEIGHT, usermeta=SVG)


def method_mix(mixes: dict) -> alt.Chart:
    """Requests by how they were served, one bar per view (``{view: {method: count}}``)."""
    rows = [{"view": view, "method": method, "requests": n} for view, counts in mixes.items()
            for method, n in counts.items()]
    return alt.Chart(pd.DataFrame(rows), title="How requests were served").mark_bar().encode(
        y=alt.Y("method:N", title=None, sort=None), yOffset="view:N",
        x=alt.X("requests:Q", title="requests", axis=alt.Axis(tickMinStep=1, format="d")),
        color=alt.Color("view:N", title=None, legend=alt.Legend(orient="bottom", labelLimit=400)),
        tooltip=["view", "method", "requests"]).properties(height=alt.Step(BAR_STEP), usermeta=SVG)


def links(rows: list) -> alt.Chart:
    """Each prefill -> decode pair's KV throughput against the capacity its last probe measured (Gb/s)."""
    long = [{"link": f"{r['prefill']} -> {r['decode']}", "figure": figure, "gbps": r[key]}
            for r in rows for figure, key in (("handoffs, this interface", "gbps"),
                                              ("pulls, every client", "server_gbps"),
                                              ("capacity (doctor's probe)", "capacity_gbps"))
            if r[key] is not None]
    return alt.Chart(pd.DataFrame(long), title="KV link throughput against capacity (Gb/s)").mark_bar().encode(
        y=alt.Y("link:N", title=None, axis=alt.Axis(labelLimit=400)), yOffset="figure:N",
        x=alt.X("gbps:Q", title="Gb/s"),
        color=alt.Color("figure:N", title=None, legend=alt.Legend(orient="bottom", labelLimit=400)),
        tooltip=["link", "figure", alt.Tooltip("gbps:Q", format=".2f")]).properties(height=alt.Step(BAR_STEP),
                                                                                    usermeta=SVG)
