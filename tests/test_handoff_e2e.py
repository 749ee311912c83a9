"""The KV handoff for real: SmolLM2 in gunicorn prefill and decode servers on free ports.

SmolLM2 has full attention, so its restored KV is bit-exact and the greedy text
through the handoff must equal, token for token, what the prefill side itself
generates from the same state.
"""
from __future__ import annotations

import functools
import io
import json
import os
import time

import pytest
import requests

from disaggregated_inference.kv import receive as handoff_module
from disaggregated_inference import tuning
from disaggregated_inference.backends import ModelSettings, Prompt, create
from disaggregated_inference.testing.bundles import read_bundle

from .conftest import THREADS

pytestmark = pytest.mark.slow

MAX_NEW = 24
FILLER = ("The quarterly sales report lists revenue by region, product line and month, "
          "with notes on returns, discounts and the marketing campaigns that ran. ")


def prompt_of(n_repeats: int) -> str:
    return FILLER * n_repeats + "\nSummarise the report above in one sentence."


@pytest.fixture(scope="module")
def reference():
    """The prefill side's own continuation, computed in this process with the same settings (once a prompt)."""
    import llama_cpp

    backend = create(ModelSettings(model="smollm2", n_threads=THREADS, n_ctx=4096))
    backend.load()

    @functools.cache
    def continue_in_process(prompt: str) -> tuple[list[int], str]:
        tokens, _ = backend.tokenize(Prompt(text=prompt))
        out = []
        with backend.sequence() as seq:
            logits = backend.logits(seq, tokens[:-1]) if len(tokens) > 1 else None  # the prefill's evaluation
            logits = backend.logits(seq, tokens[-1:], len(tokens) - 1)            # then its own continuation
            while True:
                token = int(logits.argmax())
                if llama_cpp.llama_vocab_is_eog(backend.model.vocab, token) or len(out) == MAX_NEW:
                    break
                out.append(token)
                logits = backend.logits(seq, [token], len(tokens) + len(out) - 1)
        return tokens, backend.model.detokenize(out).decode("utf-8", "replace")

    yield continue_in_process
    backend.close()


@pytest.mark.parametrize("repeats", [0, 10, 37, 73])
def test_greedy_text_through_the_handoff_equals_the_prefill_process_own_continuation(
        repeats, reference, http, qwen_prefill, qwen_decode):
    prompt = prompt_of(repeats)
    tokens, expected = reference(prompt)

    pre = http.post(f"{qwen_prefill}/prefill", json={"prompt": prompt}).json()
    assert pre["prompt_tokens"] == len(tokens)
    assert pre["handoff"] == "llama_seq_state"
    # the prefix cache (the prompts share their filler) evaluates only what its slot did not hold
    assert pre["metrics"]["prompt_tokens_evaluated"] + pre["metrics"]["prompt_tokens_cached"] == len(tokens) - 1
    assert pre["kv"]["bytes"] > 0 and pre["kv"]["url"].startswith(qwen_prefill)

    resp = http.post(f"{qwen_decode}/decode", json={"kv": pre["kv"], "max_new_tokens": MAX_NEW, "temperature": 0})
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["generated_text"] == expected
    m = out["metrics"]
    assert m["method"] == "kv_handoff" and m["handoff"] == "llama_seq_state"
    assert m["prompt_tokens_recomputed"] == 1, "the decode side must evaluate only the last prompt token"
    assert m["kv_bytes"] == pre["kv"]["bytes"]
    # SmolLM2: 30 layers x 3 KV heads x 64 dims x (K + V) x f16 = 23,040 bytes per cached token
    assert m["kv_bytes"] >= 23_040 * (len(tokens) - 1)
    assert m["completion_tokens"] <= MAX_NEW and m["ttft"] > 0

    # the monolithic path evaluates the prompt the same way (all but the last, then the last)
    mono = http.post(f"{qwen_decode}/generate", json={"prompt": prompt, "max_new_tokens": MAX_NEW}).json()
    assert mono["generated_text"] == expected
    assert mono["metrics"]["prompt_tokens_recomputed"] + mono["metrics"]["prompt_tokens_cached"] == len(tokens)
    assert mono["metrics"]["method"] == "decode_only"


def test_longest_prompt_is_about_two_thousand_tokens(reference):
    tokens, _ = reference(prompt_of(73))
    assert 1800 <= len(tokens) <= 2100


def test_streaming_returns_the_same_text_as_non_streaming(http, qwen_prefill, qwen_decode):
    prompt = prompt_of(3)
    body = {"max_new_tokens": MAX_NEW, "temperature": 0}
    whole = http.post(f"{qwen_decode}/decode", json={
        "kv": http.post(f"{qwen_prefill}/prefill", json={"prompt": prompt}).json()["kv"], **body}).json()
    kv = http.post(f"{qwen_prefill}/prefill", json={"prompt": prompt}).json()["kv"]
    resp = http.post(f"{qwen_decode}/decode", json={"kv": kv, "stream": True, **body}, stream=True)
    assert resp.headers["Content-Type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in resp.iter_lines() if line]
    assert lines[-1]["done"] is True and "metrics" in lines[-1]
    assert all(line["done"] is False for line in lines[:-1]) and len(lines) > 2
    assert "".join(line["text"] for line in lines[:-1]) == whole["generated_text"]
    assert lines[-1]["metrics"]["completion_tokens"] == whole["metrics"]["completion_tokens"]
    assert lines[-1]["metrics"]["prompt_tokens_recomputed"] == 1


def test_fetched_bundle_is_freed_and_cannot_be_fetched_twice(http, qwen_prefill, qwen_decode):
    kv = http.post(f"{qwen_prefill}/prefill", json={"prompt": prompt_of(2)}).json()["kv"]
    held = http.get(f"{qwen_prefill}/health").json()["leases"]
    assert held["held"] >= 1 and held["bytes"] >= kv["bytes"]
    assert http.post(f"{qwen_decode}/decode", json={"kv": kv, "max_new_tokens": 2}).status_code == 200
    again = http.get(kv["url"])
    assert again.status_code == 404 and "already fetched" in again.json()["error"]


def test_a_fetch_broken_off_keeps_the_lease_and_a_whole_one_frees_it(http, qwen_prefill):
    pre = http.post(f"{qwen_prefill}/prefill", json={"prompt": prompt_of(40)}).json()
    kv = pre["kv"]
    assert kv["bytes"] > 8 << 20
    # large KV is exported into an in-memory file and sent from it with sendfile on Linux
    assert kv["sent_as"] == ("sendfile" if hasattr(os, "memfd_create") else "frames")
    with requests.get(kv["url"], stream=True, timeout=30) as partial:  # its own connection, dropped after 1 MiB
        assert partial.status_code == 200
        assert len(next(partial.iter_content(1 << 20))) > 0
    whole = http.get(kv["url"])
    assert whole.status_code == 200 and len(whole.content) == int(whole.headers["Content-Length"])
    header, tokens, payload = read_bundle(io.BytesIO(whole.content))
    assert len(payload) == kv["bytes"] and header.payload_crc32c == kv["crc32c"]
    assert len(tokens) == pre["prompt_tokens"]
    assert http.get(kv["url"]).status_code == 404  # freed once fetched whole


def test_the_decode_server_keeps_its_receive_buffer_warm_for_the_next_handoff(http, qwen_prefill, qwen_decode):
    def handoff():
        kv = http.post(f"{qwen_prefill}/prefill", json={"prompt": prompt_of(40)}).json()["kv"]
        assert http.post(f"{qwen_decode}/decode", json={"kv": kv, "max_new_tokens": 1}).status_code == 200
        return http.get(f"{qwen_decode}/health").json()["receive_buffers"]

    first, second = handoff(), handoff()
    assert first["idle"] >= 1 and first["idle_bytes"] >= 8 << 20 and first["idle_seconds"] == 300
    assert second["reused_total"] == first["reused_total"] + 1  # no fresh mapping: no page faults to pay again
    assert second["fresh_total"] == first["fresh_total"]
    # the pull's socket asks for the configured 4 MiB only where this kernel allows that much
    assert second["socket_buffer_bytes"] == handoff_module.socket_buffer_in_effect(4 << 20)


def test_both_servers_run_with_large_copies_bypassing_the_cache(http, qwen_prefill, qwen_decode):
    # the cluster starts them with glibc's non-temporal threshold at the configured 256 KiB (launch.py)
    expected = 256 << 10 if tuning.glibc_on_x86() else None
    for url in (qwen_prefill, qwen_decode):
        assert http.get(f"{url}/health").json()["non_temporal_copy_bytes"] == expected


def _rss(http, url) -> int:
    return http.get(f"{url}/health").json()["resources"]["process_rss_bytes"]


def test_lease_expires_and_its_memory_is_freed(http, qwen_prefill, qwen_decode):
    before = http.get(f"{qwen_prefill}/health").json()["leases"]
    pre = http.post(f"{qwen_prefill}/prefill", json={"prompt": prompt_of(70), "lease_seconds": 1.5}).json()
    kv = pre["kv"]
    assert kv["bytes"] > 35_000_000  # large enough that its buffer is its own mapping
    rss_held = _rss(http, qwen_prefill)
    time.sleep(3.0)  # the sweeper runs every second
    after = http.get(f"{qwen_prefill}/health").json()
    assert after["leases"]["held"] == 0 and after["leases"]["bytes"] == 0
    assert after["leases"]["expired_total"] >= before["expired_total"] + 1
    assert rss_held - after["resources"]["process_rss_bytes"] >= 0.9 * kv["bytes"]
    late = http.post(f"{qwen_decode}/decode", json={"kv": kv, "max_new_tokens": 2})
    assert late.status_code == 410 and late.json()["code"] == "lease_expired"


def test_token_ids_only_make_the_decode_side_recompute_the_whole_prompt(http, qwen_prefill, qwen_decode):
    prompt = prompt_of(1)
    pre = http.post(f"{qwen_prefill}/prefill", json={"prompt": prompt}).json()
    with_kv = http.post(f"{qwen_decode}/decode", json={"kv": pre["kv"], "max_new_tokens": 8}).json()
    # the same ids without the KV: what Ollama's `context` amounts to
    ids_only = http.post(f"{qwen_decode}/decode", json={
        "tokens": _tokens_of(http, qwen_prefill, prompt), "fingerprint": pre["fingerprint"],
        "max_new_tokens": 8}).json()
    assert ids_only["metrics"]["method"] == "token_ids_recompute"
    assert ids_only["metrics"]["prompt_tokens_recomputed"] == pre["prompt_tokens"]
    assert ids_only["metrics"]["kv_bytes"] == 0
    assert ids_only["generated_text"] == with_kv["generated_text"]


def _tokens_of(http, prefill_url, prompt) -> list[int]:
    """The prompt's token ids, read from the bundle itself (the wire format carries them)."""
    kv = http.post(f"{prefill_url}/prefill", json={"prompt": prompt}).json()["kv"]
    _, tokens, _ = read_bundle(io.BytesIO(http.get(kv["url"]).content))
    return tokens
