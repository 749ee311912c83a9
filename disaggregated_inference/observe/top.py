"""``disagg top``: the dashboard's server figures as text, redrawn every few seconds (an SSH session).

Everything here comes from the servers' ``/health`` and ``/metrics`` (every client's requests);
``figures`` computes it, this module only lays it out.
"""
from __future__ import annotations

import sys
import time

from . import figures
from .units import count, gbps, seconds, share
from .sampler import Sampler

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen


def pair(spread: dict, fmt) -> str:
    """``p50 / p95`` of a ``figures.spread``."""
    return f"{fmt(spread['p50'])} / {fmt(spread['p95'])}" if spread["n"] else "-"


def render(newest, baseline, names: dict, source: str = "") -> str:
    covered = figures.span(newest, baseline)
    window = f"last {covered:.0f} s" if covered else "since the servers started"
    lines = [f"disagg top  {time.strftime('%H:%M:%S', time.localtime(newest.time))}  {source}  "
             f"figures over the {window} (p50 / p95); Ctrl-C quits", ""]
    models = figures.server_model_figures(newest, baseline)
    lines.append(f"{'model':12} {'reqs':>5}  {'prefill time':>17}  {'prefill tok/s':>13}  {'decode time':>17}  "
                 f"{'decode tok/s':>12}  {'TTFT (decode)':>17}  {'tok/s now':>9}  {'cache hit':>9}")
    for model, f in models.items():
        lines.append(f"{model:12} {f['requests']:>5.0f}  {pair(f['prefill_time'], seconds):>17}  "
                     f"{pair(f['prefill_speed'], count):>13}  {pair(f['decode_time'], seconds):>17}  "
                     f"{pair(f['decode_speed'], count):>12}  {pair(f['ttft'], seconds):>17}  "
                     f"{count(f['tokens_per_second']):>9}  {share(f['prefix_cache']['share']):>9}")
    total = [f["tokens_per_second"] for f in models.values() if f["tokens_per_second"] is not None]
    lines += [f"{'combined':12} {sum(f['requests'] for f in models.values()):>5.0f}  {'':>17}  {'':>13}  {'':>17}  "
              f"{'':>12}  {'':>17}  {count(sum(total) if total else None):>9}", ""]

    lines.append(f"{'server':28} {'role':8} {'model':10} {'state':10} {'slots busy':>10} {'queue':>6}  detail")
    for r in figures.server_rows(newest):
        slots = f"{r['busy']}/{r['slots']}" if r["slots"] is not None else "-"
        queued = "-" if r["queued"] is None else str(r["queued"])
        lines.append(f"{r['name']:28} {r['role']:8} {r['model']:10} {r['state']:10} {slots:>10} {queued:>6}  "
                     f"{r['error'] or r['url']}")
    mix = figures.server_method_mix(newest, baseline)
    canary = figures.canary_figures(newest, baseline)
    lines += ["", "handoffs (decode servers): " + "  ".join(f"{k} {v:.0f}" for k, v in mix.items())
              + "   (decode_only: chosen or a fallback)",
              "canary: " + "  ".join(f"{k} {canary[k]:.0f}" for k in ("passed", "failed", "absent", "unavailable"))
              + f"   handoffs refused: {canary['refused']:.0f}", ""]
    links = figures.server_links(newest, baseline, names)
    lines.append(f"{'KV link (prefill -> decode)':52} {'pulled':>10} {'Gb/s':>7} {'capacity':>9}")
    if not links:
        lines.append("  no KV pulled and no probe yet (disagg doctor measures each link's capacity)")
    for (pre, dec), link in sorted(links.items()):
        cap = link["capacity_gbps"]
        lines.append(f"{pre + ' -> ' + dec:52} {link['kv_bytes'] / 1e6:>8.1f}MB "
                     f"{gbps(link['gbps']):>7} {gbps(cap):>9}")
    return "\n".join(lines)


def run(cfg, interval: float = 2.0, window: float = figures.RECENT_S, once: bool = False, out=None) -> int:
    """Draw until interrupted. ``once``: one frame of the figures since the servers started, for a
    pipe or a script; exit status 1 when a server is not up."""
    out = out or sys.stdout
    sampler = Sampler(cfg, interval=interval, keep_seconds=window + 60, anchor_seconds=min(15.0, window / 4))
    try:
        newest = sampler.sweep()
        if once:
            print(render(newest, None, sampler.names, cfg.source), file=out)
            return 0 if all(r.up for r in newest.readings) else 1
        while True:
            print(CLEAR + render(newest, sampler.baseline(window), sampler.names, cfg.source), file=out, flush=True)
            time.sleep(interval)
            newest = sampler.sweep()
    finally:
        sampler.stop()
