"""Benchmark: what the handoff canary measures on intact, batched and damaged states.

In this process, with the servers' own code paths (two llama.cpp backends: one prefills and
exports, the other imports and decodes; kv/canary.py compares), for one model:

- ``alone``: one handoff at a time, per prompt size (expected 0 where the restore is bit-exact);
- ``batched``: the prompts prefilled and decoded together, every step shared (batching noise);
- ``beside``: each prompt prefilled (in the order given, after the runs above, so its slot has
  served other prompts) in steps shared with a sequence generating beside it, as on a busy
  prefill server, then both sides' canary steps alone: the exact tolerance's condition;
- ``damaged``: the last 1% and 0.1% of a state zeroed (checksum-valid: nothing else checks it),
  and another prompt's state of the same size under this prompt's header;

each with its divergence, top-1 agreement, the tolerance that applied and whether it passed, plus
the prefill side's canary cost (``canary_ms``) and the decode side's check (``canary_check_ms``).

    .venv/bin/python benchmarks/canary.py --json [--model smollm2] [--no-flash-attn] [--sizes 64 512 1500]
    .venv/bin/python benchmarks/canary.py --quick --json   # seconds: the tiny model, two prompt sizes
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import quick  # noqa: E402
from disaggregated_inference.backends.base import Eval, ModelSettings, Prefilled, Prompt, Sampling  # noqa: E402
from disaggregated_inference.backends.llama_cpp import LlamaCppBackend  # noqa: E402
from disaggregated_inference.errors import CanaryMismatch  # noqa: E402
from disaggregated_inference.kv.bundle import KIND_LLAMA_SEQ_STATE  # noqa: E402
from disaggregated_inference.kv.receive import Received  # noqa: E402
from disaggregated_inference.metrics import ServerFigures  # noqa: E402

TEXT = (ROOT / "README.md").read_text() + (ROOT / "docs" / "ARCHITECTURE.md").read_text()


def joint(backend, requests):
    """Drive request generators together, one ``evaluate`` per step for all of them (as the owner does);
    returns each one's events (an exception in place of the last when it raised) and return values."""
    events, values, pending = [[] for _ in requests], [None] * len(requests), {}
    live = dict(enumerate(requests))
    for i, request in live.items():
        pending[i] = next(request)
    while live:
        waiting = [p for i, p in pending.items() if isinstance(p, Eval) and not p.complete]
        if waiting:
            backend.evaluate(waiting)
        for i in list(live):
            item = pending[i]
            if isinstance(item, Eval) and not item.complete:
                continue
            if not isinstance(item, Eval):
                events[i].append(item)
            try:
                pending[i] = live[i].send(None)
            except StopIteration as stop:
                values[i] = stop.value
                del live[i], pending[i]
            except CanaryMismatch as exc:
                events[i].append(exc)
                del live[i], pending[i]
    return events, values


def outcome(events) -> dict:
    last = events[-1]
    if isinstance(last, CanaryMismatch):
        return {"passed": False, **{k: last.details.get(k) for k in ("canary_divergence", "canary_top1_match",
                                                                      "canary_tolerance")}}
    m = last.metrics
    return {"passed": m.canary == "passed", **{k: getattr(m, k) for k in ("canary_divergence", "canary_top1_match",
                                                                       "canary_tolerance", "canary_check_ms")}}


def decode(backend, pre, payload=None) -> dict:
    received = Received(pre.kind, pre.tokens, bytes(payload if payload is not None else pre.payload),
                        pre.fingerprint, pre.meta)
    events, _ = joint(backend, [backend.decode(received, Sampling(max_new_tokens=1), lambda: False)])
    return outcome(events[0])


def zero_tail(payload, fraction: float) -> bytes:
    data = bytearray(payload)
    cut = len(data) - int(len(data) * fraction)
    data[cut:] = bytes(len(data) - cut)
    return bytes(data)


def prefill_beside(backend, prompt, companion: list[int]) -> tuple[Prefilled, int]:
    """``prompt`` prefilled in steps that each also evaluate one token of another sequence (``companion``'s
    ids, one per step, as a request generating beside it), its canary step alone; and how many steps it shared."""
    tokens, _ = backend.tokenize(prompt)
    with backend.sequence() as seq, backend.sequence() as other:
        ev, i = Eval(seq, tokens[:-1], 0, logits=False), 0
        while not ev.complete:
            backend.evaluate([ev, Eval(other, [companion[i % len(companion)]], i)])
            i += 1
        payload = bytes(backend.export_state(seq))
        canary = backend.canary.make(backend.logits(seq, [tokens[-1]], len(tokens) - 1), backend.engine, alone=True,
                                     deterministic=getattr(backend.settings, "deterministic", False))
    return Prefilled(KIND_LLAMA_SEQ_STATE, tokens, payload, backend.fingerprint(), ServerFigures(),
                     {"canary": canary, "stop": []}), i


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--no-flash-attn", action="store_true")
    parser.add_argument("--sizes", type=int, nargs="*", default=[64, 512, 1500], help="prompt tokens, roughly")
    parser.add_argument("--threads", type=int, default=2)
    quick.add_argument(parser)
    args = parser.parse_args(argv)
    quick.apply(parser, args, sizes=[64, 300])
    if args.quick and args.model == parser.get_default("model"):
        args.model = quick.tiny_model()

    settings = ModelSettings(model=args.model, n_threads=args.threads, n_ctx=4096, parallel=len(args.sizes),
                             flash_attn=not args.no_flash_attn)
    prefill, decoder = LlamaCppBackend(settings), LlamaCppBackend(settings)
    prefill.load()
    decoder.load()
    prompts = [Prompt(text=TEXT[i * 20000:][: n * 4], raw=True) for i, n in enumerate(args.sizes)]
    alone, damaged = [], []
    for prompt in prompts:
        _, pre = prefill.run(prefill.prefill(prompt))
        row = {"prompt_tokens": len(pre.tokens), "canary_ms": pre.metrics.canary_ms, **decode(decoder, pre)}
        alone.append(row)
        for fraction in (0.01, 0.001):
            damaged.append({"prompt_tokens": len(pre.tokens), "damage": f"last {fraction:.1%} zeroed",
                            **decode(decoder, pre, zero_tail(pre.payload, fraction))})
        other = prefill.tokenize(Prompt(text=TEXT[-30000:], raw=True))[0][:len(pre.tokens)]
        _, wrong = prefill.run(prefill.prefill(Prompt(text=prefill.model.detokenize(other).decode(errors="ignore"),
                                                      raw=True)))
        if len(wrong.payload) == len(pre.payload):
            damaged.append({"prompt_tokens": len(pre.tokens), "damage": "another prompt's state",
                            **decode(decoder, pre, wrong.payload)})
    _, prefilled = joint(prefill, [prefill.prefill(p) for p in prompts])
    received = [Received(p.kind, p.tokens, bytes(p.payload), p.fingerprint, p.meta) for p in prefilled]
    events, _ = joint(decoder, [decoder.decode(r, Sampling(max_new_tokens=1), lambda: False) for r in received])
    batched = [{"prompt_tokens": len(p.tokens), **outcome(e)} for p, e in zip(prefilled, events)]
    companion = prefill.tokenize(Prompt(text=TEXT[-20000:], raw=True))[0]
    beside = []
    for prompt in prompts:
        pre, shared = prefill_beside(prefill, prompt, companion)
        beside.append({"prompt_tokens": len(pre.tokens), "steps_shared": shared, **decode(decoder, pre)})
    out = {"quick": args.quick, "model": Path(args.model).name, "flash_attn": settings.flash_attn,
           "threads": args.threads, "alone": alone,
           "batched": batched, "beside": beside, "damaged": damaged}
    if args.json:
        print(json.dumps(out))
    else:
        for name in ("alone", "batched", "beside", "damaged"):
            for row in out[name]:
                print(name, json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
