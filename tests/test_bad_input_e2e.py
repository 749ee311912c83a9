"""Bad input to real servers: a 4xx JSON error that names the problem, and the server keeps serving.

The servers run the generated tiny llamas (``tiny_cluster``): every check here is of the servers' parsing,
checksums, fingerprints and llama.cpp's own state reader, none of what a model answers. Only the bundle of
8 MiB or more (whose checksum runs alongside the import) needs a real model's KV size: the packaged cluster."""
from __future__ import annotations

import io

import pytest

from disaggregated_inference.kv import bundle
from disaggregated_inference.testing.bundles import read_bundle, to_bytes

pytestmark = pytest.mark.slow


@pytest.fixture()
def still_serves(http, tiny_prefill, tiny_decode):
    """After the test: both servers are healthy and a real handoff still works."""
    yield
    assert http.get(f"{tiny_prefill}/health").json()["loaded"] is True
    kv = http.post(f"{tiny_prefill}/prefill", json={"prompt": "Say OK."}).json()["kv"]
    out = http.post(f"{tiny_decode}/decode", json={"kv": kv, "max_new_tokens": 3})
    assert out.status_code == 200 and out.json()["metrics"]["method"] == "kv_handoff"


@pytest.fixture()
def still_serves_real(http, qwen_prefill, qwen_decode):
    """``still_serves`` for the packaged model's servers."""
    yield
    kv = http.post(f"{qwen_prefill}/prefill", json={"prompt": "Say OK."}).json()["kv"]
    out = http.post(f"{qwen_decode}/decode", json={"kv": kv, "max_new_tokens": 3})
    assert out.status_code == 200 and out.json()["metrics"]["method"] == "kv_handoff"


def real_bundle(http, prefill_url, prompt="Name three colours.") -> tuple[dict, bytes]:
    pre = http.post(f"{prefill_url}/prefill", json={"prompt": prompt}).json()
    return pre, http.get(pre["kv"]["url"]).content


def assert_error(resp, status: int, code: str, field: str | None = None, says: str | None = None):
    assert resp.status_code == status, resp.text
    assert resp.headers["Content-Type"].startswith("application/json")
    body = resp.json()
    assert body["code"] == code, body
    if field:
        assert body.get("field") == field, body
    if says:
        assert says in body["error"], body
    return body


@pytest.mark.parametrize("path", ["/prefill", "/decode", "/generate"])
def test_malformed_json(http, tiny_urls, path, still_serves):
    url = tiny_urls["local-prefill-qwen" if path == "/prefill" else "local-decode-qwen"]
    resp = http.post(url + path, data=b'{"prompt": "unterminated', headers={"Content-Type": "application/json"})
    assert_error(resp, 400, "bad_request", "body", "malformed JSON")
    assert_error(http.post(url + path, data=b""), 400, "bad_request", "body", "empty")


def test_missing_prompt_and_wrong_types(http, tiny_prefill, tiny_decode, still_serves):
    assert_error(http.post(f"{tiny_prefill}/prefill", json={"promt": "typo"}), 400, "bad_request", "promt")
    assert_error(http.post(f"{tiny_prefill}/prefill", json={}), 400, "bad_request", "prompt")
    assert_error(http.post(f"{tiny_decode}/generate", json={"prompt": "x", "max_new_tokens": "ten"}),
                 400, "bad_request", "max_new_tokens")


def test_unknown_model_and_unknown_route(http, tiny_prefill, tiny_decode, still_serves):
    body = assert_error(http.post(f"{tiny_prefill}/prefill", json={"prompt": "x", "model": "llama3:70b"}),
                        404, "model_not_found", "model")
    assert "llama3:70b" in body["error"]
    # the server's own aliases are accepted
    assert http.post(f"{tiny_prefill}/prefill", json={"prompt": "x", "model": "qwen3-coder:30b"}).status_code == 200
    assert http.get(f"{tiny_decode}/nope").status_code == 404
    assert http.get(f"{tiny_decode}/nope").json()["code"] == "not_found"


def test_unknown_handle(http, tiny_prefill, tiny_decode, still_serves):
    kv = {"url": f"{tiny_prefill}/kv/not-a-handle", "handle": "not-a-handle"}
    body = assert_error(http.post(f"{tiny_decode}/decode", json={"kv": kv}), 404, "not_found", "kv.handle")
    assert "not-a-handle" in body["error"]


def test_truncated_kv_bytes(http, tiny_prefill, tiny_decode, bytes_server, still_serves):
    pre, raw = real_bundle(http, tiny_prefill)
    url = bytes_server("/kv/truncated", raw[: len(raw) // 2])
    kv = {**pre["kv"], "url": url, "handle": "truncated"}
    body = assert_error(http.post(f"{tiny_decode}/decode", json={"kv": kv}), 422, "bad_bundle", "kv")
    assert "truncated" in body["error"]


def test_corrupted_kv_bytes(http, tiny_prefill, tiny_decode, bytes_server, still_serves):
    pre, raw = real_bundle(http, tiny_prefill)
    damaged = bytearray(raw)
    damaged[len(damaged) // 2] ^= 0x5A
    url = bytes_server("/kv/corrupted", bytes(damaged))
    body = assert_error(http.post(f"{tiny_decode}/decode", json={"kv": {"url": url, "handle": "corrupted"}}),
                        422, "bad_bundle", "kv")
    assert "checksum mismatch" in body["error"]


@pytest.mark.parametrize("stream", [False, True])
def test_corrupted_large_kv_is_refused_after_its_import_and_no_text_leaves(
        http, qwen_prefill, qwen_decode, bytes_server, stream, still_serves_real):
    """From 8 MiB up the checksum finishes alongside the import: a flipped byte is still a 422, streaming or not."""
    pre, raw = real_bundle(http, qwen_prefill, "The sales table lists revenue by region and month. " * 60)
    assert pre["kv"]["bytes"] >= bundle._RunningChecksum.THREADED_FROM
    damaged = bytearray(raw)
    damaged[len(damaged) // 2] ^= 0x5A  # inside a layer's K/V values: llama.cpp's reader takes them
    url = bytes_server(f"/kv/corrupted-large-{stream}", bytes(damaged))
    resp = http.post(f"{qwen_decode}/decode", json={"kv": {"url": url, "handle": f"corrupted-large-{stream}"},
                                                          "stream": stream})
    assert_error(resp, 422, "bad_bundle", "kv", "checksum mismatch")


def test_a_stream_that_fails_before_its_first_token_gets_a_status_code(http, tiny_decode, still_serves):
    resp = http.post(f"{tiny_decode}/generate", json={"prompt": "word " * 5000, "stream": True})
    assert_error(resp, 400, "context_overflow", "prompt", "context holds 4096")


def test_not_a_bundle_at_all(http, tiny_decode, bytes_server, still_serves):
    url = bytes_server("/kv/html", b"<html>hello</html>" * 10)
    assert_error(http.post(f"{tiny_decode}/decode", json={"kv": {"url": url, "handle": "html"}}),
                 422, "bad_bundle", "kv", "bad magic")


def test_kv_produced_by_the_other_model_is_refused_naming_the_difference(http, tiny_urls, tiny_decode,
                                                                        still_serves):
    pre = http.post(f"{tiny_urls['local-prefill-gpt-oss']}/prefill", json={"prompt": "Name three colours."}).json()
    body = assert_error(http.post(f"{tiny_decode}/decode", json={"kv": pre["kv"]}), 409,
                        "fingerprint_mismatch", "fingerprint")
    assert "model_sha256" in body["error"] and "n_layer" in body["error"]


def test_forged_fingerprint_with_a_foreign_layout_is_refused_by_llama_cpp(
        http, tiny_urls, tiny_prefill, tiny_decode, bytes_server, still_serves):
    """A bundle that claims the right model but holds another model's KV: llama.cpp's reader refuses it."""
    qwen_fp = http.post(f"{tiny_prefill}/prefill", json={"prompt": "x"}).json()["fingerprint"]
    _, raw = real_bundle(http, tiny_urls["local-prefill-gpt-oss"])
    header, tokens, payload = read_bundle(io.BytesIO(raw))
    header.fingerprint = qwen_fp
    url = bytes_server("/kv/forged", to_bytes(header, tokens, payload))
    assert_error(http.post(f"{tiny_decode}/decode", json={"kv": {"url": url, "handle": "forged"}}),
                 422, "bad_bundle", "kv", "llama.cpp refused")


def test_prompt_longer_than_the_context(http, tiny_prefill, still_serves):
    resp = http.post(f"{tiny_prefill}/prefill", json={"prompt": "word " * 5000})
    assert_error(resp, 400, "context_overflow", "prompt", "context holds 4096")


def test_json_errors_for_wrong_methods(http, tiny_prefill):
    resp = http.get(f"{tiny_prefill}/prefill")
    assert resp.status_code == 405 and resp.json()["code"] == "method_not_allowed"
