"""Every benchmark under benchmarks/ runs (``--quick --json``) and its JSON holds together.

Each script runs as a subprocess with this interpreter, in seconds (tiny sizes, a generated tiny
model where the answers do not matter; see benchmarks/quick.py), and its output is checked against
itself: the counts it reports match the rows it printed, each ratio is the quotient of the figures it
names, and each baseline did the work it claims (handoff.py's cold recompute evaluated every prompt
token; its handoff evaluated one). Nothing here asserts a speed: benchmarks measure, tests check.
A benchmark that breaks fails here.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
HELPERS = {"quick"}  # modules the benchmarks share, not benchmarks

# the SLOs throughput.py's quick run is given: goodput is checked against its per-request figures
SLOS = {"ttft": 2000.0, "tpot": 100.0}


def run_quick(script: str, *extra: str, timeout: float = 600) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--json", *extra],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{script} --quick ran past {timeout:g} s; stderr:\n{(exc.stderr or b'')[-3000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{script} --quick exited {proc.returncode}; stderr:\n{proc.stderr[-4000:]}")
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"{script} --quick printed no single JSON object on stdout:\n{proc.stdout[-2000:]}")


def quotient(ratio, a, b, digits: int, ratio_digits: int = 3) -> bool:
    """Whether ``ratio`` (rounded to ``ratio_digits``) is a / b for the true values behind ``a`` and
    ``b``, which were printed rounded to ``digits`` decimals."""
    half, slack = 0.5 * 10 ** -digits, 0.5 * 10 ** -ratio_digits + 1e-9
    return (a - half) / (b + half) - slack <= ratio <= (a + half) / max(b - half, 1e-12) + slack


@pytest.mark.slow
def test_handoff():
    out = run_quick("handoff.py")
    assert out["quick"] is True and out["decode_prefix_cache"] is True
    rows = out["results"]
    assert len(rows) == 2 and rows[0]["prompt_tokens"] < rows[1]["prompt_tokens"]
    for r in rows:
        assert r["runs"] == 2 and r["reprefill_runs"] == 1
        assert r["handoff_recomputed"] == 1  # the handoff evaluated one prompt token
        # the cold recompute evaluated every prompt token: nothing was cached on its server
        assert r["reprefill_cold_recomputed"] == r["prompt_tokens"]
        # the warm one reused the cached start and evaluated the rest
        assert r["reprefill_warm_cached"] > 0
        assert r["reprefill_warm_cached"] + r["reprefill_warm_recomputed"] == r["prompt_tokens"]
        assert quotient(r["speedup_vs_cold"], r["reprefill_cold_ttft_s"], r["handoff_ttft_s"], 6, 6)
        assert quotient(r["speedup_vs_warm"], r["reprefill_warm_ttft_s"], r["handoff_ttft_s"], 6, 6)
        assert r["kv_bytes"] > 0 and r["handoff_gbps"] > 0 and r["loopback_gbps"] > 0
        assert r["export_s"] > 0 and r["transfer_s"] > 0 and r["import_s"] > 0
    # the state grows by the same bytes per token at both sizes (the prompt's KV, all of it)
    per_token = [r["kv_bytes"] / (r["prompt_tokens"] - 1) for r in rows]
    assert per_token[0] == pytest.approx(per_token[1], rel=0.02)
    memory = out["memory"]
    assert memory["kv_bytes"] == rows[-1]["kv_bytes"]  # the same prompt, exported in this process
    assert memory["prefill_peak_copies"] >= 1 and memory["decode_peak_copies"] >= 1
    assert out["loopback_gbps"] > 0 and out["loopback_bulk_gbps"] > 0 and out["memory_copy_gbps"] > 0


def check_serving(level: dict) -> None:
    """A level's ``serving`` block against its per-request figures (``requests_detail``)."""
    s, detail = level["serving"], level["requests_detail"]
    done = [d for d in detail if d["ok"]]
    assert len(detail) == level["requests"] == s["completed"] + s["failed"]
    assert s["failed"] == level["failed"] == 0
    assert s["duration"] == pytest.approx(level["wall_s"], abs=1e-4)
    assert s["total_output_tokens"] == sum(d["output_tokens"] for d in done)
    assert s["total_input_tokens"] == sum(d["prompt_tokens"] for d in done)
    assert all(0 < d["output_tokens"] <= 16 for d in done)  # --max-tokens 16
    assert s["request_throughput"] == pytest.approx(s["completed"] / s["duration"], rel=1e-3)
    assert s["output_throughput"] == pytest.approx(s["total_output_tokens"] / s["duration"], rel=1e-3)
    assert level["completion_tok_s"] == pytest.approx(s["output_throughput"], rel=2e-3)
    for d in done:  # vLLM's definitions, request by request
        assert d["e2el_ms"] >= d["ttft_ms"] > 0
        # one gap fewer than pieces, and a piece carries a token or more (a held stop-string tail may add one)
        assert len(d["itl_ms"]) <= d["output_tokens"] and all(g >= 0 for g in d["itl_ms"])
        if d["output_tokens"] > 1:
            assert d["tpot_ms"] == pytest.approx((d["e2el_ms"] - d["ttft_ms"]) / (d["output_tokens"] - 1), abs=2e-3)
        else:
            assert d["tpot_ms"] is None
    ttft = [d["ttft_ms"] for d in done]
    itl = [g for d in done for g in d["itl_ms"]]
    tpot = [d["tpot_ms"] for d in done if d["tpot_ms"] is not None]
    e2el = [d["e2el_ms"] for d in done]
    for name, values in (("ttft", ttft), ("itl", itl), ("tpot", tpot), ("e2el", e2el)):
        assert s[f"mean_{name}_ms"] == pytest.approx(statistics.fmean(values), abs=2e-3)
        assert s[f"median_{name}_ms"] == pytest.approx(statistics.median(values), abs=2e-3)
        assert s[f"p99_{name}_ms"] == pytest.approx(float(np.percentile(values, 99)), abs=2e-3)
    good = sum(1 for d in done if d["ttft_ms"] <= SLOS["ttft"] and (d["tpot_ms"] or 0.0) <= SLOS["tpot"])
    assert s["slo_ms"] == SLOS and s["good_requests"] == good
    assert s["request_goodput"] == pytest.approx(good / s["duration"], rel=1e-3)


@pytest.mark.slow
def test_throughput():
    out = run_quick("throughput.py", *[f"--slo={k}:{v:g}" for k, v in SLOS.items()])
    assert out["quick"] is True and out["slo_ms"] == SLOS
    assert set(out["bare_tok_s"]) == {"1", "8"}
    assert len(out["engine_rounds"]) == 1
    r = out["engine_rounds"][0]
    for side in ("owner_8", "server_8"):
        # ignore_eos: every one of the 8 sequences generated its whole budget
        assert r[side]["sequences"] == 8 and r[side]["completion_tokens"] == 8 * out["engine_tokens"]
        assert r[side]["pieces_all_active"] <= r[side]["completion_tokens"]
        rate = r[side]["all_active_tok_s"]
        assert rate is None or rate == pytest.approx(r[side]["pieces_all_active"] / r[side]["all_active_s"], rel=0.01)
        ratio = r[f"{side}_over_bare_8"]
        assert ratio is None or quotient(ratio, rate, r["bare_8_tok_s"], 1)
    targets = out["targets"]
    assert targets["server_8_over_bare_8"] == r["server_8_over_bare_8"]  # the median of one round
    det = out["deterministic"]  # batch-invariant steps on against off, measured in the same run
    assert len(det["decode_server_8"]["rounds"]) == 2
    for part in ("decode_server_8", "decode_server_1", "cluster_8"):
        on, off = det[part]["on_tok_s"], det[part]["off_tok_s"]
        assert on > 0 and off > 0 and det[part]["cost"] == pytest.approx(1 - on / off, abs=1e-3)
    assert targets["deterministic_cost_decode_server_8"] == det["decode_server_8"]["cost"]
    clusters = {"slots": out["slots"], "single_slot": out["single_slot"]}
    assert clusters["single_slot"]["parallel"] == 1
    for cluster in clusters.values():
        assert [lv["concurrency"] for lv in cluster["levels"]] == [1, 8]
        for level in cluster["levels"]:
            assert level["requests"] == max(level["concurrency"], 4)
            check_serving(level)
    one, eight = (clusters["slots"]["levels"][i] for i in (0, 1))
    assert quotient(targets["tok_s_8_over_1"], eight["completion_tok_s"], one["completion_tok_s"], 2)
    single_eight = clusters["single_slot"]["levels"][1]
    assert quotient(targets["tok_s_8_slots_over_single_slot"], eight["completion_tok_s"],
                    single_eight["completion_tok_s"], 2)


@pytest.mark.slow
def test_routing():
    out = run_quick("routing.py")
    rows = out["results"]
    assert out["quick"] is True and out["repeat"] == 1 and len(rows) == 2
    for r in rows:
        ttft = {m: r[f"{m}_ttft_s"] for m in ("auto", "handoff", "decode_only")}
        kept = {m: len(v) for m, v in r["runs_ttft_s"].items()}
        assert all(kept[m] + r["runs_astray"][m] == out["repeat"] for m in kept)
        assert r["better_path"] == min(("handoff", "decode_only"), key=ttft.get)
        best = ttft[r["better_path"]]
        assert quotient(r["auto_vs_best"], ttft["auto"], best, 4)
        assert r["choice"] in r["auto_paths"] and r["choice_matched_better"] == (r["choice"] == r["better_path"])
        pooled = r["pooled_ttft_s"]
        charged = statistics.fmean(pooled[p] for p in r["auto_paths"])
        assert quotient(r["policy_vs_best"], charged, min(pooled.values()), 4)
        assert r["canary"] == ["passed"] and r["kv_bytes"] > 0
    assert out["target_met"] == all(r["policy_vs_best"] <= out["target"] for r in rows)
    assert out["runs_astray"] == sum(sum(r["runs_astray"].values()) for r in rows)


@pytest.mark.slow
def test_failover():
    out = run_quick("failover.py")
    sustained, failover, fallback = out["sustained"], out["failover"], out["fallback"]
    assert sustained["requests"] > 0 and sustained["errors"] == 0  # no fault injected: no error
    assert sustained["error_rate"] == sustained["errors"] / sustained["requests"]
    assert sustained["requests_per_s"] == pytest.approx(sustained["requests"] / sustained["seconds"], abs=0.01)
    window = out["seconds_after_kill"]
    for phase, key in ((failover, "time_to_first_answer_via_other_prefill_s"),
                       (fallback, "time_to_first_decode_only_answer_s")):
        assert phase["requests_after_kill"] > 0 and 0 <= phase["errors"] <= phase["requests_after_kill"]
        assert phase[key] is not None and 0 < phase[key] <= window + failover["slowest_request_across_the_kill_s"]
    for name, key in (("hang_prefill", "time_to_first_answer_via_other_server_s"),
                      ("hang_decode", "time_to_first_failure_s")):
        hang = out[name]
        assert hang["frozen_s"] == window and hang["requests_while_frozen"] > 0
        assert 0 <= hang["errors_while_frozen"] <= hang["requests_while_frozen"]
        assert hang[key] is not None and 0 < hang[key] <= window
        # thawed, the server serves again without a restart, within the run's last window
        assert hang["time_from_thaw_to_first_answer_through_it_s"] is not None
        assert 0 < hang["time_from_thaw_to_first_answer_through_it_s"] <= window
    assert out["hang_prefill"]["errors_while_frozen"] == 0  # the other prefill server took the requests


@pytest.mark.slow
def test_slow_clients():
    out = run_quick("slow_clients.py")
    assert out["quick"] is True and set(out["workers"]) == {"gthread", "buffered"}
    for name, row in out["workers"].items():
        assert row["idle"]["failed_or_timed_out"] == 0, (name, row)
        for kind in ("health", "generate"):
            summary = row["slow"][kind]
            assert summary["answered"] == 0 or summary["p50_ms"] <= summary["max_ms"]
    buffered = out["workers"]["buffered"]["slow"]
    # the buffered worker answers every probe beside the slow connections, and closes each of them
    assert buffered["failed_or_timed_out"] == 0 and buffered["closed_by_server"] == out["connections"]
    assert buffered["closed_after_s"] <= out["header_timeout_s"] + 5


@pytest.mark.slow
def test_prefix():
    out = run_quick("prefix.py")
    rows = out["rows"]
    assert out["quick"] is True and len(rows) == 2 * 3  # two rounds of three prompts
    assert out["states_identical"] is True  # the cache's promise: bit-identical exported states
    for r in rows:
        assert r["state_identical"] is True and 0 <= r["cached_tokens"] < r["prompt_tokens"]
    assert all(r["cached_tokens"] > 0 for r in rows if r["round"] == 2)  # the second pass finds its prompts
    for key, selected in [("all", rows)] + [(None, [r for r in rows if r["round"] == n]) for n in (1, 2)]:
        totals = out["all"] if key else out["per_round"][str(selected[0]["round"])]
        assert totals["prompts"] == len(selected)
        assert totals["prompt_tokens"] == sum(r["prompt_tokens"] for r in selected)
        assert totals["cached_tokens"] == sum(r["cached_tokens"] for r in selected)
        assert totals["no_cache_s"] == pytest.approx(sum(r["no_cache_s"] for r in selected), abs=2e-3)
        assert quotient(totals["no_cache_over_cache"], totals["no_cache_s"], totals["cache_s"], 3)
    assert out["median_prompt_ratio"] == pytest.approx(
        statistics.median(r["no_cache_s"] / r["cache_s"] for r in rows), abs=1e-3)


@pytest.mark.slow
def test_canary():
    out = run_quick("canary.py")
    assert out["quick"] is True
    for part in ("alone", "batched", "beside"):
        assert len(out[part]) == 2
    for part in ("alone", "batched", "beside", "damaged"):
        for row in out[part]:  # the verdict is the divergence against the tolerance that applied
            assert row["passed"] == (row["canary_divergence"] <= row["canary_tolerance"])
    for row in out["alone"]:  # one handoff at a time restores the state bit for bit
        assert row["passed"] and row["canary_divergence"] == 0.0 and row["canary_ms"] > 0
    assert {r["damage"] for r in out["damaged"]} >= {"last 1.0% zeroed", "last 0.1% zeroed"}


@pytest.mark.slow
def test_engines():
    pytest.importorskip("mlx_lm")  # every pair decodes on an MLX server
    out = run_quick("engines.py", "--handoff-modes", "whole", "streamed")
    assert out["quick"] is True and not out["interrupted"]
    rows = out["results"]
    assert len(rows) == len(out["pairs"]) * len(out["sizes"]) * 2 and out["pairs"]
    for r in rows:
        assert r["runs"] == out["repeat"] and r["canary"] == ["passed"]
        # the engines that stream their KV do (llama.cpp's converted to neutral_kv, and MLX's, go whole)
        streams = r["handoff_mode"] == "streamed" and r["pair"] in ("transformers->mlx", "vllm->llama_cpp", "vllm->mlx")
        assert r["served"] == ["streamed" if streams else "whole"] and (r["exposed_ms"] is not None) == streams, r
        assert quotient(r["handoff_vs_decode_only"], r["handoff_ttft_s"], r["decode_only_ttft_s"], 4)
        assert r["kv_bytes_per_token"] == round(r["kv_bytes"] / (r["prompt_tokens"] - 1))
        assert (r["convert_ms"] is None) == (r["pair"] == "mlx->mlx")  # MLX -> MLX converts nothing
        if r["convert_ms"] is not None:
            assert quotient(r["convert_ms_per_mb"], r["convert_ms"], r["kv_bytes"] / 1e6, 2)
    throughput = out["prefill_throughput"]
    if any(p.startswith("vllm->") for p in out["pairs"]):  # vLLM installed: its prefill against llama.cpp's
        assert {(t["engine"], t["concurrency"]) for t in throughput} == {
            (engine, c) for engine in ("vllm", "llama_cpp") for c in (1, 8)}
        for t in throughput:
            assert quotient(t["prompt_tokens_per_s"], t["prompt_tokens"], t["wall_s"], 3, 1)
            assert t["prompt_tokens_cached"] == 0  # distinct prompts: neither prefix cache may help
    else:
        assert throughput == [] and "vllm->mlx" in out["left_out"]


@pytest.mark.slow
def test_grading():
    from disaggregated_inference.grading.sandbox import find_sandbox

    out = run_quick("grading.py", "--jobs", "2", "1", "--execute", "on", "off")
    runs = out["runs"]
    assert out["default_jobs"] == 2
    assert [(r["jobs"], r["execute"]) for r in runs] == [(2, True), (2, False), (1, True), (1, False)]
    sandbox, _ = find_sandbox()
    for r in runs:  # a run with execution on re-ran every notebook where the sandbox works; off, none
        assert r["execution"]["re_run"] == (4 if r["execute"] and sandbox else 0)
        if r["execute"] and sandbox:
            assert r["execution"]["seconds"] > 0
    assert [(c["jobs"], c["wall_s_on"], c["wall_s_off"]) for c in out["execution_cost"]] == \
        [(r["jobs"], r["wall_s"], runs[i + 1]["wall_s"]) for i, r in enumerate(runs) if r["execute"]]
    for c in out["execution_cost"]:
        assert quotient(c["on_over_off"], c["wall_s_on"], c["wall_s_off"], 3)
    assert "meaningless" in out["models"]  # the quick run says its answers mean nothing
    for r in runs:
        assert r["notebooks"] == 4 == len(r["scores"]) == sum(r["statuses"].values())
        assert r["notebooks_per_minute"] == pytest.approx(60 * r["notebooks"] / r["wall_s"], rel=0.01)
        assert r["requests"] >= 2 * r["notebooks"] and r["errors"] == [] and r["fallbacks"] == 0  # both models each
        assert max(r["most_busy"][f"local-decode-{m}"] for m in ("qwen", "gpt-oss")) <= r["jobs"]
    best = max(runs, key=lambda r: r["notebooks_per_minute"])
    assert out["best_jobs"] == best["jobs"]
    assert quotient(out["default_vs_best"], runs[0]["notebooks_per_minute"], best["notebooks_per_minute"], 3)


@pytest.mark.slow
def test_peer(monkeypatch):
    """Runs against llama-server where one is already built (the quick run never builds it), else says why
    the peer's rows are missing; every cell is the median of its rows, and each of ours is over the peer's.
    The quick run states no targets; issue 44's are computed here from its cells."""
    import importlib.util

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # peer.py imports benchmarks/quick.py
    spec = importlib.util.spec_from_file_location("peer_benchmark", ROOT / "benchmarks" / "peer.py")
    peer_module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, peer_module)  # its dataclasses look their module up
    spec.loader.exec_module(peer_module)
    out = run_quick("peer.py")
    assert out["targets"] is None
    rows, cells = out["rows"], out["cells"]
    ours = {"decode-server", "gateway"}
    peer_ran = out["peer"]["skipped"] is None
    assert peer_ran or out["peer"]["skipped"]  # a reason, when skipped
    assert {r["endpoint"] for r in rows} == ours | ({"llama-server"} if peer_ran else set())
    for r in rows:
        assert r["failed"] == 0 and r["completion_tokens"] == r["requests"] * (8 if r["workload"] == "decode-bound" else 4)
        assert quotient(r["gen_tok_s"], r["completion_tokens"], r["wall_s"], 3, 2)
        for m in r["per_model"].values():  # the slowest request, beside the mean, within the cell's wall time
            assert 0 < m["mean_latency_s"] <= m["max_latency_s"] <= r["wall_s"]
        if r["endpoint"] in ours:  # our decode servers' guesses during the cell, read from their /metrics
            assert 0 <= r["accepted_tokens"] <= r["draft_tokens"]
        else:
            assert r["draft_tokens"] is None and r["accepted_tokens"] is None
        # model steps during the cell (ours: owner steps; llama-server: llama_decode calls). llama-server takes one
        # a token of the longest answer (8 tokens decode-bound, 4 prompt-bound; the prompt's step gives the first);
        # ours may verify guesses, but never answer from the prompt's step alone
        assert r["steps"] >= ((8 if r["workload"] == "decode-bound" else 4) if r["endpoint"] == "llama-server" else 2)
        assert quotient(r["ms_per_step"], r["wall_s"] * 1000, r["steps"], 0)
        # the gateway's requests by how it served them (its /metrics): the default route hands every one off
        assert r["methods"] == ({"kv_handoff": r["requests"]} if r["endpoint"] == "gateway" else None)
    for c in cells:
        same = [r for r in rows if all(r[k] == c[k] for k in ("workload", "concurrency", "busy_models", "endpoint"))]
        assert c["rounds"] == len(same) == 1 and c["gen_tok_s"] == same[0]["gen_tok_s"]
        assert c["methods"] == same[0]["methods"]  # summed over the rounds: one here
        one = same[0]["gen_tok_s"]  # one round: no spread
        assert c["spread"]["gen_tok_s"] == {"min": round(one, 3), "max": round(one, 3), "iqr": 0}
        peer = next((p for p in cells if p["endpoint"] == "llama-server"
                     and all(p[k] == c[k] for k in ("workload", "concurrency", "busy_models"))), None)
        if c["endpoint"] in ours and peer is not None:
            assert quotient(c["speed_vs_peer"], c["gen_tok_s"], peer["gen_tok_s"], 2)
        else:
            assert c["speed_vs_peer"] is None
    assert set(out["servers"]) == {f"local-{role}-{m}" for role in ("prefill", "decode") for m in ("qwen", "gpt-oss")}
    decode = {f"local-decode-{m}" for m in ("qwen", "gpt-oss")}
    assert set(out["speculation_before_round_1"]) == decode  # as the first round began (--quick waits 60 s at most)
    for name, spec in out["speculation_before_round_1"].items():
        assert spec["proposer"] == "off" or spec["step_cost_measures"] >= 1
        assert spec["step_cost_s"] is None or spec["step_cost_s"]["per_token"] > 0
        assert out["servers"][name]["speculation"]["proposer"] == spec["proposer"]
    for endpoint, bar in (("decode-server", 1.0), ("gateway", 0.95)):  # issue 44's bars, from the cells
        target = peer_module.targets(cells, 2)["issue_44"][endpoint]
        ratios = [c["speed_vs_peer"] for c in cells if c["endpoint"] == endpoint and c["busy_models"] == 1]
        assert target["bar"] == bar and sorted(target["one_model"].values(), key=str) == sorted(ratios, key=str)
        assert target["met"] is (peer_ran and all(r >= bar for r in ratios))


@pytest.mark.slow
def test_peer_client_option():
    """``--client-option`` reaches the gateway's client: with ``route="decode_only"`` every gateway request stays on
    the decode server, and the rows' ``methods`` (the gateway's /metrics) say so, not ``kv_handoff``."""
    out = run_quick("peer.py", "--endpoints", "gateway", "--workloads", "prompt-bound",
                    "--client-option", 'route="decode_only"')
    assert out["machine"]["client_options"] == ['route="decode_only"']
    assert out["rows"] and {r["endpoint"] for r in out["rows"]} == {"gateway"}
    for r in out["rows"]:
        assert r["failed"] == 0 and r["methods"] == {"decode_only": r["requests"]}


@pytest.mark.slow
def test_hetero():
    import llama_cpp

    out = run_quick("hetero.py")
    gpu = bool(llama_cpp.llama_supports_gpu_offload())
    assert out["quick"] is True and out["gpu_skipped"] is (not gpu)
    if not gpu:  # said plainly, and the run still happened on the CPU
        assert out["skip_reason"] and out["mode"] == "cpu_only_smoke"
    assert len(out["results"]) == 2
    for r in out["results"]:
        assert r["prompt_tokens_recomputed"] == 1 and 0 < r["completion_tokens"] <= out["max_new_tokens"]
        ends = r["end_to_end_s"]
        assert quotient(r["speedup_vs_cpu_only"], ends["cpu_only"], ends["handoff"], 4, 2)
        for pair, equal in r["text_equal"].items():
            other = r["texts"][pair.split("_vs_")[1]]
            assert equal == (r["texts"]["handoff"] == other)
            if equal:
                assert r["chars_in_common"][pair] == len(other)
    imported, exported = out["bundle_import"], out["exported_bundle"]
    assert imported["fingerprint_accepted"] and imported["prompt_tokens"] == exported["prompt_tokens"]
    assert 0 < imported["kv_bytes"] < exported["bytes"]  # the payload, inside the framed bundle


@pytest.mark.slow
def test_speculative():
    out = run_quick("speculative.py")
    rows = out["rows"]
    assert out["quick"] is True
    assert {(r["proposer"], r["prompts"], r["concurrency"]) for r in rows} == {
        (p, s, c) for p in ("off", "ngram") for s in ("code", "free") for c in (1, 8)}
    assert len(rows) == 8
    for r in rows:
        assert r["requests"] == (3 if r["concurrency"] == 1 else 8)  # --quick: three prompts a set
        # deterministic steps (the script's default): beside seven others, every answer is the one it got alone
        assert r.get("same_as_alone") == ([8, 8] if r["concurrency"] == 8 else None)
        assert quotient(r["decode_tok_s"], r["completion_tokens"], r["seconds"], 4, 2)
        if r["proposer"] == "off":
            assert r["greedy_equal"] is None and r["acceptance"] is None and r["draft_tokens"] == 0
        else:
            assert r["greedy_equal"] == (r["differ"] == 0)
            assert 0 <= r["accepted_tokens"] <= r["draft_tokens"]
            assert r["acceptance"] == (round(r["accepted_tokens"] / r["draft_tokens"], 4) if r["draft_tokens"]
                                       else None)
    by = {(r["proposer"], r["prompts"], r["concurrency"]): r for r in rows}
    for key, ratio in out["ratios"].items():
        prompts, c = key.split("_c")
        on, off = by[("ngram", prompts, int(c))], by[("off", prompts, int(c))]
        assert ratio == pytest.approx(on["decode_tok_s"] / off["decode_tok_s"], abs=2e-3)
    assert out["all_greedy_equal"] == all(r["greedy_equal"] for r in rows if r["proposer"] == "ngram")


@pytest.mark.parametrize("args, workload, prompts, at_once", [((), "decode-bound", 8, 8),
                                                         (("--workload", "prompt-bound", "--at-once", "1"),
                                                          "prompt-bound", 16, 1)])
def test_draft_steps(args, workload, prompts, at_once):
    out = run_quick("draft_steps.py", *args)
    assert out["quick"] is True and out["rounds"] == 1 and set(out["modes"]) == {"off", "ngram"}
    assert (out["workload"], out["prompts"], out["at_once"]) == (workload, prompts, at_once)
    for mode, m in out["modes"].items():
        assert len(m["tok_s"]) == 1 and m["median_tok_s"] == statistics.median(m["tok_s"])
        # every answer got exactly its max_tokens (end-of-generation ignored), each token from one step's row
        assert m["tokens"] == out["prompts"] * out["tokens"]
        assert m["ms_per_token"] == pytest.approx(m["step_s"] * 1000 / m["tokens"], abs=0.02)  # step_s: 3 decimals
        short = m["short_steps"]
        assert short["steps"] <= m["steps"] and short["seconds"] <= m["step_s"] and short["tokens"] <= m["tokens"]
        assert 1 <= m["graph_changes"]
        for row in m["layouts"]:
            assert mode != "off" and len(row["layout"]) <= out["slots"] and max(row["layout"]) > 1
            assert sum(row["ubatches"]) == sum(row["layout"])
            assert row["steps"] >= 1 and row["tokens_per_step"] >= len(row["layout"])  # a token per sequence at least
            assert row["predicted_tokens_per_step"] >= len(row["layout"])
    assert out["modes"]["off"]["layouts"] == []


def test_draft_steps_figures_from_the_steps_it_logged(monkeypatch):
    """The tiny model drafts nothing at four slots in --quick, so its layouts are checked here on logged steps made
    up for it: tokens emitted (each sampled row and the guesses kept), predictions, short steps and graph changes."""
    from types import SimpleNamespace

    from disaggregated_inference.backends.speculate import StepCost

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # draft_steps.py imports peer.py and quick.py
    from benchmarks import draft_steps

    cost = StepCost(per_ubatch=0.010, per_token=0.002, single=0.006)

    def step(counts, seconds, kept=(), drafts=None, answers_only=True, sampled=None):
        evs = [SimpleNamespace(kept_in_step=k) for k in (kept or [0] * len(counts))]
        return {"mode": "ngram", "seconds": seconds, "counts": counts, "n_ubatch": 512, "cost": cost,
                "drafts": [(ev, *d) for ev, d in zip(evs, drafts or [(0, None)] * len(counts))],
                "sampled": evs[:sampled] if sampled is not None else evs, "answers_only": answers_only}

    four = [(0, 2), (1, 2), (2, 2), (3, 2)]
    steps = [step(four, 0.040, kept=[1, 1, 0, 1], drafts=[(1, 0.5)] * 4),  # a guess each, three kept
             step(four, 0.040, drafts=[(1, 0.5)] * 4),                     # none kept
             step([(0, 1), (1, 1), (2, 1), (3, 1)], 0.024),               # plain
             step([(0, 1), (2, 1)], 0.020),                                # short, ids apart: two ubatches
             step([(0, 1), (1, 25)], 0.100, answers_only=False, sampled=1)]  # a prompt beside a token
    (row,) = draft_steps.layouts(steps)
    assert row == {"layout": [2, 2, 2, 2], "ubatches": [8], "steps": 2, "seconds": 0.08, "ms_per_step": 40.0,
                   "predicted_ms": 26.0, "tokens_per_step": 5.5, "predicted_tokens_per_step": 6.0,
                   "ms_per_token": round(80 / 11, 2)}
    assert draft_steps.summary(steps, slots=4) == {
        "steps": 5, "step_s": 0.224, "tokens": 7 + 4 + 4 + 2 + 1, "ms_per_token": round(224 / 18, 3),
        "short_steps": {"steps": 1, "seconds": 0.02, "tokens": 2},
        # shapes: 2x4, 2x4 (reused), 1x4, 1, 1 (reused), 1x2, 24
        "graph_changes": 5}


@pytest.mark.slow
def test_link():
    # on loopback: the emulated link needs root and network namespaces (tests/test_link_benchmark.py makes one)
    out = run_quick("link.py", "--loopback-only")
    assert out["rate_gbit"] is None and out["tokens"] == [512] and out["rounds"] == 1
    (model,) = out["models"]
    assert model["model"] == "wide" and len(model["rows"]) == 1
    for r in model["rows"]:
        assert r["link"] == "loopback" and r["prompt_tokens"] <= r["tokens"] and r["kv_bytes"] > 0
        # the streamed handoff happened, imported as it arrived, and answered as the whole one did
        assert r["greedy_equal"] is True and r["import"] == ["progressive"] and r["canary"] == ["passed"]
        assert 0 <= r["exposed_transfer_s"] and 0 < r["whole_transfer_s"]
        assert quotient(r["exposed_vs_whole_transfer"], r["exposed_transfer_s"], r["whole_transfer_s"], 6)
        assert quotient(r["after_prefill_vs_whole_transfer"], r["ttft_after_prefill_overlapped_s"],
                        r["whole_transfer_s"], 6)


@pytest.mark.slow
def test_soak(tmp_path):
    # a short soak on tiny models, one SIGSTOP, no namespaced link (tests/test_soak.py runs the link faults)
    png = tmp_path / "soak.png"
    out = run_quick("soak.py", "--duration", "16", "--faults", "stop_prefill", "--no-link", "--png", str(png))
    r, rows = out["requests"], out["outcomes"]
    assert out["quick"] is True and out["complete"] is True and r["accounted"]
    assert r["sent"] == len(rows) == r["answered"] + r["failed"] + r["lost"]
    for kind in ("answered", "failed", "lost"):
        assert r[kind] == sum(1 for o in rows if o["outcome"] == kind)
    for path, counts in out["by_path"].items():
        assert counts["sent"] == sum(1 for o in rows if o["path"] == path)
    inside, outside = out["error_rate"]["inside_fault_windows"], out["error_rate"]["outside_fault_windows"]
    assert inside["requests"] + outside["requests"] == r["sent"]
    assert inside["requests"] == sum(o["in_fault_window"] for o in rows)
    (fault,) = out["faults"]
    assert fault["kind"] == "stop_prefill" and fault["duration_s"] == pytest.approx(3.0, abs=0.5)
    assert out["failover_s"]["stop_prefill"]["max"] == max(v for v in fault["failover_s"].values() if v is not None)
    assert out["link"]["used"] is False and out["leases_held_at_end"] == 0
    assert out["png"] == str(png) and png.stat().st_size > 0
    assert {row["server"] for row in out["resources"]} >= {"gateway"} and len(out["growth_per_1000_requests"]) == 9


def test_every_benchmark_is_run_here():
    """A script added under benchmarks/ without a test above would break unnoticed."""
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")} - HELPERS
    tested = {name.removeprefix("test_") for name in globals() if name.startswith("test_")}
    assert scripts <= tested, f"benchmarks without a --quick test here: {sorted(scripts - tested)}"
    for script in sorted(scripts):  # and each takes --quick (benchmarks/quick.py)
        assert "quick.add_argument(" in (ROOT / "benchmarks" / f"{script}.py").read_text(), script
