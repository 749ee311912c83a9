"""Issue 33: one request cannot stall the others, and every malformed body is a 4xx.

On the session's tiny cluster (real gunicorn servers) and its gateway:

- a huge prompt (20,000 messages; 48,000 ``<|im_end|>``) is refused with 400 ``context_overflow``
  naming its field, by a bound taken before anything is tokenized, and a short request sent beside it
  finishes within 2 s of its usual time (the chat template and the tokenizer run on the request's own
  thread, never on the thread that owns the model);
- a body nested 100,000 levels deep is a 400 naming ``body`` on the prefill server, the decode
  server and both of the gateway's APIs (it was a 500 ``RecursionError``).
"""
from __future__ import annotations

import json
import threading
import time

import pytest
import requests

pytestmark = pytest.mark.slow

SHORT = {"prompt": "Hi", "max_new_tokens": 2}
HUGE = {
    "messages": {"messages": [{"role": "user", "content": "a"}] * 20000, "max_new_tokens": 2},
    "prompt": {"prompt": "<|im_end|>" * 48000, "max_new_tokens": 2},
}


def _post(url: str, body: dict, out: dict) -> None:
    started = time.monotonic()
    resp = requests.post(url, json=body, timeout=300)
    out.update(status=resp.status_code, body=resp.json(), took=time.monotonic() - started)


@pytest.mark.parametrize("field", sorted(HUGE))
def test_a_short_request_beside_a_huge_one_takes_its_usual_time(tiny_decode, field):
    usual = []
    for _ in range(3):
        out: dict = {}
        _post(tiny_decode + "/generate", SHORT, out)
        assert out["status"] == 200, out
        usual.append(out["took"])
    huge, short = {}, {}
    sender = threading.Thread(target=_post, args=(tiny_decode + "/generate", HUGE[field], huge))
    sender.start()
    time.sleep(0.2)  # the huge body is on its way (or being rendered) when the short one arrives
    _post(tiny_decode + "/generate", SHORT, short)
    sender.join(300)
    assert short["status"] == 200, short
    assert short["took"] < max(usual) + 2.0, f"short request took {short['took']:.2f} s (usually {max(usual):.2f})"
    assert huge["status"] == 400 and huge["body"]["code"] == "context_overflow", huge
    assert huge["body"]["field"] == field, huge["body"]
    assert huge["took"] < 10, f"the huge request was refused after {huge['took']:.1f} s"


def test_a_huge_prompt_is_refused_by_the_prefill_server_too(tiny_prefill):
    started = time.monotonic()
    resp = requests.post(tiny_prefill + "/prefill", json={"messages": HUGE["messages"]["messages"]}, timeout=300)
    assert resp.status_code == 400 and resp.json()["code"] == "context_overflow", resp.text[:300]
    assert resp.json()["field"] == "messages"
    assert time.monotonic() - started < 10


DEEP = b"[" * 100_000 + b"]" * 100_000
DEEP_INSIDE = (b'{"model": "qwen", "messages": [{"role": "user", "content": ' + b"[" * 100_000 + b"]" * 100_000
               + b"}]}")


def test_deeply_nested_json_is_a_400_naming_the_body_everywhere(tiny_prefill, tiny_decode, tiny_gateway):
    servers = [tiny_prefill + "/prefill", tiny_decode + "/decode", tiny_decode + "/generate"]
    gateway = [tiny_gateway + path for path in ("/v1/chat/completions", "/v1/completions", "/api/chat",
                                                "/api/generate")]
    for url in servers + gateway:
        for body in (DEEP, DEEP_INSIDE):
            resp = requests.post(url, data=body, headers={"Content-Type": "application/json"}, timeout=60)
            assert resp.status_code == 400, (url, resp.status_code, resp.text[:300])
            error = resp.json()
            if "/v1/" in url:
                assert error["error"]["param"] == "body" and error["error"]["type"] == "invalid_request_error"
            elif "/api/" in url:
                assert error["field"] == "body", error
            else:
                assert error["field"] == "body" and error["code"] == "bad_request", error
            assert "nested" in json.dumps(error), error
    # and every server still serves
    assert requests.post(tiny_decode + "/generate", json=SHORT, timeout=60).status_code == 200
