"""Benchmark: the prefix cache on the grader's own prompts.

The code-analysis prompts the grader sends for the example notebooks (``plan_requests``: rubric and
instructions first, the student's work last) prefilled one after the other, as ``--jobs 1`` sends
them, on two llama.cpp backends in this process with the embedded config's settings for that model
(SmolLM2): one with the prefix cache, one without. The two run alternately, prompt by prompt, so
the machine's noise falls on both alike. No HTTP: this measures prompt evaluation, which is what
the cache saves. Per prompt: its tokens, the tokens the cache held, the prefill time of each, and
whether the exported states are byte-identical (they should be: ``PREFIX_MIN_TOKENS``).

    .venv/bin/python benchmarks/prefix.py --json [--rounds 2]
    .venv/bin/python benchmarks/prefix.py --quick --json   # seconds: three prompts on the tiny model

The feedback model (Gemma 3, sliding-window attention) runs with the cache off, as the backend
does for every sliding-window model; the output says so.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import quick  # noqa: E402
from disaggregated_inference.backends import ModelSettings, create  # noqa: E402
from disaggregated_inference.backends.base import Prompt  # noqa: E402


def grader_prompts(role: str = "code") -> tuple[str, list[tuple[str, str]]]:
    """(the config's model name, [(notebook, prompt)]) for one role of the grader's requests."""
    out, model = [], None
    for path, r in quick.grader_requests():
        if r.role == role:
            model = r.kwargs["model"]
            out.append((path.stem, r.kwargs["prompt"]))
    return model, out


def model_settings(name: str, prefix_cache: bool, model: str | None = None) -> ModelSettings:
    """The config's settings of model ``name``, with the cache on or off (and ``model``'s file instead)."""
    data = json.loads((ROOT / "config_current.json").read_text())
    entry = dict(data["models"][name])
    entry["prefix_cache"] = prefix_cache
    if model:
        entry["model"] = model
    return ModelSettings.from_dict(entry, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the prompts (the cache carries over)")
    ap.add_argument("--limit", type=int, default=0, help="the first N prompts only (0: all)")
    quick.add_argument(ap)
    args = ap.parse_args()
    quick.apply(ap, args, limit=3)

    model, prompts = grader_prompts("code")
    prompts = prompts[:args.limit] if args.limit else prompts
    gguf = quick.tiny_model() if args.quick else None
    backends = {mode: create(model_settings(model, mode == "cache", gguf)) for mode in ("cache", "no_cache")}
    for b in backends.values():
        b.load()
    rows = []
    try:
        for round_ in range(1, args.rounds + 1):
            for i, (notebook, text) in enumerate(prompts):
                row = {"round": round_, "notebook": notebook}
                order = ("cache", "no_cache") if (i + round_) % 2 else ("no_cache", "cache")
                results = {}
                for mode in order:
                    b = backends[mode]
                    started = time.perf_counter()
                    _, pre = b.run(b.prefill(Prompt(text=text)))
                    results[mode] = pre
                    row[f"{mode}_s"] = round(time.perf_counter() - started, 4)
                row["prompt_tokens"] = results["cache"].metrics.prompt_tokens
                row["cached_tokens"] = results["cache"].metrics.prompt_tokens_cached
                row["state_identical"] = bytes(results["cache"].payload) == bytes(results["no_cache"].payload)
                rows.append(row)
                if not args.json or args.quick:
                    print(f"round {round_} {notebook:>22}: {row['prompt_tokens']} tokens, {row['cached_tokens']} "
                          f"cached, {row['no_cache_s']:.2f} s -> {row['cache_s']:.2f} s", file=sys.stderr)
    finally:
        for b in backends.values():
            b.close()

    def totals(selected):
        no, yes = sum(r["no_cache_s"] for r in selected), sum(r["cache_s"] for r in selected)
        tokens = sum(r["prompt_tokens"] for r in selected)
        return {"prompts": len(selected), "prompt_tokens": tokens,
                "cached_tokens": sum(r["cached_tokens"] for r in selected),
                "no_cache_s": round(no, 3), "cache_s": round(yes, 3),
                "no_cache_over_cache": round(no / yes, 3) if yes else None}

    out = {
        "benchmark": "prefix",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "quick": args.quick,
        "model": model, "settings": {k: v for k, v in vars(model_settings(model, True, gguf)).items()
                                     if k in ("model", "n_ctx", "n_threads", "n_batch", "parallel")},
        "rows": rows,
        "per_round": {r: totals([x for x in rows if x["round"] == r]) for r in range(1, args.rounds + 1)},
        "all": totals(rows),
        "median_prompt_ratio": round(statistics.median(r["no_cache_s"] / r["cache_s"] for r in rows), 3),
        "states_identical": all(r["state_identical"] for r in rows),
        "feedback_model": "Gemma 3 (sliding-window attention): prefix cache off",
    }
    print(json.dumps(out, indent=2) if args.json else json.dumps(out["all"]))


if __name__ == "__main__":
    main()
