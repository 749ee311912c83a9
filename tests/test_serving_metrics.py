"""disaggregated_inference/bench/measure.py: vLLM's serving-metric definitions on hand-made timestamps."""
from __future__ import annotations

import argparse

import pytest

from disaggregated_inference.bench import measure as sm


def timing(started, pieces, ended, output_tokens, prompt_tokens=10):
    return sm.RequestTiming(started=started, pieces=list(pieces), ended=ended, output_tokens=output_tokens,
                            prompt_tokens=prompt_tokens)


# Sent at 0 s: pieces at 0.5, 0.6, 0.8 and 1.1 s, last line at 1.2 s, 5 output tokens (one piece held two).
A = timing(0.0, [0.5, 0.6, 0.8, 1.1], 1.2, 5)
# Sent at 1 s: one piece at 3 s, last line at 3.5 s, one output token.
B = timing(1.0, [3.0], 3.5, 1)


def test_one_request_follows_vllm_definitions():
    assert A.ttft == pytest.approx(0.5)
    assert A.e2el == pytest.approx(1.2)
    assert A.itl == pytest.approx([0.1, 0.2, 0.3])  # gaps between streamed pieces, not per token
    assert A.tpot == pytest.approx((1.2 - 0.5) / (5 - 1))  # (E2EL - TTFT) / (output tokens - 1)
    assert B.tpot is None and B.itl == []


def test_summary_statistics_and_throughputs():
    s = sm.summarize([A, B], duration_s=4.0)
    assert (s["completed"], s["failed"], s["total_output_tokens"], s["total_input_tokens"]) == (2, 0, 6, 20)
    assert s["request_throughput"] == pytest.approx(0.5)
    assert s["output_throughput"] == pytest.approx(1.5)
    assert s["total_token_throughput"] == pytest.approx(26 / 4)
    assert s["mean_ttft_ms"] == pytest.approx(1250.0) and s["median_ttft_ms"] == pytest.approx(1250.0)
    assert s["p99_ttft_ms"] == pytest.approx(500 + 0.99 * 1500)  # numpy's linear percentile
    assert s["std_ttft_ms"] == pytest.approx(750.0)  # population std, as np.std
    assert s["mean_e2el_ms"] == pytest.approx((1200 + 2500) / 2)
    assert s["mean_tpot_ms"] == pytest.approx(175.0)  # B has no TPOT: one output token
    assert s["mean_itl_ms"] == pytest.approx(200.0) and s["median_itl_ms"] == pytest.approx(200.0)
    assert s["p99_itl_ms"] == pytest.approx(100 + 0.99 * 200)
    assert s["request_goodput"] is None and s["good_requests"] is None  # no SLO given


def test_goodput_counts_requests_meeting_every_slo():
    # A: TTFT 500 ms, TPOT 175 ms, E2EL 1200 ms; B: TTFT 2000 ms, TPOT 0 (one token), E2EL 2500 ms
    def goodput(**slos):
        return sm.summarize([A, B], duration_s=4.0, slos=slos)["request_goodput"]

    assert goodput(ttft=2000) == pytest.approx(2 / 4)  # <= holds at the limit
    assert goodput(ttft=1999) == pytest.approx(1 / 4)
    assert goodput(tpot=100) == pytest.approx(1 / 4)  # A misses; B's one token counts as TPOT 0
    assert goodput(ttft=2000, tpot=100) == pytest.approx(1 / 4)
    assert goodput(ttft=400, e2el=5000) == pytest.approx(0.0)
    assert goodput(e2el=1200) == pytest.approx(1 / 4)


def test_failed_requests_are_counted_not_measured():
    failed = sm.RequestTiming(started=0.0, error="UpstreamError: gone")
    s = sm.summarize([A, failed], duration_s=2.0, slos={"ttft": 1000})
    assert (s["completed"], s["failed"], s["good_requests"]) == (1, 1, 1)
    assert s["mean_ttft_ms"] == pytest.approx(500.0)
    empty = sm.summarize([failed], duration_s=1.0)
    assert empty["mean_ttft_ms"] is None and empty["p99_itl_ms"] is None


def test_time_stream_reads_a_client_stream():
    def stream():
        yield "Hel"
        yield "lo"
        yield {"completion_tokens": 3, "prompt_tokens": 7, "method": "kv_handoff"}

    t = sm.time_stream(stream(), started=0.0)
    assert t.ok and len(t.pieces) == 2 and t.output_tokens == 3 and t.prompt_tokens == 7
    assert t.pieces[0] <= t.pieces[1] <= t.ended and t.metrics["method"] == "kv_handoff"

    def broken():
        yield "a"
        raise RuntimeError("mid-stream")

    bad = sm.time_stream(broken(), started=0.0)
    assert not bad.ok and "mid-stream" in bad.error
    assert not sm.time_stream(iter(["a"]), started=0.0).ok  # no final line


def test_slo_arguments():
    assert sm.parse_slo("ttft:2000") == ("ttft", 2000.0)
    assert sm.parse_slo("TPOT=100") == ("tpot", 100.0)
    for bad in ("ttft", "itl:5", "e2el:-1", "ttft:fast"):
        with pytest.raises(argparse.ArgumentTypeError):
            sm.parse_slo(bad)
    parser = argparse.ArgumentParser()
    sm.add_slo_argument(parser)
    assert dict(parser.parse_args(["--slo", "ttft:2000", "--slo", "tpot=100"]).slo) == {"ttft": 2000.0, "tpot": 100.0}
