"""Speculative decoding through real servers: the session's tiny cluster (``tiny_cluster``: real gunicorn
processes, real llama.cpp KV handoffs on the generated tiny llama), each request naming its proposer.

The tiny model's greedy answers fall into loops, which prompt lookup predicts: the drafts here are
real prompt-lookup drafts, accepted and rejected, verified in the servers' batched token loop. What
each path of the loop does on purpose (an end-of-generation token or a stop string inside an accepted
run, cancellation mid-verification) is tested in process with an oracle proposer: test_speculate.py.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import requests

from disaggregated_inference.client import DisaggregatedClient

from .test_server_app import metric_value

PROMPT = "one two three four five six seven eight nine ten " * 6
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                     "maxItems": 12}}, "required": ["items"]}
GREEDY = {"max_new_tokens": 160, "temperature": 0, "ignore_eos": True}


def answer(url: str, path: str, body: dict, speculation: str) -> dict:
    r = requests.post(f"{url}/{path}", json={**body, "speculation": speculation}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_decode_only_answers_equal_with_and_without_speculation_and_count_their_drafts(tiny_decode):
    before = requests.get(f"{tiny_decode}/metrics", timeout=30).text
    off = answer(tiny_decode, "generate", {"prompt": PROMPT, **GREEDY}, "off")
    on = answer(tiny_decode, "generate", {"prompt": PROMPT, **GREEDY}, "ngram")
    assert on["generated_text"] == off["generated_text"]
    m = on["metrics"]
    assert m["speculation"] == "ngram" and m["completion_tokens"] == off["metrics"]["completion_tokens"]
    assert 0 < m["accepted_tokens"] <= m["draft_tokens"]
    assert "draft_tokens" not in off["metrics"]
    after = requests.get(f"{tiny_decode}/metrics", timeout=30).text
    for name, key in (("disagg_draft_tokens_total", "draft_tokens"), ("disagg_accepted_tokens_total", "accepted_tokens")):
        assert metric_value(after, name) - metric_value(before, name) >= m[key]


def test_a_handoff_decodes_the_same_with_speculation(http, tiny_prefill, tiny_decode):
    pre = http.post(f"{tiny_prefill}/prefill", json={"prompt": PROMPT}).json()
    off = answer(tiny_decode, "decode", {"kv": pre["kv"], **GREEDY}, "off")
    pre = http.post(f"{tiny_prefill}/prefill", json={"prompt": PROMPT}).json()
    on = answer(tiny_decode, "decode", {"kv": pre["kv"], **GREEDY}, "ngram")
    assert on["metrics"]["method"] == off["metrics"]["method"] == "kv_handoff"
    assert on["metrics"]["canary"] == "passed"
    assert on["generated_text"] == off["generated_text"] and on["metrics"]["accepted_tokens"] > 0


def test_schema_constrained_answers_equal_with_and_without_speculation(http, tiny_prefill, tiny_decode):
    body = {"prompt": PROMPT, "max_new_tokens": 200, "temperature": 0, "json_schema": SCHEMA}
    off = answer(tiny_decode, "generate", body, "off")
    on = answer(tiny_decode, "generate", body, "ngram")
    assert on["generated_text"] == off["generated_text"]
    json.loads(on["generated_text"])  # the grammar held
    pre = http.post(f"{tiny_prefill}/prefill", json={"prompt": PROMPT}).json()
    handed = answer(tiny_decode, "decode", {"kv": pre["kv"], **{k: v for k, v in body.items() if k != "prompt"}},
                    "ngram")
    assert handed["generated_text"] == off["generated_text"] and "draft_tokens" in handed["metrics"]


def test_streams_beside_each_other_give_each_its_own_answer(tiny_decode):
    prompts = [PROMPT, "alpha beta gamma delta " * 10, "red green blue " * 12, "north south east west " * 9]
    alone = [answer(tiny_decode, "generate", {"prompt": p, **GREEDY}, "off")["generated_text"] for p in prompts]

    def streamed(p: str) -> tuple[str, dict]:
        with requests.post(f"{tiny_decode}/generate", json={"prompt": p, **GREEDY, "speculation": "ngram",
                                                            "stream": True}, stream=True, timeout=300) as r:
            assert r.status_code == 200, r.text
            lines = [json.loads(line) for line in r.iter_lines() if line]
        return "".join(x.get("text", "") for x in lines if not x["done"]), lines[-1]["metrics"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(streamed, prompts))
    assert [t for t, _ in together] == alone
    assert all(m["completion_tokens"] == GREEDY["max_new_tokens"] and m["speculation"] == "ngram" for _, m in together)
    # whether a draft pays beside three other sequences is the server's call (its measured step cost); a
    # verify step shared by several sequences is made on purpose in test_speculate.py


def test_the_client_carries_the_decode_server_s_figures(tiny_cluster):
    with DisaggregatedClient(tiny_cluster.config, health_check=False) as client:
        text, m = client.generate(model="qwen3-coder:30b", prompt=PROMPT, max_tokens=120, speculation="ngram")
        plain, n = client.generate(model="qwen3-coder:30b", prompt=PROMPT, max_tokens=120, speculation="off")
    assert m["method"] == "kv_handoff" and text == plain
    assert m["speculation"] == "ngram" and m["draft_tokens"] >= m["accepted_tokens"] >= 0
    assert "draft_tokens" not in n
    assert client.history[-2]["draft_tokens"] == m["draft_tokens"]


def test_an_unknown_proposer_is_refused_by_name(tiny_decode):
    r = requests.post(f"{tiny_decode}/generate", json={"prompt": "hi", "speculation": "eagle"}, timeout=30)
    assert r.status_code == 400 and r.json()["field"] == "speculation"
    r = requests.post(f"{tiny_decode}/generate", json={"prompt": "hi", "speculation": 3}, timeout=30)
    assert r.status_code == 400 and r.json()["field"] == "speculation"
    assert requests.get(f"{tiny_decode}/health", timeout=30).status_code == 200
