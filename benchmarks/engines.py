"""Benchmark: engine pairs: the handoff against the decode server alone, and vLLM's prefill throughput.

For each pair (llama.cpp -> MLX, MLX -> MLX, transformers -> MLX, vLLM -> llama.cpp, vLLM -> MLX;
real gunicorn servers on loopback, SmolLM2 from the shipped GGUF on every side) and raw prompts of
about 128, 512 and 1,024 tokens, it measures:

- ``handoff_ttft_s``: from sending ``/prefill`` (``kv_kind: neutral_kv``) to the decode server's
  first token of ``/decode`` (the decode request's send time plus its own ``ttft``), as the
  client counts ``ttft_end_to_end``;
- ``decode_only_ttft_s``: the MLX decode server's ``/generate`` alone (it evaluates the whole
  prompt): its ``ttft``, as the client counts a decode-only request's (sent at once);
  ``handoff_vs_decode_only`` divides the first by the second;
- ``convert_ms``: the conversion to the decode server's layout where the pair needs one: the
  llama.cpp state -> neutral on the prefill server (its ``kv_convert_time``), the head-dim
  permutation of K on the MLX decode server for transformers' and vLLM's bundles, the neutral
  bundle -> llama.cpp state on the llama.cpp decode server (K's order, float32 -> its f16 cache;
  each a ``kv_convert_time``); MLX -> MLX converts nothing (null); ``convert_ms_per_mb`` per MB of
  the neutral bundle;
- ``kv_bytes_per_token``: the neutral bundle's bytes per cached token (float32 from MLX,
  transformers and vLLM, float16 from llama.cpp, whose cache type it keeps), and ``import_ms``, the
  decode server's ``kv_load_time`` (pull, checks, import; the conversion included);
- ``prefill_ms``: the prefill server's evaluation of the prompt (all tokens but the last; vLLM's
  evaluates the last too, its canary).

``--handoff-modes whole streamed`` measures each pair's handoff both ways, one row per mode
(``handoff_mode`` asked, ``served`` what the prefill server did: a pair whose KV is converted after
the prefill, llama.cpp -> MLX, is served whole): the overlapped handoff's TTFT beside the whole
one's, with ``exposed_ms``, what the stream left after the prefill ended (the decode server's
``kv_exposed_time``). Whole only by default.

Where vLLM runs (its pairs are left out where it is not installed), ``prefill_throughput`` compares
its prefill server with the llama.cpp one (both ``parallel`` 8: vLLM's ``max_num_seqs``,
llama.cpp's slots) at 1 and 8 concurrent prompts: raw prompts of the largest size that differ
within their first tokens (neither prefix cache helps), ``--throughput-prompts`` of them at 8 at
once and a quarter as many one at a time, each
``/prefill`` answered with its bundle under a lease (released at once): prompt tokens per second
of wall time, as a client sees the server.

Each figure is the median of ``--repeat`` runs (the two paths alternate); one run of each pair
first warms every server. On a machine where the prefill and decode servers share the CPU, the
ratios say what the handoff costs beside recomputing, not what a GPU prefill server would save.

    .venv/bin/python benchmarks/engines.py --json [--sizes 128 512 1024] [--repeat 2] [--threads 2]
                                         [--handoff-modes whole streamed]
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
         "transformers->mlx": ("smol-tf", "prefill-tf", "decode-mlx-3"),
         "vllm->llama_cpp": ("smol-vllm", "prefill-vllm", "decode-llama-v"),
         "vllm->mlx": ("smol-vllm", "prefill-vllm", "decode-mlx-v")}
# the others decode on MLX; llama.cpp's decode server recomputes every decode-only prompt (no prefix cache: a
# repeated prompt, or the one a handoff just imported, would otherwise be found in its slots)
DECODE_SETTINGS = {"decode-llama-v": {"backend": "llama_cpp", "prefix_cache": False}}
THROUGHPUT_SERVERS = {"vllm": "prefill-vllm", "llama_cpp": "prefill-llama"}
THROUGHPUT_PARALLEL = 8


def cluster_config(threads: int, pairs, model_file: str = "smollm2") -> dict:
    model = {"backend": "llama_cpp", "model": model_file, "n_ctx": 4096, "n_threads": threads, "parallel": 1}
    models = {"smol": dict(model), "smol-mlx": dict(model, backend="mlx"),
              "smol-tf": dict(model, backend="transformers", device="cpu", n_threads=1),
              "smol-vllm": dict(model, backend="vllm", parallel=THROUGHPUT_PARALLEL)}
    if any(PAIRS[p][0] == "smol-vllm" for p in pairs):  # the throughput comparison's llama.cpp server batches too
        models["smol"]["parallel"] = THROUGHPUT_PARALLEL
    config = {"models": {}, "prefill_servers": [], "decode_servers": [],
              "client": {"prefill_timeout": 300, "decode_timeout": 600, "health_check_interval": 0},
              "server": {"lease_seconds": 120, "queue_timeout": 300}}
    port = iter(range(18210, 18230))
    for name in pairs:
        key, prefill, decode = PAIRS[name]
        config["models"][key] = models[key]
        if all(s["name"] != prefill for s in config["prefill_servers"]):  # the vLLM pairs share their prefill server
            config["prefill_servers"].append({"name": prefill, "host": "127.0.0.1", "port": next(port), "model": key})
        config["decode_servers"].append({"name": decode, "host": "127.0.0.1", "port": next(port), "model": key,
                                         **DECODE_SETTINGS.get(decode, {"backend": "mlx"})})
    return config


def prompt_of(tokens: int, per_char: float) -> str:
    chars = max(1, round(tokens / per_char))
    return (FILLER * (chars // len(FILLER) + 1))[:chars]


def handoff(http, prefill_url: str, decode_url: str, prompt: str, mode: str = "whole") -> dict:
    started = time.perf_counter()
    pre = http.post(f"{prefill_url}/prefill", json={"prompt": prompt, "raw": True, "kv_kind": "neutral_kv",
                                                    "handoff_mode": mode}, timeout=600)
    pre.raise_for_status()
    pre = pre.json()
    sent = time.perf_counter()
    dec = http.post(f"{decode_url}/decode", json={"kv": pre["kv"], "max_new_tokens": 1}, timeout=600)
    dec.raise_for_status()
    m = dec.json()["metrics"]
    p = {**pre["metrics"], **(m.get("prefill_metrics") or {})}  # streamed: the prefill's figures, from the trailer
    assert m["prompt_tokens_recomputed"] == 1 and m["method"] == "kv_handoff", m
    n_kv = p["prompt_tokens"] - 1
    convert = p.get("kv_convert_time", m.get("kv_convert_time"))
    return {"prompt_tokens": p["prompt_tokens"], "ttft": sent - started + m["ttft"],
            "convert": convert, "kv_bytes": pre["kv"]["bytes"], "kv_bytes_per_token": pre["kv"]["bytes"] / n_kv,
            "kv_state_bytes": p.get("kv_state_bytes"), "import": m["kv_load_time"], "prefill": p["prefill_time"],
            "canary": m.get("canary"), "canary_divergence": m.get("canary_divergence"),
            "cached": p.get("prompt_tokens_cached") or 0, "served": pre["handoff_mode"],
            "exposed": m.get("kv_exposed_time")}


def decode_only(http, decode_url: str, prompt: str) -> dict:
    answer = http.post(f"{decode_url}/generate", json={"prompt": prompt, "raw": True, "max_new_tokens": 1},
                       timeout=600)
    answer.raise_for_status()
    m = answer.json()["metrics"]
    assert m["prompt_tokens_recomputed"] == m["prompt_tokens"], m
    return {"ttft": m["ttft"], "prompt_tokens": m["prompt_tokens"]}


def prefill_throughput(urls: dict, prompts: list[str], concurrency: int, servers: dict) -> list[dict]:
    """Prompt tokens per second of each prefill server in ``servers`` (engine -> server name), ``prompts``
    sent ``concurrency`` at a time; each bundle's lease is released as soon as its answer is in."""
    from concurrent.futures import ThreadPoolExecutor

    rows = []
    for engine, server in servers.items():
        url = urls[server]

        def one(prompt: str) -> dict:
            with requests.Session() as http:
                answer = http.post(f"{url}/prefill", json={"prompt": prompt, "raw": True}, timeout=900)
                answer.raise_for_status()
                body = answer.json()
                http.delete(f"{url}/kv/{body['kv']['handle']}", timeout=60)
                return body["metrics"]

        started = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            done = list(pool.map(one, prompts))
        wall = time.perf_counter() - started
        tokens = sum(m["prompt_tokens"] for m in done)
        rows.append({"engine": engine, "concurrency": concurrency, "prompts": len(prompts), "prompt_tokens": tokens,
                     "wall_s": round(wall, 3), "prompt_tokens_per_s": round(tokens / wall, 1),
                     "prompt_tokens_cached": sum(m.get("prompt_tokens_cached") or 0 for m in done)})
    return rows


def distinct_prompts(n: int, tokens: int, per_char: float, start: int = 0) -> list[str]:
    """``n`` raw prompts of about ``tokens`` tokens that differ within their first few tokens: no prefix cache
    helps (vLLM's reuses whole blocks, 16-128 tokens; llama.cpp's server's reuses 64 tokens or more)."""
    return [f"Report {start + i}: " + prompt_of(tokens, per_char) for i in range(n)]


def measure(http, urls: dict, pair: str, prompt: str, repeat: int, modes=("whole",)) -> list[dict]:
    """One row per handoff mode: the handoffs of each mode and the decode server alone, alternating."""
    _, prefill, decode = PAIRS[pair]
    hands, alone = {mode: [] for mode in modes}, []
    for i in range(repeat):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for which in order:
            if which == 0:
                for mode in modes:
                    hands[mode].append(handoff(http, urls[prefill], urls[decode], prompt, mode))
            else:
                alone.append(decode_only(http, urls[decode], prompt))
    return [row(pair, mode, hand, alone, repeat) for mode, hand in hands.items()]


def row(pair: str, mode: str, hand: list, alone: list, repeat: int) -> dict:
    med = lambda key, rows=hand: statistics.median(r[key] for r in rows)  # noqa: E731
    convert = [r["convert"] for r in hand if r["convert"] is not None]
    convert_ms = statistics.median(convert) * 1000 if convert else None
    exposed = [r["exposed"] for r in hand if r["exposed"] is not None]
    kv_mb = hand[0]["kv_bytes"] / 1e6
    return {
        "pair": pair, "prompt_tokens": hand[0]["prompt_tokens"],
        "handoff_mode": mode, "served": sorted({r["served"] for r in hand}),
        "handoff_ttft_s": round(med("ttft"), 4), "decode_only_ttft_s": round(med("ttft", alone), 4),
        "handoff_vs_decode_only": round(med("ttft") / med("ttft", alone), 3),
        "prefill_ms": round(med("prefill") * 1000, 1), "import_ms": round(med("import") * 1000, 2),
        "exposed_ms": round(statistics.median(exposed) * 1000, 2) if exposed else None,
        "convert_ms": None if convert_ms is None else round(convert_ms, 2),
        "convert_ms_per_mb": None if convert_ms is None else round(convert_ms / kv_mb, 3),
        "kv_bytes": hand[0]["kv_bytes"], "kv_bytes_per_token": round(hand[0]["kv_bytes_per_token"]),
        "llama_state_bytes_per_token": (round(hand[0]["kv_state_bytes"] / (hand[0]["prompt_tokens"] - 1))
                                        if hand[0]["kv_state_bytes"] else None),
        "canary": sorted({r["canary"] for r in hand}),
        "canary_divergence_max": max(r["canary_divergence"] or 0.0 for r in hand),
        "prefill_cached_tokens_max": max(r["cached"] for r in hand),  # a prefix cache's hits on the repeats
        "runs": repeat,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--sizes", type=int, nargs="*", default=[128, 512, 1024])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads per server")
    parser.add_argument("--pairs", nargs="*", default=list(PAIRS), choices=list(PAIRS))
    parser.add_argument("--handoff-modes", nargs="+", default=["whole"], choices=["whole", "streamed"],
                        help="the handoffs to measure: whole bundles, the overlapped (streamed) handoff, or both")
    parser.add_argument("--throughput-prompts", type=int, default=16,
                        help="prompts per concurrency level of the prefill throughput comparison (vLLM pairs only)")
    quick.add_argument(parser)
    args = parser.parse_args(argv)
    quick.apply(parser, args, sizes=[128], repeat=1, throughput_prompts=8)
    if not importlib.util.find_spec("mlx_lm"):
        parser.error("the pairs decode on MLX servers: install the mlx extra (scripts/install.sh does)")
    installed = {"transformers->mlx": "torch", "vllm->llama_cpp": "vllm", "vllm->mlx": "vllm"}
    pairs = [p for p in args.pairs if p not in installed or importlib.util.find_spec(installed[p])]
    with_vllm = any(PAIRS[p][0] == "smol-vllm" for p in pairs)
    if with_vllm and "llama_cpp->mlx" not in pairs:
        pairs.insert(0, "llama_cpp->mlx")  # the throughput comparison's llama.cpp prefill server

    from disaggregated_inference.ops.cluster import LocalCluster

    # --quick: a tiny llama whose head_dim (32) vLLM's CPU attention takes (the tests' tiny llama has 16)
    model_file = quick.tiny_model(head_dim=32) if args.quick else "smollm2"
    config = cluster_config(args.threads, pairs, model_file)
    quick.say(f"starting {len(config['prefill_servers']) + len(config['decode_servers'])} servers "
              f"({', '.join(pairs)}) ...")
    cluster = LocalCluster(config, free_ports=True).start()
    rows, throughput, interrupted = [], [], False
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
                    measured = measure(http, urls, pair, prompt_of(size, per_char), args.repeat, args.handoff_modes)
                    rows += measured
                    for r in measured:
                        print(json.dumps(r), file=sys.stderr, flush=True)  # a long run's figures so far
        if with_vllm:
            size, n = max(args.sizes), args.throughput_prompts
            for level, concurrency in enumerate((1, THROUGHPUT_PARALLEL)):
                prompts = distinct_prompts(n if concurrency > 1 else max(1, n // 4), size, per_char, start=1000 * level)
                throughput += prefill_throughput(urls, prompts, concurrency, THROUGHPUT_SERVERS)
                print(json.dumps(throughput[-2:]), file=sys.stderr, flush=True)
    except KeyboardInterrupt:  # Ctrl-C ends a long run with the rows measured so far
        interrupted = True
    finally:
        cluster.stop()
    out = {"quick": args.quick, "model": Path(model_file).name, "sizes": args.sizes, "repeat": args.repeat,
           "pairs": pairs, "handoff_modes": args.handoff_modes, "results": rows, "prefill_throughput": throughput,
           "interrupted": interrupted,
           "left_out": sorted(set(args.pairs) - set(pairs)),
           "machine": {"cpus": os.cpu_count(), "llama_threads_per_server": args.threads,
                       "torch_threads": 1, "gpu": None}}
    if args.json:
        print(json.dumps(out))
    else:
        for r in rows:
            print(f"{r['pair']:18s} {r['prompt_tokens']:5d} tokens: handoff ({'/'.join(r['served'])}) "
                  f"{r['handoff_ttft_s'] * 1000:8.1f} ms, "
                  f"decode-only {r['decode_only_ttft_s'] * 1000:8.1f} ms ({r['handoff_vs_decode_only']:.2f}); "
                  f"convert {r['convert_ms']} ms, {r['kv_bytes_per_token']} B/token")
        for r in throughput:
            print(f"prefill {r['engine']:9s} x{r['concurrency']}: {r['prompt_tokens_per_s']:8.1f} prompt tokens/s "
                  f"({r['prompts']} prompts, {r['wall_s']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
