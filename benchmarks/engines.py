"""Benchmark: engine pairs into an MLX decode server: the handoff against the decode server alone.

For each pair (llama.cpp -> MLX, MLX -> MLX, transformers -> MLX; real gunicorn servers on
loopback, SmolLM2 from the shipped GGUF on every side) and raw prompts of about 128, 512 and
1,024 tokens, it measures:

- ``handoff_ttft_s``: from sending ``/prefill`` (``kv_kind: neutral_kv``) to the decode server's
  first token of ``/decode`` (the decode request's send time plus its own ``ttft``), as the
  client counts ``ttft_end_to_end``;
- ``decode_only_ttft_s``: the MLX decode server's ``/generate`` alone (it evaluates the whole
  prompt): its ``ttft``, as the client counts a decode-only request's (sent at once);
  ``handoff_vs_decode_only`` divides the first by the second;
- ``convert_ms``: the conversion to the decode server's layout where the pair needs one: the
  llama.cpp state -> neutral on the prefill server (its ``kv_convert_time``), the head-dim
  permutation of K on the MLX decode server for transformers' bundles (its ``kv_convert_time``);
  MLX -> MLX converts nothing (null); ``convert_ms_per_mb`` per MB of the neutral bundle;
- ``kv_bytes_per_token``: the neutral bundle's bytes per cached token (float32 from MLX and
  transformers, float16 from llama.cpp, whose cache type it keeps), and ``import_ms``, the decode
  server's ``kv_load_time`` (pull, checks, import; the permutation included);
- ``prefill_ms``: the prefill server's evaluation of the prompt (all tokens but the last).

Each figure is the median of ``--repeat`` runs (the two paths alternate); one run of each pair
first warms every server. On a machine where the prefill and decode servers share the CPU, the
ratios say what the handoff costs beside recomputing, not what a GPU prefill server would save.

    .venv/bin/python benchmarks/engines.py --json [--sizes 128 512 1024] [--repeat 2] [--threads 2]
    .venv/bin/python benchmarks/engines.py --quick --json   # seconds: every pair on the tiny model, one size

Each result is also written to stderr as it is measured, and Ctrl-C ends the run with the JSON
of the results so far (``"interrupted": true``): on a 2-core CPU box, MLX's CPU build needs
minutes to recompute a 1,000-token prompt.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import quick  # noqa: E402

FILLER = ("The quarterly sales report lists revenue by region, product line and month, "
          "with notes on returns, discounts and the marketing campaigns that ran. ")
# pair name -> (model key, prefill server, decode server)
PAIRS = {"llama_cpp->mlx": ("smol", "prefill-llama", "decode-mlx"),
         "mlx->mlx": ("smol-mlx", "prefill-mlx", "decode-mlx-2"),
         "transformers->mlx": ("smol-tf", "prefill-tf", "decode-mlx-3")}


def cluster_config(threads: int, pairs, model_file: str = "smollm2") -> dict:
    model = {"backend": "llama_cpp", "model": model_file, "n_ctx": 4096, "n_threads": threads, "parallel": 1}
    models = {"smol": dict(model), "smol-mlx": dict(model, backend="mlx"),
              "smol-tf": dict(model, backend="transformers", device="cpu", n_threads=1)}
    config = {"models": {}, "prefill_servers": [], "decode_servers": [],
              "client": {"prefill_timeout": 300, "decode_timeout": 600, "health_check_interval": 0},
              "server": {"lease_seconds": 120, "queue_timeout": 300}}
    for i, name in enumerate(pairs):
        key, prefill, decode = PAIRS[name]
        config["models"][key] = models[key]
        config["prefill_servers"].append({"name": prefill, "host": "127.0.0.1", "port": 18210 + 2 * i, "model": key})
        config["decode_servers"].append({"name": decode, "host": "127.0.0.1", "port": 18211 + 2 * i, "model": key,
                                         "backend": "mlx"})
    return config


def prompt_of(tokens: int, per_char: float) -> str:
    chars = max(1, round(tokens / per_char))
    return (FILLER * (chars // len(FILLER) + 1))[:chars]


def handoff(http, prefill_url: str, decode_url: str, prompt: str) -> dict:
    started = time.perf_counter()
    pre = http.post(f"{prefill_url}/prefill", json={"prompt": prompt, "raw": True, "kv_kind": "neutral_kv"},
                    timeout=600)
    pre.raise_for_status()
    pre = pre.json()
    sent = time.perf_counter()
    dec = http.post(f"{decode_url}/decode", json={"kv": pre["kv"], "max_new_tokens": 1}, timeout=600)
    dec.raise_for_status()
    m, p = dec.json()["metrics"], pre["metrics"]
    assert m["prompt_tokens_recomputed"] == 1 and m["method"] == "kv_handoff", m
    n_kv = p["prompt_tokens"] - 1
    convert = p.get("kv_convert_time", m.get("kv_convert_time"))
    return {"prompt_tokens": p["prompt_tokens"], "ttft": sent - started + m["ttft"],
            "convert": convert, "kv_bytes": pre["kv"]["bytes"], "kv_bytes_per_token": pre["kv"]["bytes"] / n_kv,
            "kv_state_bytes": p.get("kv_state_bytes"), "import": m["kv_load_time"], "prefill": p["prefill_time"],
            "canary": m.get("canary"), "canary_divergence": m.get("canary_divergence")}


def decode_only(http, decode_url: str, prompt: str) -> dict:
    answer = http.post(f"{decode_url}/generate", json={"prompt": prompt, "raw": True, "max_new_tokens": 1},
                       timeout=600)
    answer.raise_for_status()
    m = answer.json()["metrics"]
    assert m["prompt_tokens_recomputed"] == m["prompt_tokens"], m
    return {"ttft": m["ttft"], "prompt_tokens": m["prompt_tokens"]}


def measure(http, urls: dict, pair: str, prompt: str, repeat: int) -> dict:
    _, prefill, decode = PAIRS[pair]
    hand, alone = [], []
    for i in range(repeat):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for which in order:
            if which == 0:
                hand.append(handoff(http, urls[prefill], urls[decode], prompt))
            else:
                alone.append(decode_only(http, urls[decode], prompt))
    med = lambda key, rows=hand: statistics.median(r[key] for r in rows)  # noqa: E731
    convert = [r["convert"] for r in hand if r["convert"] is not None]
    convert_ms = statistics.median(convert) * 1000 if convert else None
    kv_mb = hand[0]["kv_bytes"] / 1e6
    return {
        "pair": pair, "prompt_tokens": hand[0]["prompt_tokens"],
        "handoff_ttft_s": round(med("ttft"), 4), "decode_only_ttft_s": round(med("ttft", alone), 4),
        "handoff_vs_decode_only": round(med("ttft") / med("ttft", alone), 3),
        "prefill_ms": round(med("prefill") * 1000, 1), "import_ms": round(med("import") * 1000, 2),
        "convert_ms": None if convert_ms is None else round(convert_ms, 2),
        "convert_ms_per_mb": None if convert_ms is None else round(convert_ms / kv_mb, 3),
        "kv_bytes": hand[0]["kv_bytes"], "kv_bytes_per_token": round(hand[0]["kv_bytes_per_token"]),
        "llama_state_bytes_per_token": (round(hand[0]["kv_state_bytes"] / (hand[0]["prompt_tokens"] - 1))
                                        if hand[0]["kv_state_bytes"] else None),
        "canary": sorted({r["canary"] for r in hand}),
        "canary_divergence_max": max(r["canary_divergence"] or 0.0 for r in hand),
        "runs": repeat,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--sizes", type=int, nargs="*", default=[128, 512, 1024])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads per server")
    parser.add_argument("--pairs", nargs="*", default=list(PAIRS), choices=list(PAIRS))
    quick.add_argument(parser)
    args = parser.parse_args(argv)
    quick.apply(parser, args, sizes=[128], repeat=1)
    if not importlib.util.find_spec("mlx_lm"):
        parser.error("every pair decodes on an MLX server: install the mlx extra (scripts/install.sh does)")
    pairs = [p for p in args.pairs if p != "transformers->mlx" or importlib.util.find_spec("torch")]

    from disaggregated_inference.ops.cluster import LocalCluster

    model_file = quick.tiny_model() if args.quick else "smollm2"
    quick.say(f"starting {2 * len(pairs)} servers ({', '.join(pairs)}) ...")
    cluster = LocalCluster(cluster_config(args.threads, pairs, model_file), free_ports=True).start()
    rows, interrupted = [], False
    try:
        cluster.wait_healthy(timeout=900)
        urls = {p.entry.name: p.url for p in cluster.processes}
        with requests.Session() as http:
            calib = handoff(http, urls[PAIRS[pairs[0]][1]], urls[PAIRS[pairs[0]][2]], FILLER * 10)
            per_char = calib["prompt_tokens"] / len(FILLER * 10)
            for pair in pairs:  # warm every server once
                _, prefill, decode = PAIRS[pair]
                handoff(http, urls[prefill], urls[decode], prompt_of(64, per_char))
                decode_only(http, urls[decode], prompt_of(64, per_char))
            for size in args.sizes:
                for pair in pairs:
                    rows.append(measure(http, urls, pair, prompt_of(size, per_char), args.repeat))
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # a long run's figures so far
    except KeyboardInterrupt:  # Ctrl-C ends a long run with the rows measured so far
        interrupted = True
    finally:
        cluster.stop()
    out = {"quick": args.quick, "model": Path(model_file).name, "sizes": args.sizes, "repeat": args.repeat,
           "pairs": pairs, "results": rows, "interrupted": interrupted,
           "left_out": sorted(set(args.pairs) - set(pairs)),
           "machine": {"cpus": os.cpu_count(), "llama_threads_per_server": args.threads,
                       "torch_threads": 1, "gpu": None}}
    if args.json:
        print(json.dumps(out))
    else:
        for r in rows:
            print(f"{r['pair']:18s} {r['prompt_tokens']:5d} tokens: handoff {r['handoff_ttft_s'] * 1000:8.1f} ms, "
                  f"decode-only {r['decode_only_ttft_s'] * 1000:8.1f} ms ({r['handoff_vs_decode_only']:.2f}); "
                  f"convert {r['convert_ms']} ms, {r['kv_bytes_per_token']} B/token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
