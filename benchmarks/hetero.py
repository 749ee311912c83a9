"""Benchmark: GPU prefill + CPU decode on one box, against CPU-only and GPU-only (JSON out).

Starts three servers of one model on this machine (gunicorn, free ports):

- ``gpu-prefill``: a prefill server with every layer on the GPU (``n_gpu_layers: -1``);
- ``cpu-decode``: a decode server with ``n_gpu_layers: 0``, started with ``CUDA_VISIBLE_DEVICES=``
  (empty) so that llama.cpp's op offload cannot quietly run prompt work on the GPU;
- ``gpu-only``: a decode server all on the GPU (the GPU-only baseline, ``/generate``).

For prompts of about 250 to 6k tokens it measures the decode server's time to first token with
the KV handed over, the CPU recomputing the prompt (``/generate`` on ``cpu-decode``, the CPU-only
baseline) and the GPU-only server; end-to-end seconds of an N-token greedy answer on each path;
and whether the three texts agree (equal, or the characters they share before parting). Every
handoff must report ``prompt_tokens_recomputed`` 1.

This script builds nothing. It needs llama-cpp-python (the version pinned in pyproject.toml)
built for CUDA in the repository's .venv, e.g. on an H100::

    CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAVA_BUILD=OFF" \\
        .venv/bin/pip install --force-reinstall --no-deps --no-binary llama-cpp-python \\
        "llama-cpp-python==0.3.36"

(about 6 minutes on 16 cores; ``pip wheel --no-build-isolation`` works offline where
scikit-build-core, cmake and ninja are installed; use your GPU's architecture: 80 A100, 89 L40,
90 H100/H200, 100 B200). On a Mac, ``CMAKE_ARGS="-DGGML_METAL=on"``.

    .venv/bin/python benchmarks/hetero.py --out hetero.json
    .venv/bin/python benchmarks/hetero.py --export-bundle kv.bundle      # also write one bundle
    .venv/bin/python benchmarks/hetero.py --import-bundle kv.bundle      # on another machine
    .venv/bin/python benchmarks/hetero.py --cpu-only-smoke --sizes 250 1200   # no GPU: all on the CPU
    .venv/bin/python benchmarks/hetero.py --quick --json    # seconds: tiny model; CPU smoke where there is no GPU

``--quick`` runs the tiny model at two small sizes, then writes one bundle and imports it again in
this process (``--import-bundle``'s checks). Where llama.cpp has no GPU offload it says so
(``gpu_skipped``, ``skip_reason``) and runs every server on the CPU (``--cpu-only-smoke``): the
GPU measurement did not happen, and nothing in that output is a GPU figure.

``--import-bundle`` loads the bundle's model (``--model``, default the bundle's own file name if
it is a built-in) in this process with the bundle's flash_attn/KV types, checks the fingerprint,
imports the KV, evaluates the last prompt token and compares the first-token logits with this
machine's one-shot evaluation of the whole prompt, and with its own split evaluation (all but the
last token, then the last) as the yardstick of numerical noise.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import sys
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import quick  # noqa: E402
from disaggregated_inference.testing.bundles import read_bundle  # noqa: E402

FILLER = ("The quarterly sales report lists revenue by region, product line and month, "
          "with notes on returns, discounts and the marketing campaigns that ran. ")
QUESTION = "\nSummarise the report above in one sentence."
DEFAULT_SIZES = [250, 1200, 2600, 5700]


def prompt_for(tokens_wanted: int, tokens_per_repeat: float) -> str:
    return FILLER * max(0, round((tokens_wanted - 30) / tokens_per_repeat)) + QUESTION


def common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def config_for(args) -> dict:
    gpu_layers = 0 if args.cpu_only_smoke else -1
    model = {"backend": "llama_cpp", "model": args.model, "n_ctx": args.n_ctx, "n_threads": args.threads,
             "flash_attn": True}
    return {
        "models": {"m": model},
        "prefill_servers": [{"name": "gpu-prefill", "host": "127.0.0.1", "port": 18200, "model": "m",
                             "n_gpu_layers": gpu_layers}],
        "decode_servers": [{"name": "cpu-decode", "host": "127.0.0.1", "port": 18201, "model": "m",
                            "n_gpu_layers": 0},
                           {"name": "gpu-only", "host": "127.0.0.1", "port": 18202, "model": "m",
                            "n_gpu_layers": gpu_layers}],
        # decode_timeout must exceed kv_fetch_timeout (config validation); this script's own calls wait 1800 s
        "client": {"health_check_interval": 0, "prefill_timeout": 1800, "decode_timeout": 1800},
        "server": {"lease_seconds": 120, "queue_timeout": 600, "kv_fetch_timeout": 300},
    }


def timed_post(http, url, body) -> tuple[dict, float]:
    started = time.perf_counter()
    resp = http.post(url, json=body, timeout=1800)
    elapsed = time.perf_counter() - started
    if resp.status_code != 200:
        raise SystemExit(f"{url} answered {resp.status_code}: {resp.text[:500]}")
    return resp.json(), elapsed


def run_size(http, urls, prompt, max_new) -> dict:
    gen = {"max_new_tokens": max_new, "temperature": 0}
    pre, pre_s = timed_post(http, f"{urls['gpu-prefill']}/prefill", {"prompt": prompt})
    hand, hand_s = timed_post(http, f"{urls['cpu-decode']}/decode", {"kv": pre["kv"], **gen})
    cpu, cpu_s = timed_post(http, f"{urls['cpu-decode']}/generate", {"prompt": prompt, **gen})
    gpu, gpu_s = timed_post(http, f"{urls['gpu-only']}/generate", {"prompt": prompt, **gen})
    m = hand["metrics"]
    if m["prompt_tokens_recomputed"] != 1:
        raise SystemExit(f"the handoff recomputed {m['prompt_tokens_recomputed']} prompt tokens, not 1: {m}")
    texts = {"handoff": hand["generated_text"], "cpu_only": cpu["generated_text"], "gpu_only": gpu["generated_text"]}
    return {
        "prompt_tokens": pre["prompt_tokens"],
        "kv_bytes": pre["kv"]["bytes"],
        "gpu_prefill_s": pre["metrics"]["prefill_time"],
        "kv_export_s": pre["metrics"].get("kv_export_time"),
        "kv_transfer_s": m.get("kv_transfer_time"),
        "kv_import_s": m.get("kv_load_time"),
        "prompt_tokens_recomputed": m["prompt_tokens_recomputed"],
        "ttft_s": {"handoff_cpu_decode": m["ttft"], "cpu_only": cpu["metrics"]["ttft"],
                   "gpu_only": gpu["metrics"]["ttft"]},
        "end_to_end_s": {"handoff": round(pre_s + hand_s, 4), "cpu_only": round(cpu_s, 4), "gpu_only": round(gpu_s, 4)},
        "speedup_vs_cpu_only": round(cpu_s / (pre_s + hand_s), 2),
        "completion_tokens": m["completion_tokens"],
        "text_equal": {"handoff_vs_cpu_only": texts["handoff"] == texts["cpu_only"],
                       "handoff_vs_gpu_only": texts["handoff"] == texts["gpu_only"]},
        "chars_in_common": {"handoff_vs_cpu_only": common_prefix(texts["handoff"], texts["cpu_only"]),
                            "handoff_vs_gpu_only": common_prefix(texts["handoff"], texts["gpu_only"])},
        "texts": texts,
    }


def benchmark(args) -> dict:
    from disaggregated_inference.ops.cluster import LocalCluster

    config = config_for(args)
    logs = Path(args.log_dir) if args.log_dir else None
    gpu_names = ["gpu-prefill", "gpu-only"]
    clusters = [LocalCluster(config, names=gpu_names, free_ports=True, log_dir=logs,
                             env={"CUDA_VISIBLE_DEVICES": ""} if args.cpu_only_smoke else None)]
    try:
        clusters[0].start()
        # a cluster of its own (its environment hides the GPU): it trusts the prefill server at the port
        # that one actually bound, which the config it starts from cannot know
        prefill = clusters[0].process("gpu-prefill").entry
        cpu_config = {**config, "server": {**config["server"], "kv_sources": [f"{prefill.host}:{prefill.port}"]}}
        clusters.append(LocalCluster(cpu_config, names=["cpu-decode"], free_ports=True, log_dir=logs,
                                     env={"CUDA_VISIBLE_DEVICES": ""}).start())
        for c in clusters:
            c.wait_healthy(timeout=args.timeout)
        urls = {p.entry.name: p.url for c in clusters for p in c.processes}
        http = requests.Session()
        calib = http.post(f"{urls['gpu-prefill']}/prefill", json={"prompt": FILLER * 20 + QUESTION}).json()
        http.delete(calib["kv"]["url"])
        per_repeat = (calib["prompt_tokens"] - 30) / 20
        run_size(http, urls, prompt_for(64, per_repeat), 4)  # warm every server (first GPU calls compile)
        results = [run_size(http, urls, prompt_for(size, per_repeat), args.max_new) for size in args.sizes]
        exported = export_bundle(http, urls, prompt_for(args.bundle_tokens, per_repeat), args.export_bundle) \
            if args.export_bundle else None
        fingerprint = calib["fingerprint"]
    finally:
        for c in clusters:
            c.stop()
    return {
        "mode": "cpu_only_smoke" if args.cpu_only_smoke else "gpu_prefill_cpu_decode",
        "model": args.model, "fingerprint": fingerprint, "n_ctx": args.n_ctx, "threads": args.threads,
        "max_new_tokens": args.max_new, "results": results, "exported_bundle": exported,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }


def export_bundle(http, urls, prompt, path) -> dict:
    pre = http.post(f"{urls['gpu-prefill']}/prefill", json={"prompt": prompt, "lease_seconds": 120}).json()
    resp = http.get(pre["kv"]["url"], timeout=600)
    resp.raise_for_status()
    Path(path).write_bytes(resp.content)
    return {"path": str(path), "prompt_tokens": pre["prompt_tokens"], "bytes": len(resp.content)}


# -- the second machine: import a bundle file, compare logits ------------------------------------

def import_bundle(args) -> dict:
    import numpy as np

    from disaggregated_inference.backends import ModelSettings, Received, create
    from disaggregated_inference.backends.gguf import BUILTIN
    from disaggregated_inference.kv import fingerprint as fp

    header, tokens, payload = read_bundle(io.BytesIO(Path(args.import_bundle).read_bytes()))
    theirs = header.fingerprint
    model = args.model_given or next((name for name in BUILTIN if theirs.get("model_file", "").lower().startswith(
        {"smollm2": "smollm2", "gemma3-270m": "gemma-3-270m"}[name])), None)
    if model is None:
        raise SystemExit(f"which model made this bundle ({theirs.get('model_file')})? pass --model PATH")
    settings = ModelSettings(model=model, n_ctx=max(theirs.get("n_ctx", 4096), len(tokens) + 16),
                             n_threads=args.threads, flash_attn=bool(theirs.get("flash_attn")),
                             type_k=theirs.get("type_k", "f16"), type_v=theirs.get("type_v", "f16"))
    backend = create(settings)
    backend.load()
    try:
        ours = backend.fingerprint()
        diffs = fp.differences(ours, theirs)
        if diffs:
            return {"fingerprint_accepted": False, "differences": diffs}
        last = len(tokens) - 1
        with backend.sequence() as seq:
            started = time.perf_counter()
            backend.import_state(seq, Received(header.kind, tokens, bytearray(payload), theirs))
            import_s = time.perf_counter() - started
            imported = backend.logits(seq, tokens[-1:], last)
        with backend.sequence() as seq:
            one_shot = backend.logits(seq, tokens)
        with backend.sequence() as seq:
            backend.logits(seq, tokens[:-1])
            split = backend.logits(seq, tokens[-1:], last)
    finally:
        backend.close()
    return {
        "fingerprint_accepted": True, "prompt_tokens": len(tokens), "kv_bytes": len(payload),
        "import_s": round(import_s, 4), "bundle_from": {k: theirs.get(k) for k in ("library_version", "model_file", "arch")},
        "top_token_equal": int(np.argmax(imported)) == int(np.argmax(one_shot)),
        "logits_mean_abs_vs_one_shot": round(float(np.mean(np.abs(imported - one_shot))), 4),
        "own_split_vs_one_shot": round(float(np.mean(np.abs(split - one_shot))), 4),
        "logit_std": round(float(np.std(one_shot)), 4),
    }


def gpu_offload() -> tuple[bool, str | None]:
    """Whether this llama.cpp build can put layers on a GPU; the reason when not."""
    import llama_cpp

    if llama_cpp.llama_supports_gpu_offload():
        return True, None
    return False, ("this llama-cpp-python build has no GPU offload (no CUDA or Metal): the GPU-prefill "
                   "measurement was skipped; every server ran on the CPU instead (--cpu-only-smoke), so no "
                   "figure here is a GPU figure")


def quick_run(args) -> dict:
    """``--quick``: the benchmark on the tiny model (on the GPU where there is one), then one bundle
    exported and imported again here, as a second machine would."""
    import tempfile

    gpu, reason = gpu_offload()
    args.cpu_only_smoke = args.cpu_only_smoke or not gpu
    with tempfile.TemporaryDirectory(prefix="hetero-quick-") as scratch:
        args.export_bundle = str(Path(scratch) / "kv.bundle")
        quick.say(f"{'GPU' if gpu else 'no GPU offload: CPU'} smoke run on the tiny model, sizes {args.sizes} ...")
        out = benchmark(args)
        quick.say("importing the exported bundle here ...")
        args.import_bundle, args.model_given = args.export_bundle, args.model
        out["bundle_import"] = import_bundle(args)
        out["exported_bundle"]["path"] = Path(out["exported_bundle"]["path"]).name
    out.update(quick=True, gpu_skipped=not gpu, skip_reason=reason, model=Path(args.model).name)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", dest="model_given", default=None,
                        help="model spec: smollm2 (default), gemma3-270m, a GGUF path, ollama:NAME")
    parser.add_argument("--sizes", type=int, nargs="*", default=None, help=f"prompt tokens (default {DEFAULT_SIZES})")
    parser.add_argument("--max-new", type=int, default=64, help="greedy tokens per answer")
    parser.add_argument("--n-ctx", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 2), help="CPU threads per server")
    parser.add_argument("--cpu-only-smoke", action="store_true",
                        help="every server on the CPU: checks the script where there is no GPU (no speed claims)")
    parser.add_argument("--export-bundle", metavar="FILE", help="also write one KV bundle of the GPU prefill")
    parser.add_argument("--bundle-tokens", type=int, default=2600, help="prompt size of the exported bundle")
    parser.add_argument("--import-bundle", metavar="FILE", help="import a bundle here and compare logits (no servers)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds to wait for the models to load")
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--out", help="write the JSON here as well as to standard output")
    parser.add_argument("--json", action="store_true", help="(the JSON is always printed; accepted for symmetry)")
    quick.add_argument(parser)
    args = parser.parse_args(argv)
    quick.apply(parser, args, sizes=[64, 200], max_new=8, n_ctx=1024, bundle_tokens=200, threads=2)
    if args.quick and (args.import_bundle or args.export_bundle):
        parser.error("--quick exports and imports a bundle of its own")
    args.model = args.model_given or (quick.tiny_model() if args.quick else "smollm2")
    args.sizes = args.sizes or DEFAULT_SIZES
    if args.n_ctx < max(args.sizes) + args.max_new + 64:
        parser.error(f"--n-ctx {args.n_ctx} cannot hold a {max(args.sizes)}-token prompt and its answer")
    started = time.perf_counter()
    out = quick_run(args) if args.quick else import_bundle(args) if args.import_bundle else benchmark(args)
    out["wall_s"] = round(time.perf_counter() - started, 1)
    text = json.dumps(out, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
