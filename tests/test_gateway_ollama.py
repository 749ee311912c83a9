"""The official ``ollama`` client (and plain HTTP, for Ollama's shapes) against a real gateway over a real tiny_cluster.

The cluster serves generated tiny llamas (``tiny_cluster``): the API's shapes are checked, not the answers."""
from __future__ import annotations

import json

import ollama
import pytest
import requests

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"fruit": {"type": "string", "enum": ["apple", "pear", "plum"]}},
          "required": ["fruit"], "additionalProperties": False}
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture(scope="module")
def client(tiny_gateway):
    return ollama.Client(host=tiny_gateway, timeout=120)


def test_generate_has_ollamas_final_fields(client):
    resp = client.generate(model="qwen3-coder:30b", prompt="Say hello.", options=GREEDY)
    assert resp.done is True and resp.response
    assert resp.done_reason in ("stop", "length")
    assert resp.prompt_eval_count > 0 and resp.eval_count > 0
    # nanoseconds: a generation of a dozen tokens takes well over a microsecond and under a minute
    assert 1_000 < resp.eval_duration < 60 * 10**9
    assert resp.total_duration >= resp.eval_duration + resp.prompt_eval_duration


def test_chat(client):
    resp = client.chat(model="gpt-oss", messages=[{"role": "user", "content": "Name a fruit."}], options=GREEDY)
    assert resp.message.role == "assistant" and resp.message.content
    assert resp.done and resp.eval_count > 0


def test_streamed_generate_joins_to_the_whole_answer(client):
    whole = client.generate(model="qwen", prompt="Count from one to five.", options=GREEDY)
    parts = list(client.generate(model="qwen", prompt="Count from one to five.", options=GREEDY, stream=True))
    assert len(parts) > 2 and all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.response for p in parts) == whole.response
    assert parts[-1].eval_count == whole.eval_count


def test_streamed_chat(client):
    parts = list(client.chat(model="qwen", messages=[{"role": "user", "content": "Say hi."}], options=GREEDY,
                             stream=True))
    assert parts[-1].done and parts[-1].done_reason in ("stop", "length")
    assert "".join(p.message.content for p in parts)


def test_streaming_is_the_default_over_http(tiny_gateway):
    with requests.post(tiny_gateway + "/api/generate", json={"model": "qwen", "prompt": "Hi", "options": GREEDY},
                       stream=True, timeout=120) as resp:
        assert resp.headers["Content-Type"].startswith("application/x-ndjson")
        assert resp.headers["X-Disagg-Method"] == "kv_handoff"
        lines = [json.loads(line) for line in resp.iter_lines() if line]
    assert len(lines) > 1 and lines[-1]["done"] is True and "eval_duration" in lines[-1]
    assert lines[-1]["disagg"]["method"] == "kv_handoff" and lines[-1]["disagg"]["kv_bytes"] > 0


def test_list_ps_show_version(client, tiny_gateway):
    names = {m.model for m in client.list().models}
    assert {"qwen", "qwen3-coder:30b", "gpt-oss"} <= names
    assert {m.model for m in client.ps().models} >= {"qwen", "gpt-oss"}
    shown = client.show("qwen3-coder")
    assert shown.modelinfo["disagg.model"] == "qwen"
    assert requests.get(tiny_gateway + "/api/version", timeout=10).json()["version"]


def test_format_with_a_schema(client):
    resp = client.generate(model="qwen", prompt="Pick a fruit; answer in JSON.", format=SCHEMA,
                           options={"temperature": 0, "num_predict": 40})
    assert json.loads(resp.response)["fruit"] in ("apple", "pear", "plum")


def test_unknown_model_is_ollamas_404(client):
    with pytest.raises(ollama.ResponseError) as info:
        client.generate(model="llama9:1t", prompt="hi")
    assert info.value.status_code == 404 and info.value.error == "model 'llama9:1t' not found"


@pytest.mark.parametrize("body, field", [({"context": [1, 2, 3]}, "context"), ({"images": ["aGk="]}, "images"),
                                         ({"options": {"mirostat": 2}}, "options.mirostat")])
def test_what_cannot_be_honoured_is_a_400(tiny_gateway, body, field):
    resp = requests.post(tiny_gateway + "/api/generate", json={"model": "qwen", "prompt": "hi", **body}, timeout=30)
    assert resp.status_code == 400
    assert field.split(".")[-1] in resp.json()["error"]
