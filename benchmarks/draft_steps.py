"""Benchmark: where speculation's time goes, step by step, in process.

One of benchmarks/peer.py's cells, on the model of one decode server built in this process (the embedded
config's ``local-decode-qwen``: SmolLM2 with its slots, threads and flash attention; no socket, no HTTP, no
other server): by default the decode-bound cell at 8 at once, 8 prompts of ~25 tokens x 192 tokens
(``--workload prompt-bound``: 16 prompts of ~950 tokens x 48; ``--at-once``), greedy, end-of-generation
ignored, sent so many at once to the model's owner thread, once per mode per round (``--modes``: the request's
``speculation``, ``off`` and ``ngram`` by default; the order alternates every round, and every mode gets the
round's same prompts). Every model step (``Slots._decode``: filling the batch and ``llama_decode``) is timed
and recorded with its layout: each sequence's tokens in it, the draft it verified and that draft's
acceptance estimate, and how many of the guesses the token loop kept.

JSON, per mode (``modes``): ``tok_s`` of each round and their median; ``steps``, ``step_s`` (seconds in steps),
``tokens`` (what the steps gave the answers: each sampled token and the guesses kept), ``ms_per_token``;
``short_steps``: the steps of answers only with fewer sequences than the batch has slots (the end of a wave,
when answers that drafted ahead have finished and the others go on in smaller steps), with their seconds and
tokens; ``graph_changes``: ubatches (``speculate.split``) whose shape differs from the ubatch before, for which
llama.cpp builds its compute graph again (it reuses the graph for the same shape). Per draft layout of the
modes that draft (``layouts``, the most time first; a layout is each sequence's tokens in the step, in
sequence order): steps, measured ms a step and ``StepCost``'s prediction, tokens a step (emitted, and
predicted from each draft's acceptance: ``speculate.expected_tokens``), ms per emitted token, and the tokens of
each ubatch llama.cpp makes of the step (``speculate.ubatches``).

    .venv/bin/python benchmarks/draft_steps.py --json              # ~2 minutes: 4 rounds, off and ngram
    .venv/bin/python benchmarks/draft_steps.py --json --workload prompt-bound --at-once 1   # ~9 minutes
    .venv/bin/python benchmarks/draft_steps.py --quick --json      # seconds: the tiny model, 8 tokens an answer
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import peer  # noqa: E402  (benchmarks/peer.py: its workloads)
import quick  # noqa: E402
from disaggregated_inference import config as cluster_config  # noqa: E402
from disaggregated_inference.backends import llama_slots, speculate  # noqa: E402
from disaggregated_inference.server import decode, settings as server_settings, web  # noqa: E402
from disaggregated_inference.server.parse import parse_generate  # noqa: E402

SERVER = "local-decode-qwen"
WORKLOADS = {w.name: w for w in peer.WORKLOADS}  # peer.py's, one model busy
LAYOUTS_SHOWN = 20


class StepLog:
    """The steps of the mode that runs now (``mode``): wraps ``Slots._decode`` and ``Lookahead.sampled``."""

    def __init__(self):
        self.mode: str | None = None
        self.steps: list[dict] = []
        self._decode = llama_slots.Slots._decode
        self._sampled = speculate.Lookahead.sampled

    def __enter__(self):
        log = self

        def timed_decode(slots, chosen, pads=None, pad_logits=True):
            # (Eval, guesses, acceptance) before the step: the token loop clears a draft's acceptance once read
            drafts = [(ev, len(ev.tokens) - 1 if ev.draft_acceptance is not None else 0, ev.draft_acceptance)
                      for ev, _ in chosen]
            started = time.perf_counter()
            log._decode(slots, chosen, pads, pad_logits)
            seconds = time.perf_counter() - started
            if log.mode is not None:
                log.steps.append({
                    "mode": log.mode, "seconds": seconds, "drafts": drafts,
                    "counts": sorted((ev.seq, take) for ev, take in chosen),
                    # the Evals whose last row's logits the token loop samples next: a token each, and the guesses kept
                    "sampled": [ev for ev, _ in chosen if ev.logits and ev.complete],
                    # no prompt in the step: a token of each sequence, or a token and its draft
                    "answers_only": all(ev.logits and (take == 1 or a is not None)
                                        for (ev, take), (_, _, a) in zip(chosen, drafts)),
                    "n_ubatch": slots._n_ubatch, "cost": slots._step_cost})

        def counted_sampled(ahead, token):
            kept = log._sampled(ahead, token)
            if kept:
                ahead.ev.kept_in_step = getattr(ahead.ev, "kept_in_step", 0) + 1
            return kept

        llama_slots.Slots._decode = timed_decode
        speculate.Lookahead.sampled = counted_sampled
        return self

    def __exit__(self, *exc):
        llama_slots.Slots._decode = self._decode
        speculate.Lookahead.sampled = self._sampled


def emitted(step: dict) -> int:
    """Tokens the step gave its answers: a sampled token each, and the guesses kept."""
    return sum(1 + getattr(ev, "kept_in_step", 0) for ev in step["sampled"])


def summary(steps: list[dict], slots: int) -> dict:
    short = [s for s in steps if s["answers_only"] and len(s["counts"]) < slots]
    changes, last = 0, None
    for s in steps:
        for ubatch in speculate.split(s["counts"], s["n_ubatch"]):
            shape = tuple(n for _, n in ubatch)
            changes += shape != last
            last = shape
    seconds, tokens = sum(s["seconds"] for s in steps), sum(emitted(s) for s in steps)
    return {"steps": len(steps), "step_s": round(seconds, 3), "tokens": tokens,
            "ms_per_token": round(seconds / tokens * 1e3, 3) if tokens else None,
            "short_steps": {"steps": len(short), "seconds": round(sum(s["seconds"] for s in short), 3),
                            "tokens": sum(emitted(s) for s in short)},
            "graph_changes": changes}


def layouts(steps: list[dict]) -> list[dict]:
    """The draft layouts of ``steps`` (steps of answers only where some sequence verified a draft), the most time first."""
    by = defaultdict(list)
    for s in steps:  # by the tokens of each sequence and the ubatches llama.cpp makes of them (ids need not be adjacent)
        if s["answers_only"] and any(k for _, k, _ in s["drafts"]):
            by[(tuple(n for _, n in s["counts"]), tuple(speculate.ubatches(s["counts"], s["n_ubatch"])))].append(s)
    out = []
    for (layout, ubatches), group in by.items():
        seconds, tokens = sum(s["seconds"] for s in group), sum(emitted(s) for s in group)
        predicted = sum(speculate.expected_tokens(a, k) if a is not None else 1.0 for s in group for _, k, a in s["drafts"])
        cost = group[0]["cost"]
        out.append({"layout": list(layout), "ubatches": list(ubatches), "steps": len(group), "seconds": round(seconds, 3),
                    "ms_per_step": round(seconds / len(group) * 1e3, 2),
                    "predicted_ms": round(cost.of(group[0]["counts"], group[0]["n_ubatch"]) * 1e3, 2) if cost else None,
                    "tokens_per_step": round(tokens / len(group), 2), "predicted_tokens_per_step": round(predicted / len(group), 2),
                    "ms_per_token": round(seconds / tokens * 1e3, 2)})
    return sorted(out, key=lambda r: -r["seconds"])[:LAYOUTS_SHOWN]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rounds", type=int, default=4, help="rounds; each runs the cell once per mode")
    ap.add_argument("--modes", nargs="+", default=["off", "ngram"], choices=list(speculate.PROPOSERS),
                    help="the requests' speculation, one cell each a round")
    ap.add_argument("--workload", choices=list(WORKLOADS), default="decode-bound", help="peer.py's workload")
    ap.add_argument("--at-once", type=int, default=8, help="requests at once")
    ap.add_argument("--tokens", type=int, help="max_tokens of each answer (default: the workload's)")
    quick.add_argument(ap)
    args = quick.apply(ap, ap.parse_args(argv), rounds=1, tokens=8)
    workload = WORKLOADS[args.workload]
    args.tokens = args.tokens or workload.max_tokens

    data = json.loads((ROOT / "config_current.json").read_text())
    if args.quick:
        data = quick.on_tiny_model(data)
        data["models"]["qwen"]["n_threads"] = 1
    cfg = cluster_config.coerce(data)
    # the server alone on this machine: no other server of the config runs to share its cores with
    settings = dataclasses.replace(server_settings.from_cluster(cfg, SERVER), core_group="")
    log = StepLog()
    rounds: dict[str, list[float]] = {mode: [] for mode in args.modes}
    with log:
        app = decode.create_app(settings)
        st = app.extensions["disagg"]
        try:
            deadline = time.monotonic() + 600
            while not st.owner.ready:
                if time.monotonic() > deadline:
                    raise SystemExit("the model did not load in 600 s")
                time.sleep(0.1)
            slots = st.owner.backend.slots

            def answer(prompt: str, mode: str) -> int:
                with app.app_context():
                    req = parse_generate({"prompt": prompt, "raw": True, "max_new_tokens": args.tokens,
                                          "temperature": 0.0, "ignore_eos": True, "stream": True, "speculation": mode})
                    tokenized, _ = web.tokenized(st, req.prompt)
                    return sum(1 for _ in st.owner.stream(lambda b, c: b.generate(tokenized, req.sampling, c)))

            answer(workload.prompt(9999, 0), args.modes[-1])  # a warm-up
            with ThreadPoolExecutor(args.at_once) as pool:
                for n in range(args.rounds):
                    for mode in (args.modes if n % 2 == 0 else args.modes[::-1]):
                        log.mode = mode
                        started = time.perf_counter()
                        list(pool.map(lambda i: answer(workload.prompt(n, i), mode), range(workload.prompts)))
                        rounds[mode].append(workload.prompts * args.tokens / (time.perf_counter() - started))
                        log.mode = None
                        quick.say(f"round {n + 1}, {mode}: {rounds[mode][-1]:.1f} tok/s")
            cost = st.owner.backend._step_cost
        finally:
            st.owner.shutdown()
    result = {
        "quick": args.quick,
        "model": "tiny llama (generated)" if args.quick else data["models"]["qwen"]["model"],
        "threads": settings.model.n_threads, "slots": slots, "workload": args.workload,
        "prompts": workload.prompts, "at_once": args.at_once, "tokens": args.tokens,
        "rounds": args.rounds, "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "step_cost": str(cost) if cost else None,
        "modes": {mode: {"tok_s": [round(v, 2) for v in rounds[mode]], "median_tok_s": round(statistics.median(rounds[mode]), 2),
                         **summary([s for s in log.steps if s["mode"] == mode], slots),
                         "layouts": layouts([s for s in log.steps if s["mode"] == mode]) if mode != "off" else []}
                  for mode in args.modes},
    }
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
