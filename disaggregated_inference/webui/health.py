"""The servers' health in the sidebar of every page, redrawn every few seconds without a click.

It reads the sampler's newest sweep (every server's ``/health``, a few seconds old at most); with no
sampler (a test's fake client) the client's own view (``client.status()``). Icons are Streamlit's
Material Symbols, which ship with Streamlit: no emoji font needed.
"""
from __future__ import annotations

import time

import streamlit as st

from . import state

REFRESH_SECONDS = 5
ICONS = {"healthy": ":green[:material/check_circle:]", "loading": ":orange[:material/hourglass_top:]",
         "degraded": ":orange[:material/warning:]", "not checked": ":gray[:material/radio_button_unchecked:]"}
DOWN_ICON = ":red[:material/cancel:]"


def icon(server_state: str) -> str:
    return ICONS.get(server_state, DOWN_ICON)


def server_states(client, sampler) -> tuple[list[dict], float | None]:
    """``([{name, role, model, state}], when checked)``: the sampler's newest sweep, else the client's view."""
    sweep = sampler.latest() if sampler is not None else None
    if sweep is not None:
        rows = [{"name": r.name, "role": r.role, "model": r.model, "state": r.state} for r in sweep.readings]
        return rows, sweep.time
    rows, checked = [], [s["last_checked"] for s in client.status() if s.get("last_checked")]
    for s in client.status():
        server_state = ("healthy" if state.healthy(s) else "loading" if s.get("up") and s.get("loaded") is False
                        else "not checked" if s.get("last_checked") is None and s.get("up") else "down")
        rows.append({"name": s["name"], "role": s["role"], "model": s["model"], "state": server_state})
    return rows, max(checked) if checked else None


@st.fragment(run_every=REFRESH_SECONDS)
def sidebar_health(client) -> None:
    """Call inside ``with st.sidebar:``."""
    rows, checked = server_states(client, state.get_sampler())
    healthy = sum(r["state"] == "healthy" for r in rows)
    st.metric("Servers healthy", f"{healthy}/{len(rows)}")
    st.markdown("  \n".join(f"{icon(r['state'])} {r['name']} · {r['role']} · {r['model']}"
                            + ("" if r["state"] == "healthy" else f" · **{r['state']}**") for r in rows))
    when = time.strftime("%H:%M:%S", time.localtime(checked)) if checked else "not yet"
    st.caption(f"Checked {when}; redrawn every {REFRESH_SECONDS} s. Config: {state.config_path()}")
