#!/usr/bin/env python3
"""End-to-end smoke test of a running cluster.

1. every server of the config answers /health with its model loaded;
2. one short generation per model goes through the client (prefill -> KV handoff -> decode);
   the answer must not be empty, must not come from the decode-only fallback, and for a
   model whose prefill and decode servers are all llama_cpp the method must be
   "kv_handoff" (the KV cache itself was handed over, not recomputed);
3. a summary table; the exit status says whether everything passed.

Exit status: 0 all passed, 1 a check failed (each named on stderr), 2 for a bad config.
Requests carry the API token from --api-token or $DISAGG_API_TOKEN when the servers want one.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import check_status  # noqa: E402  (the health step is check_status.py's)

PROMPTS = {
    "qwen": "Write a one-line Python expression that sums the squares of 1 to 10.",
    "gpt-oss": "In one sentence, encourage a student whose notebook ran without errors.",
}
DEFAULT_PROMPT = "Say hello in one short sentence."


def expected_method(cfg, model_key: str) -> str | None:
    """'kv_handoff' when every server of the model runs llama.cpp; None: any non-fallback method."""
    backends = {s.settings.get("backend", "llama_cpp") for s in cfg.servers if s.model == model_key}
    return "kv_handoff" if backends == {"llama_cpp"} else None


def run_model(client, cfg, model_key: str, prompt: str, max_tokens: int) -> dict:
    has = {role: any(s.model == model_key for s in getattr(cfg, f"{role}_servers")) for role in ("prefill", "decode")}
    result = {"model": model_key, "passed": False, "method": None, "prefill_server": None, "decode_server": None,
              "prompt_tokens": None, "completion_tokens": None, "kv_bytes": None, "ttft": None,
              "total_time": None, "text": None, "problem": None}
    if not (has["prefill"] and has["decode"]):
        missing = " and ".join(role for role, present in has.items() if not present)
        result["problem"] = f"no {missing} server configured for this model"
        return result
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            # the handoff itself is under test: never let client.route "auto" keep a short prompt local
            text, metrics = client.generate(model=model_key, prompt=prompt, max_tokens=max_tokens, seed=0,
                                            route="handoff")
        except Exception as exc:  # reported, not raised: the summary names it
            result["problem"] = f"generate failed: {getattr(exc, 'message', None) or exc}"
            result["total_time"] = round(time.perf_counter() - started, 3)
            return result
    result.update({k: metrics.get(k) for k in ("method", "prefill_server", "decode_server", "prompt_tokens",
                                               "completion_tokens", "kv_bytes", "ttft", "total_time")})
    result["text"] = text
    want = expected_method(cfg, model_key)
    notes = [str(w.message) for w in caught] + list(metrics.get("warnings", []))
    if not text.strip():
        result["problem"] = "empty answer"
    elif metrics.get("method") == "decode_only_fallback":
        result["problem"] = "served by the decode-only fallback: " + ("; ".join(notes) or "prefill path failed")
    elif want and metrics.get("method") != want:
        result["problem"] = f"method is {metrics.get('method')!r}, expected {want!r}" + (
            f" ({'; '.join(notes)})" if notes else "")
    else:
        result["passed"] = True
    return result


def print_summary(health_rows: list[dict], results: list[dict]) -> None:
    up = sum(1 for r in health_rows if r["up"])
    print(f"health: {up}/{len(health_rows)} servers up and loaded")
    for r in health_rows:
        if not r["up"]:
            print(f"  {r['status']}: {r['name']} ({r['url']}): {r['error'] or r['progress'] or ''}")
    if not results:
        return
    head = ("model", "result", "method", "prefill", "decode", "prompt", "out", "KV", "ttft", "total")
    rows = [head]
    for r in results:
        kv = "-" if r["kv_bytes"] is None else f"{r['kv_bytes'] / 1e6:.1f} MB"
        rows.append((r["model"], "PASS" if r["passed"] else "FAIL", r["method"] or "-", r["prefill_server"] or "-",
                     r["decode_server"] or "-", r["prompt_tokens"] if r["prompt_tokens"] is not None else "-",
                     r["completion_tokens"] if r["completion_tokens"] is not None else "-", kv,
                     "-" if r["ttft"] is None else f"{r['ttft']:.3f}s",
                     "-" if r["total_time"] is None else f"{r['total_time']:.2f}s"))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    print()
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    for r in results:
        if r["text"]:
            print(f"\n[{r['model']}] {' '.join(r['text'].split())[:300]}")
        if r["problem"]:
            print(f"[{r['model']}] problem: {r['problem']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="test_system.py", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None,
                        help="cluster config (default: $DISAGG_CONFIG, else ./config_current.json, "
                             "else the repository's)")
    parser.add_argument("--models", nargs="*", metavar="MODEL", help="model keys or aliases to try (default: all)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (default: 16)")
    parser.add_argument("--prompt", default=None, help="the prompt for every model (default: one per model)")
    parser.add_argument("--api-token", default=os.environ.get("DISAGG_API_TOKEN"),
                        help="bearer token, when the servers have one (default: $DISAGG_API_TOKEN)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    check_status._use_repo_venv()
    from disaggregated_inference import config as cluster_config
    from disaggregated_inference.client import DisaggregatedClient
    from disaggregated_inference.errors import ConfigError, ModelNotFound

    try:
        cfg = cluster_config.load(args.config or check_status.default_config())
        models = [cfg.resolve_model(m) for m in args.models] if args.models else list(cfg.models)
    except (ConfigError, ModelNotFound) as exc:
        print(f"test_system.py: configuration error: {exc.message}", file=sys.stderr)
        return 2

    health = check_status.check(cfg)
    down = [r for r in health if not r["up"]]
    mismatches, _ = check_status.pair_problems(health)
    results = []
    if not down and not mismatches:
        with DisaggregatedClient(cfg, health_check=False, api_token=args.api_token) as client:
            for key in models:
                prompt = args.prompt or PROMPTS.get(key, DEFAULT_PROMPT)
                print(f"test_system.py: generating with {key} ...", file=sys.stderr, flush=True)
                results.append(run_model(client, cfg, key, prompt, args.max_tokens))

    if args.json:
        print(json.dumps({"health": health, "results": results}, indent=2))
    else:
        print_summary(health, results)
    failures = [f"{r['status']}: {r['role']} server {r['name']} ({r['url']}): {r['error'] or r['status']}"
                for r in down]
    failures += [f"model {r['model']}: {r['problem']}" for r in results if not r["passed"]]
    failures += mismatches
    if down or mismatches:
        failures.append("generation not attempted: " + ("not every server is up" if down else "mismatched servers"))
    for line in failures:
        print(f"test_system.py: FAIL: {line}", file=sys.stderr)
    if not failures:
        print(f"test_system.py: PASS: {len(health)} servers healthy, {len(results)} models generated "
              "through prefill -> decode", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
