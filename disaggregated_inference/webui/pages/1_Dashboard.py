"""Dashboard page: every server's health, recent requests with their prefill/decode timings, their overlap."""
from __future__ import annotations

from datetime import datetime

import streamlit as st

from disaggregated_inference.errors import DisaggError
from disaggregated_inference.webui import state


def _seconds(x) -> str:
    return "-" if x is None else f"{x:.2f} s"


def _speed(x) -> str:
    return "-" if not x else f"{x:.0f} tok/s"


def server_table(servers: list[dict]) -> list[dict]:
    return [{"": "✅" if state.healthy(s) else "…" if s.get("up") and s.get("loaded") is None else "❌",
             "server": s["name"],
             "role": s["role"], "model": s["model"], "url": s["url"],
             "loaded": s.get("loaded"), "backend": s.get("backend"), "latency (s)": s.get("latency_s"),
             "in flight": s.get("outstanding"), "served": s.get("served"), "last error": s.get("last_error") or ""}
            for s in servers]


def request_table(history: list[dict], limit: int = 20) -> list[dict]:
    rows = []
    for i, h in enumerate(reversed(history[-limit:])):
        rows.append({"#": len(history) - i, "time": datetime.fromtimestamp(h["time"]).strftime("%H:%M:%S")
                     if h.get("time") else "", "model": h.get("model"), "method": h.get("method"),
                     "prefill (s)": h.get("prefill_time"), "decode (s)": h.get("decode_time"),
                     "total (s)": h.get("total_time"), "prompt tokens": h.get("prompt_tokens"),
                     "completion tokens": h.get("completion_tokens"), "prefill tok/s": h.get("prefill_speed"),
                     "decode tok/s": h.get("decode_speed"), "prefill server": h.get("prefill_server"),
                     "decode server": h.get("decode_server")})
    return rows


def model_cards(history: list[dict]) -> None:
    models = sorted({h.get("model") for h in history if h.get("model")})
    if not models:
        return
    cols = st.columns(len(models))
    for col, model in zip(cols, models):
        mine = [h for h in history if h.get("model") == model]
        last = mine[-1]
        with col:
            st.subheader(f"{model}")
            st.metric("Prefill (last)", _seconds(last.get("prefill_time")), _speed(last.get("prefill_speed")),
                      delta_color="off")
            st.metric("Decode (last)", _seconds(last.get("decode_time")), _speed(last.get("decode_speed")),
                      delta_color="off")
            totals = [h["total_time"] for h in mine if h.get("total_time")]
            st.metric("Requests", len(mine), f"mean {sum(totals) / len(totals):.2f} s" if totals else None,
                      delta_color="off")


def main() -> None:
    st.set_page_config(page_title="Cluster dashboard", layout="wide")
    st.title("Disaggregated inference dashboard")
    try:
        client = state.get_client()
    except DisaggError as exc:
        st.error(f"Cannot use the cluster config {state.config_path()}: {exc.message}")
        st.stop()
    if st.button("Check health now", key="check"):
        client.check_health()
    servers = client.status()
    st.header("Servers")
    st.metric("Healthy", f"{sum(map(state.healthy, servers))}/{len(servers)}")
    st.caption("✅ healthy, ❌ down or not loaded, … not checked yet")
    st.dataframe(server_table(servers), hide_index=True)

    history = list(client.history)
    st.header("Models")
    batch = st.session_state.get("batch")
    if batch:
        inf = batch["summary"]["inference"]
        cols = st.columns(4)
        cols[0].metric("Requests in flight, mean (last grading)", "-" if inf["overlap"] is None
                       else f"{inf['overlap']:.2f}", help="request time / wall time; not a speedup")
        cols[1].metric("Wall time", _seconds(inf["wall_time"]))
        cols[2].metric("Request time (sum)", _seconds(inf["request_time"]))
        cols[3].metric("Prefill / decode", f"{inf['prefill_time']:.1f} s / {inf['decode_time']:.1f} s")
    else:
        st.caption("Grade notebooks to see how much the two models' requests overlapped.")
    model_cards(history)

    st.header("Recent requests")
    if history:
        st.dataframe(request_table(history), hide_index=True)
    else:
        st.info("No requests yet.")


main()
