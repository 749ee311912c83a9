"""A real KV handoff through real gunicorn servers, on the generated tiny llama (``tiny_cluster``).

Not marked slow: the quick tier (``pytest -m "not slow"``) keeps one end-to-end handoff, so a change that
breaks the prefill -> KV pull -> import -> decode path fails it within minutes. The tiny model's steps take
about a millisecond; the servers, the bundle, its checksum, fingerprint and canary are the real ones.
"""
from __future__ import annotations

from disaggregated_inference.client import DisaggregatedClient

PROMPT = "Revenue by region rose four percent in the north; returns fell. " * 8 + "Summarise in one line."


def test_a_real_kv_handoff_continues_as_the_decode_server_alone_would(http, tiny_prefill, tiny_decode):
    pre = http.post(f"{tiny_prefill}/prefill", json={"prompt": PROMPT}).json()
    assert pre["handoff"] == "llama_seq_state" and pre["kv"]["bytes"] > 0
    evaluated, cached = pre["metrics"]["prompt_tokens_evaluated"], pre["metrics"]["prompt_tokens_cached"]
    assert evaluated + cached == pre["prompt_tokens"] - 1

    out = http.post(f"{tiny_decode}/decode", json={"kv": pre["kv"], "max_new_tokens": 16, "temperature": 0})
    assert out.status_code == 200, out.text
    handed = out.json()
    m = handed["metrics"]
    assert m["method"] == "kv_handoff" and m["prompt_tokens_recomputed"] == 1
    assert m["kv_bytes"] == pre["kv"]["bytes"] and m["canary"] == "passed"
    assert m["completion_tokens"] > 0

    # the same prompt computed on the decode server alone: a full-attention model's handed-over KV is
    # bit-exact, so the greedy text is the same, token for token
    alone = http.post(f"{tiny_decode}/generate", json={"prompt": PROMPT, "max_new_tokens": 16, "temperature": 0})
    assert alone.status_code == 200, alone.text
    assert alone.json()["metrics"]["method"] == "decode_only"
    assert handed["generated_text"] == alone.json()["generated_text"]


def test_the_client_reports_the_handoff_it_made(tiny_cluster):
    with DisaggregatedClient(tiny_cluster.config, health_check=False) as client:
        text, m = client.generate(model="qwen3-coder:30b", prompt=PROMPT, max_tokens=8)
    assert m["method"] == "kv_handoff" and m["prompt_tokens_recomputed"] == 1 and m["kv_bytes"] > 0
    assert m["prefill_server"] == tiny_cluster.process("local-prefill-qwen").entry.address
    assert m["decode_server"] == tiny_cluster.process("local-decode-qwen").entry.address
    assert m["completion_tokens"] == 8 or m["finish_reason"] == "stop"
    assert isinstance(text, str)
