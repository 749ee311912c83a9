"""Benchmark: prompt-lookup speculation on a decode server, off against on, in one run on one server.

One decode server (the embedded config's "qwen" model, SmolLM2, or ``--model gpt-oss``, Gemma 3; ``parallel: 8``, ``--threads``
threads, ``deterministic`` steps as in the grader's cluster unless ``--deterministic off``) serves
every row; each request names its proposer (``"speculation": "off"`` or
``"ngram"``), so both sides run on the same process, the same slots and the same cached prompts.
Two prompt sets:

- ``code``: the grader's own code-analysis requests (``plan_requests``) for the example notebooks
  (the four calibration notebooks first), JSON schema, temperature 0 and ``max_tokens`` as the
  grader sends them;
- ``feedback``: the grader's feedback requests for the same notebooks (its other model's: ``--model gpt-oss``);
- ``free``: free-writing chat prompts (stories, explanations), greedy, ``--free-tokens`` each.

Per prompt set, every prompt is sent once first (one token, speculation off), so its slot's prefix
cache holds it and the rows measure decoding, not prompt evaluation. Then:

- concurrency 1: each prompt alone, off and ngram alternately (which goes first alternates too,
  so the machine's noise falls on both alike); ``decode_tok_s`` = the answers' tokens over the
  server's decode time (``decode_time``: from the prompt's last token to the answer's end);
- concurrency 8: eight requests at once, off and ngram rounds alternately: the set's first 8 (the
  code set has 7 code-analysis requests: the grader's feedback request for the first calibration
  notebook, also schema-constrained, makes the eighth; a shorter set repeats its first prompts, and
  a repeated prompt finds no cached slot, which costs both sides alike); ``decode_tok_s`` = the
  answers' tokens over the round's decode window (from the earliest decode start, an answer's
  arrival less its server decode time, to the last answer's arrival).

Each row: ``proposer``, ``prompts``, ``concurrency``, ``decode_tok_s``, ``acceptance`` (accepted
over drafted guesses; null for off), ``greedy_equal`` (the ngram answers equal the off answers of
the same prompts at the same concurrency, every one; the off row is the reference: null),
``differ`` (how many did not), and the tokens; at 8, ``same_as_alone``: how many of its answers are the
text the same prompt got alone with the same proposer, of how many (deterministic steps: all; one
round, and sets that fill the batch with another set's prompt are not compared). ``ratios``: ngram over
off per prompt set and concurrency. Requests go to ``/generate`` (decode-only): the token loop is the one a handoff's
``/decode`` runs.

    .venv/bin/python benchmarks/speculative.py --json
    .venv/bin/python benchmarks/speculative.py --json --sets decode-bound prompt-bound --deterministic off

``--sets`` picks the prompt sets (``code``, ``free``, and benchmarks/peer.py's ``decode-bound`` and
``prompt-bound`` workloads, raw prompts with end-of-generation ignored); ``--flash-attn off`` runs
the model without flash attention (with deterministic steps, a lone token then goes unpadded where
the load measures that exact: docs/ARCHITECTURE.md, Determinism). ``cells_below_0_97`` lists the
set/concurrency cells where ngram fell below 0.97x of off (issue 44's bar for the default).
    .venv/bin/python benchmarks/speculative.py --quick --json   # seconds: the tiny model, short answers
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import peer  # noqa: E402  (benchmarks/peer.py: its workloads' prompts)
import quick  # noqa: E402
from disaggregated_inference.grading.analysis import CODE  # noqa: E402
from disaggregated_inference.ops.cluster import LocalCluster  # noqa: E402

FREE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, for a curious ten-year-old.",
    "Describe a walk through a busy market in the early morning.",
    "Write a letter from a cat to its owner about the new dog.",
    "Explain why the sky is blue and sunsets are red.",
    "Tell the story of a small town that wakes up to find every clock stopped.",
    "Describe what a day on a sailing ship was like two hundred years ago.",
    "Write a fable about a fox who wanted to learn to fly.",
]
SLOTS = 8
PEER_SETS = ["decode-bound", "prompt-bound"]  # benchmarks/peer.py's workloads


def code_requests() -> tuple[list[dict], list[dict]]:
    """The grader's code-analysis requests for the example notebooks (calibration notebooks first), and its
    feedback requests, as /generate bodies: prompt, schema, sampling."""
    out, feedback = [], []
    for _, r in quick.grader_requests():
        (out if r.role == CODE else feedback).append(
            {"prompt": r.kwargs["prompt"], "json_schema": r.kwargs["json_schema"],
             "max_new_tokens": r.kwargs["max_tokens"], "temperature": 0})
    return out, feedback


def free_requests(max_tokens: int) -> list[dict]:
    return [{"prompt": p, "max_new_tokens": max_tokens, "temperature": 0} for p in FREE]


def peer_requests(workload: str, quick_run: bool) -> list[dict]:
    """benchmarks/peer.py's workload ``workload`` (decode-bound: 8 short prompts x 192 tokens; prompt-bound: 16
    prompts of ~950 tokens x 48) as /generate bodies: raw prompts, greedy, end-of-generation ignored."""
    work = next(w for w in peer.WORKLOADS if w.name == workload)
    n, tokens = (2, 8) if quick_run else (work.prompts, work.max_tokens)
    return [{"prompt": work.prompt(0, i), "raw": True, "max_new_tokens": tokens, "temperature": 0,
             "ignore_eos": True} for i in range(n)]


def config_dict(threads: int, tiny: bool, deterministic: bool = True, flash_attn: bool | None = None,
                name: str = "qwen", paired_steps: bool = False) -> dict:
    data = json.loads((ROOT / "config_current.json").read_text())
    data = quick.on_tiny_model(data, keep=(name,)) if tiny else {
        **data, "models": {name: data["models"][name]},
        "prefill_servers": [s for s in data["prefill_servers"] if s["model"] == name],
        "decode_servers": [s for s in data["decode_servers"] if s["model"] == name]}
    data["prefill_servers"] = []  # decode-only: one server
    model = data["models"][name]
    # the model's default does not matter (every request names its proposer); "ngram" measures the step
    # cost at load rather than at the first draft, which would take a slot's cached prompt
    model.update(parallel=SLOTS, n_threads=threads, speculation="ngram", deterministic=deterministic)
    if flash_attn is not None:  # off: deterministic lone tokens unpadded where the load measures that exact
        model["flash_attn"] = flash_attn
    if paired_steps:  # every sequence two rows a step: guesses verify where one row computes otherwise than two
        model["paired_steps"] = True
    data["server"].update(queue_timeout=600, max_queue=256)
    return data


def post(url: str, body: dict, proposer: str) -> dict:
    r = requests.post(f"{url}/generate", json={**body, "speculation": proposer}, timeout=1800)
    r.raise_for_status()
    return r.json()


def measure(url: str, bodies: list[dict], concurrency: int, rounds: int) -> dict:
    """{proposer: [answers]} and {proposer: seconds} for one prompt set at one concurrency: the server's
    decode time at 1; at 8, each round's decode window (from the earliest decode start, an answer's
    arrival less its decode time, to the last arrival)."""
    answers = {"off": [], "ngram": []}
    seconds = {"off": 0.0, "ngram": 0.0}
    if concurrency == 1:
        for _ in range(rounds):
            for i, body in enumerate(bodies):
                for proposer in (("off", "ngram") if i % 2 == 0 else ("ngram", "off")):
                    out = post(url, body, proposer)
                    answers[proposer].append(out)
                    seconds[proposer] += out["metrics"]["decode_time"]
        return {"answers": answers, "seconds": seconds}
    batch = [bodies[i % len(bodies)] for i in range(concurrency)]
    with ThreadPoolExecutor(concurrency) as pool:
        for n in range(rounds):
            for proposer in (("off", "ngram") if n % 2 == 0 else ("ngram", "off")):
                timed = list(pool.map(lambda body: (post(url, body, proposer), time.perf_counter()), batch))
                start = min(at - out["metrics"]["decode_time"] for out, at in timed)
                seconds[proposer] += max(at for _, at in timed) - start
                answers[proposer].extend(out for out, _ in timed)
    return {"answers": answers, "seconds": seconds}


def rows_of(prompts: str, concurrency: int, measured: dict, alone: list[dict] | None = None) -> list[dict]:
    """The off and ngram rows of one prompt set at one concurrency. ``alone``: the set's answers one at a time
    ({proposer: answers}, prompt i at i), which each answer at this concurrency is compared with
    (``same_as_alone``: on deterministic steps every one is the same text)."""
    rows = []
    off = measured["answers"]["off"]
    for proposer in ("off", "ngram"):
        outs = measured["answers"][proposer]
        tokens = sum(o["metrics"]["completion_tokens"] for o in outs)
        drafted = sum(o["metrics"].get("draft_tokens", 0) for o in outs)
        accepted = sum(o["metrics"].get("accepted_tokens", 0) for o in outs)
        differ = None if proposer == "off" else sum(a["generated_text"] != b["generated_text"]
                                                     for a, b in zip(outs, off))
        rows.append({
            "proposer": proposer, "prompts": prompts, "concurrency": concurrency,
            "decode_tok_s": round(tokens / measured["seconds"][proposer], 2),
            "acceptance": round(accepted / drafted, 4) if proposer != "off" and drafted else None,
            "greedy_equal": None if differ is None else differ == 0,
            "differ": differ, "requests": len(outs), "completion_tokens": tokens,
            "seconds": round(measured["seconds"][proposer], 4),
            "draft_tokens": drafted, "accepted_tokens": accepted,
            "prompt_tokens_evaluated": sum(o["metrics"].get("prompt_tokens_recomputed", 0) for o in outs),
        })
        if alone is not None:  # the batch sent prompt i % n as its i-th request (measure)
            first = alone[proposer]
            pairs = [(o, first[i % len(first)]) for i, o in enumerate(outs)]
            rows[-1]["same_as_alone"] = [sum(a["generated_text"] == b["generated_text"] for a, b in pairs), len(pairs)]
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--threads", type=int, default=2, help="the decode server's llama.cpp threads")
    ap.add_argument("--rounds", type=int, default=1, help="passes over each prompt set and concurrency")
    ap.add_argument("--free-tokens", type=int, default=160, help="max_tokens of the free-writing prompts")
    ap.add_argument("--code-tokens", type=int, default=0, help="max_tokens of the code requests (0: the grader's)")
    ap.add_argument("--limit", type=int, default=0, help="the first N prompts of each set only (0: all)")
    ap.add_argument("--sets", nargs="*", default=["code", "free"], choices=["code", "feedback", "free"] + PEER_SETS,
                    help="prompt sets: the grader's code and feedback requests, free writing, peer.py's workloads")
    ap.add_argument("--model", default="qwen", choices=("qwen", "gpt-oss"),
                    help="the embedded config's model that serves (gpt-oss: Gemma 3, the grader's feedback model)")
    ap.add_argument("--flash-attn", choices=("on", "off"), help="the model's flash_attn (default: the config's)")
    ap.add_argument("--deterministic", choices=("on", "off"), default="on",
                    help="the server's batch-invariant steps (on: as the grader's cluster runs)")
    ap.add_argument("--paired-steps", choices=("on", "off"), default="off",
                    help="deterministic steps with two rows or more of every sequence (the model's paired_steps)")
    quick.add_argument(ap)
    args = quick.apply(ap, ap.parse_args(argv), threads=1, free_tokens=24, code_tokens=32, limit=3)

    data = config_dict(args.threads, args.quick, args.deterministic == "on",
                       None if args.flash_attn is None else args.flash_attn == "on", args.model,
                       args.paired_steps == "on")
    bodies8: dict[str, list[dict]] = {}
    code, feedback = code_requests() if {"code", "feedback"} & set(args.sets) else ([], [])
    sets = {"code": code, "feedback": list(feedback), "free": free_requests(args.free_tokens),
            **{name: peer_requests(name, args.quick) for name in PEER_SETS}}
    sets = {name: sets[name] for name in args.sets}
    fill = {"code": feedback[:1], "feedback": code[:1]}  # the eighth concurrent request where a set has 7
    for name, bodies in sets.items():
        if args.limit:
            del bodies[args.limit:]
        if not args.limit and len(bodies) < SLOTS:
            bodies8[name] = bodies + fill.get(name, [])[:SLOTS - len(bodies)]
        if args.code_tokens and name in ("code", "feedback"):
            for b in bodies + fill.get(name, []):
                b["max_new_tokens"] = args.code_tokens
    rows = []
    with LocalCluster(data, free_ports=True) as cluster:
        cluster.wait_healthy(timeout=600)
        url = cluster.processes[0].url
        quick.say(f"decode server up: {url}")
        for name, bodies in sets.items():
            for body in bodies8.get(name, bodies):  # into the prefix cache: 8 slots hold one set's prompts
                post(url, {**body, "max_new_tokens": 1}, "off")
            alone = None
            for concurrency in (1, SLOTS):
                quick.say(f"{name} prompts, concurrency {concurrency} ...")
                sent = bodies8.get(name, bodies) if concurrency > 1 else bodies
                measured = measure(url, sent, concurrency, args.rounds)
                # beside others, each answer against the same prompt's alone (the sets sent at 8 that add
                # a prompt to fill the batch are not compared)
                same = alone if concurrency > 1 and len(sent) == len(bodies) and args.rounds == 1 else None
                new = rows_of(name, concurrency, measured, same)
                if concurrency == 1:
                    alone = measured["answers"]
                for r in new:
                    quick.say(f"  {r['proposer']:5s} {r['decode_tok_s']:8.2f} tok/s  acceptance {r['acceptance']}  "
                              f"greedy_equal {r['greedy_equal']}")
                rows += new
        describe = requests.get(f"{url}/health", timeout=30).json()
    by = {(r["proposer"], r["prompts"], r["concurrency"]): r for r in rows}
    ratios = {f"{p}_c{c}": round(by[("ngram", p, c)]["decode_tok_s"] / by[("off", p, c)]["decode_tok_s"], 3)
              for p in sets for c in (1, SLOTS)}
    result = {
        "quick": args.quick,
        "model": "tiny llama (generated)" if args.quick else data["models"][args.model]["model"],
        "threads": args.threads, "slots": SLOTS, "rounds": args.rounds, "deterministic": args.deterministic == "on",
        "flash_attn": data["models"][args.model].get("flash_attn"), "sets": list(sets),
        # issue 44: ngram becomes the default where no cell falls below this of speculation off
        "cells_below_0_97": sorted(k for k, v in ratios.items() if v < 0.97),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "step_cost": (describe.get("model_info") or describe.get("backend") or {}).get("speculation")
        if isinstance(describe, dict) else None,
        # what the load measured (deterministic steps): a lone row unpadded, guesses verified at all
        **{key: (describe.get("model_info") or {}).get(key) for key in ("lone_rows_exact", "verify_rows_exact",
                                                                  "paired_steps")},
        "rows": rows,
        "ratios": ratios,
        "all_greedy_equal": all(r["greedy_equal"] for r in rows if r["greedy_equal"] is not None),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
