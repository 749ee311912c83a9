"""The dashboard's "Last bench report": the success-metric table of the last ``disagg bench`` run, its peers'
comparison and its charts, read from its bench.json (``state.bench_report_file``)."""
from __future__ import annotations

import json

import streamlit as st

from ..bench.table import fmt
from . import state


def metric_rows(rows: list) -> list:
    return [{"metric": r["name"], "target": ("< " if r["better"] == "lower" else "> ") + fmt(r["target"], r["unit"]),
             "value": fmt(r["value"], r["unit"]) + (" (estimated)" if r.get("basis") == "estimated" else ""),
             "status": r["status"].replace("_", " "), "note": r.get("reason") or ""} for r in rows]


def comparison_rows(peer: dict) -> list:
    return [{"metric": c["name"], "ours": fmt(c["ours"], c["unit"]), peer["name"]: fmt(c["peer"], c["unit"]),
             "ours / peer": "-" if c["ours_over_peer"] is None else f"{c['ours_over_peer']:.3g}",
             "better": c["better"] or "-"} for c in peer["comparison"]]


def show() -> None:
    path = state.bench_report_file()
    st.header("Last bench report")
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        st.info(f"No bench report at {path}: `disagg bench --out {path.parent}` writes one.")
        return
    except (OSError, ValueError) as exc:
        st.warning(f"Cannot read {path}: {exc}")
        return
    req = report.get("requests", {})
    st.caption(f"{report.get('started_at')} · workload {report.get('workload', {}).get('name')} · "
               f"{req.get('sent')} sent, {req.get('completed')} completed, {req.get('failed')} failed in "
               f"{report.get('duration_s', 0):.2f} s · {path}"
               + ("" if report.get("complete", True) else f" · INCOMPLETE: {report.get('incomplete_reason')}"))
    st.table(metric_rows(report.get("success_metrics", [])))
    for peer in report.get("peers", []):
        st.subheader(f"Against {peer['name']}")
        st.table(comparison_rows(peer))
    charts = [path.parent / name for name in report.get("charts", []) if (path.parent / name).is_file()]
    if charts:
        st.image([str(c) for c in charts], caption=[c.name for c in charts])
