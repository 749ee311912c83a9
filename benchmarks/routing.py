"""Benchmark: time to first token of the handoff, of decode-only, and of the client's own choice.

For raw prompts of about 16 to 3,500 tokens on SmolLM2 (real gunicorn prefill and decode servers
on loopback), each size runs, back to back through one ``DisaggregatedClient``:

1. ``route="auto"``: the cost model (routing.py) decides from what it measured on the sizes
   before (never from this size's own forced runs, which come after it);
2. ``route="handoff"`` and 3. ``route="decode_only"``: both paths forced, which also teach the
   cost model.

Reported per size: each path's end-to-end TTFT (``ttft_end_to_end``: the client's clock up to
sending the decode request, plus the decode server's time to first token), the policy's path, its
own TTFT (``auto_ttft_s``, a run of its own, so it carries run-to-run noise) and the TTFT that
path (the last decision at that size; ``auto_paths`` lists each repeat's) had in the forced
runs (``choice_ttft_s``); ``choice_vs_best`` and ``auto_vs_best`` divide
them by the better forced path. Target: at most 1.10 at every size. Also the canary's cost on the
prefill side (``canary_ms``: evaluating the last prompt token after the export) and the decode
side's check (``canary_check_ms``).

Before the sizes, one forced run of each path at ~128 tokens warms the servers and gives the
cost model its first figures (a client in service has them from its earlier requests).

    .venv/bin/python benchmarks/routing.py --json [--sizes 16 64 256 1024 2048 3500] [--repeat 1]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from disaggregated_inference.client import DisaggregatedClient  # noqa: E402

FILLER = ("The quarterly sales report lists revenue by region, product line and month, "
          "with notes on returns, discounts and the marketing campaigns that ran. ")
PATHS = ("handoff", "decode_only")


def prompt_of(tokens: int, per_char: float) -> str:
    """A raw prompt of about ``tokens`` tokens (``per_char``: tokens per character of FILLER)."""
    chars = max(1, round(tokens / per_char))
    return (FILLER * (chars // len(FILLER) + 1))[:chars]


def run(client, prompt: str, route: str) -> dict:
    _, m = client.generate("qwen", prompt, max_tokens=1, raw=True, route=route)
    return m


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--sizes", type=int, nargs="*", default=[16, 64, 256, 1024, 2048, 3500])
    parser.add_argument("--repeat", type=int, default=1, help="runs of each path per size (medians reported)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    from disaggregated_inference.ops.cluster import LocalCluster

    data = json.loads((ROOT / "config_current.json").read_text())
    data["models"]["qwen"]["n_threads"] = args.threads
    data["client"]["health_check_interval"] = 0
    cluster = LocalCluster(data, names=["local-prefill-qwen", "local-decode-qwen"], free_ports=True).start()
    try:
        cluster.wait_healthy(timeout=600)
        with DisaggregatedClient(cluster.config, health_check=False) as client:
            client.check_health()
            calib = run(client, FILLER * 10, "handoff")
            per_char = calib["prompt_tokens"] / len(FILLER * 10)
            for route in PATHS:  # warm-up, and the cost model's first figures
                run(client, prompt_of(128, per_char), route)
            rows = [measure(client, prompt_of(size, per_char), args.repeat) for size in args.sizes]
            figures = client.costs.snapshot()
    finally:
        cluster.stop()
    out = {"results": rows, "target_met": all(r["choice_vs_best"] <= 1.10 for r in rows),
           "target_met_by_own_runs": all(r["auto_vs_best"] <= 1.10 for r in rows),
           "cost_model": figures,
           "machine": {"cpus": os.cpu_count(), "threads_per_server": args.threads, "gpu": None}}
    if args.json:
        print(json.dumps(out))
    else:
        for r in rows:
            print(f"{r['prompt_tokens']:5d} tokens: handoff {r['handoff_ttft_s'] * 1000:8.1f} ms, decode-only "
                  f"{r['decode_only_ttft_s'] * 1000:8.1f} ms, policy {r['auto_path']:11s} "
                  f"{r['auto_ttft_s'] * 1000:8.1f} ms ({r['choice_vs_best']:.2f} of the better; canary "
                  f"{r['canary_ms']} ms)")
        print(f"target (choice within 10% of the better at every size) met: {out['target_met']}")
    return 0


def measure(client, prompt: str, repeat: int) -> dict:
    autos, forced = [], {p: [] for p in PATHS}
    for _ in range(repeat):
        autos.append(run(client, prompt, "auto"))
        for path in PATHS:
            forced[path].append(run(client, prompt, path))
    ttft = {p: statistics.median(m["ttft_end_to_end"] for m in forced[p]) for p in PATHS}
    best = min(ttft.values())
    path = autos[-1]["route"]
    auto_ttft = statistics.median(m["ttft_end_to_end"] for m in autos)
    handoffs = forced["handoff"]
    return {
        "prompt_tokens": handoffs[0]["prompt_tokens"],
        "handoff_ttft_s": round(ttft["handoff"], 4),
        "decode_only_ttft_s": round(ttft["decode_only"], 4),
        "better_path": min(ttft, key=ttft.get),
        "auto_path": path,
        "auto_paths": [m["route"] for m in autos],
        "auto_ttft_s": round(auto_ttft, 4),
        "choice_ttft_s": round(ttft[path], 4),
        "choice_vs_best": round(ttft[path] / best, 3),
        "auto_vs_best": round(auto_ttft / best, 3),
        "auto_estimates": autos[-1]["route_estimates"],
        "kv_bytes": handoffs[0]["kv_bytes"],
        "canary_ms": statistics.median(m.get("canary_ms") or 0.0 for m in handoffs),
        "canary_check_ms": statistics.median(m.get("canary_check_ms") or 0.0 for m in handoffs),
        "canary_divergence": max(m.get("canary_divergence") or 0.0 for m in handoffs),
        "canary": sorted({m.get("canary") for m in handoffs}),
    }


if __name__ == "__main__":
    raise SystemExit(main())
