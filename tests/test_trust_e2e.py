"""Trust boundaries on real gunicorn servers: untrusted KV URLs, bounded inputs, slow clients that must not
starve /health, and a declared-size mismatch that must not use a lease up.

The generated tiny llamas serve (``tiny_cluster``): these are checks of the servers' own limits. The declared
size test needs tens of MB of KV (more than the sockets' buffers hold): the packaged SmolLM2 cluster."""
from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import pytest
import requests

pytestmark = pytest.mark.slow


def error_of(resp, status: int, field: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["Content-Type"].startswith("application/json"), resp.headers
    body = resp.json()
    if field is not None:
        assert body.get("field") == field, body
    return body


def test_an_untrusted_kv_url_is_refused_without_a_connection(http, tiny_decode):
    with socket.create_server(("127.0.0.1", 0)) as trap:  # a port nobody configured
        trap.settimeout(0.5)
        url = f"http://127.0.0.1:{trap.getsockname()[1]}/kv/abc"
        body = error_of(http.post(f"{tiny_decode}/decode", json={"kv": {"url": url, "handle": "abc"}}), 403, "kv.url")
        assert body["code"] == "forbidden"
        with pytest.raises(socket.timeout):
            trap.accept()  # the decode server never tried
    # nor a well-known internal address
    error_of(http.post(f"{tiny_decode}/decode",
                       json={"kv": {"url": "http://169.254.169.254/kv/x", "handle": "x"}}), 403, "kv.url")


def test_kv_handle_must_be_the_urls(http, tiny_prefill, tiny_decode):
    kv = http.post(f"{tiny_prefill}/prefill", json={"prompt": "Say OK."}).json()["kv"]
    error_of(http.post(f"{tiny_decode}/decode", json={"kv": {**kv, "handle": "another"}}), 400, "kv.handle")
    assert http.post(f"{tiny_decode}/decode", json={"kv": kv, "max_new_tokens": 2}).status_code == 200


@pytest.mark.parametrize("field,value", [("bytes", 1), ("crc32c", 12345)])
def test_a_wrong_declared_size_or_checksum_leaves_the_lease(http, qwen_prefill, qwen_decode, field, value):
    # a long prompt (~1,100 tokens): over 16 MB of KV, more than the sockets' buffers hold, so the abort happens
    # mid-transfer
    prompt = " ".join(f"word{i}" for i in range(300))
    pre = http.post(f"{qwen_prefill}/prefill", json={"prompt": prompt}).json()
    kv = pre["kv"]
    assert kv["bytes"] > 16 << 20, pre["prompt_tokens"]
    wrong = {**kv, field: kv[field] + value}
    error_of(http.post(f"{qwen_decode}/decode", json={"kv": wrong, "max_new_tokens": 1}), 422, f"kv.{field}")
    out = http.post(f"{qwen_decode}/decode", json={"kv": kv, "max_new_tokens": 1})
    assert out.status_code == 200, out.text  # the lease was not used up by the refused pull


def test_an_oversized_body_is_413_at_once(http, tiny_prefill):
    started = time.monotonic()
    body = b'{"prompt": "' + b"a" * (9 << 20) + b'"}'
    resp = http.post(f"{tiny_prefill}/prefill", data=body, headers={"Content-Type": "application/json"})
    error_of(resp, 413, "body")
    assert time.monotonic() - started < 20  # refused on its length, never tokenized


def test_a_prompt_over_the_character_limit_is_413_naming_it(http, tiny_decode):
    big = "a" * ((1 << 20) + 1)  # under the body limit, over max_prompt_chars
    error_of(http.post(f"{tiny_decode}/generate", json={"prompt": big}), 413, "prompt")
    error_of(http.post(f"{tiny_decode}/generate", json={"messages": [{"role": "user", "content": big}]}),
             413, "messages")


def test_non_json_content_type_is_415(http, tiny_prefill):
    resp = http.post(f"{tiny_prefill}/prefill", data=b'{"prompt": "hi"}', headers={"Content-Type": "text/plain"})
    error_of(resp, 415, "Content-Type")


@pytest.mark.parametrize("body,field", [
    ('{"prompt": "a\\ud800b"}', "prompt"),
    ('{"prompt": "hi", "system": "\\udfff"}', "system"),
    ('{"messages": [{"role": "user", "content": "x\\ud800"}]}', "messages[0].content"),
])
def test_lone_surrogates_are_400_naming_the_field(http, tiny_urls, body, field):
    for url in (tiny_urls["local-prefill-qwen"] + "/prefill", tiny_urls["local-decode-qwen"] + "/generate"):
        error_of(http.post(url, data=body.encode(), headers={"Content-Type": "application/json"}), 400, field)


def test_json_schema_size_and_depth_are_bounded(http, tiny_decode):
    deep: dict = {"type": "string"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    error_of(http.post(f"{tiny_decode}/generate", json={"prompt": "x", "json_schema": deep}), 400, "json_schema")
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}
    error_of(http.post(f"{tiny_decode}/generate", json={"prompt": "x", "json_schema": wide}), 413, "json_schema")


def test_lease_seconds_beyond_the_configured_maximum(http, tiny_prefill):
    error_of(http.post(f"{tiny_prefill}/prefill", json={"prompt": "x", "lease_seconds": 601}), 400, "lease_seconds")


def _half_body(url: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=5)
    sock.sendall(b"POST /prefill HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n" + b'{"prompt": "' + b"a" * 400)
    return sock


def test_stalled_clients_do_not_starve_health(tiny_prefill):
    from disaggregated_inference.config import SERVER_DEFAULTS

    threads = SERVER_DEFAULTS["threads"]
    stalled = [_half_body(tiny_prefill) for _ in range(threads)]  # as many as the server has request threads
    try:
        time.sleep(1.0)
        health = requests.get(f"{tiny_prefill}/health", timeout=5)
        assert health.status_code == 200 and health.json()["loaded"] is True
        # the stalled bodies cost a bounded time, and no request thread: each waits for its body in the
        # worker's poller (server/worker.py) and is answered 408 naming the body
        answers = []
        for sock in stalled:
            sock.settimeout(30)
            answers.append(sock.recv(4096))
        assert all(a.startswith(b"HTTP/1.1 408") and b'"field": "body"' in a for a in answers), answers
    finally:
        for sock in stalled:
            sock.close()
    assert requests.post(f"{tiny_prefill}/prefill", json={"prompt": "Say OK."}, timeout=60).status_code == 200
