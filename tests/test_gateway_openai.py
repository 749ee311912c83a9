"""The official ``openai`` client against a real gateway over a real local tiny_cluster.

The cluster serves generated tiny llamas (``tiny_cluster``): what is checked is the API's shapes, streams,
headers, usage and errors, and that each answer went through a real KV handoff, not what a model says."""
from __future__ import annotations

import json

import openai
import pytest
import requests

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
          "required": ["colour"], "additionalProperties": False}


@pytest.fixture(scope="module")
def oai(tiny_gateway):
    return openai.OpenAI(base_url=tiny_gateway + "/v1", api_key="not-needed", max_retries=0, timeout=120)


def test_model_list_has_every_name_and_alias(oai):
    ids = {m.id for m in oai.models.list()}
    assert {"qwen", "qwen3-coder:30b", "qwen3-coder", "gpt-oss", "gpt-oss:120b"} <= ids


def test_chat_completion_goes_through_the_kv_handoff(oai, tiny_cluster):
    raw = oai.chat.completions.with_raw_response.create(
        model="qwen3-coder:30b", messages=[{"role": "user", "content": "Name one primary colour."}],
        max_tokens=8, temperature=0)
    resp = raw.parse()
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens > 0 and resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert raw.headers["X-Disagg-Method"] == "kv_handoff"
    assert raw.headers["X-Disagg-Prefill-Server"] == tiny_cluster.process("local-prefill-qwen").entry.address
    assert raw.headers["X-Disagg-Decode-Server"] == tiny_cluster.process("local-decode-qwen").entry.address
    assert int(raw.headers["X-Disagg-KV-Bytes"]) > 0
    assert raw.headers["X-Disagg-Prompt-Tokens-Recomputed"].isdigit()


def test_a_repeated_system_prompt_is_served_from_the_prefix_cache(oai):
    system = ("You are a teaching assistant. Grade business-analytics notebooks on data loading, cleaning, "
              "grouped summaries, labelled charts and a conclusion that answers the question. ") * 4
    usage = [oai.chat.completions.create(
        model="qwen", max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}]).usage
        for question in ("Is a bar chart right for revenue by region?", "Should missing prices be dropped?")]
    assert usage[0].prompt_tokens > 128
    # the second shares the system prompt: the prefill server's slot still held its KV
    assert usage[1].prompt_tokens_details.cached_tokens >= 64
    assert usage[1].prompt_tokens_details.cached_tokens < usage[1].prompt_tokens


def test_completion(oai):
    resp = oai.completions.create(model="gpt-oss", prompt="The capital of France is", max_tokens=6, temperature=0)
    assert resp.object == "text_completion"
    assert resp.choices[0].text
    assert resp.usage.completion_tokens > 0


def test_ignore_eos_generates_exactly_max_tokens_through_the_handoff(gateway):
    """vLLM's and llama.cpp's extra parameter, through the gateway, the client and the decode server: a
    one-word answer that ends its turn at once goes on to max_tokens (SmolLM2: a real model that ends
    its turns; the tiny models' random weights seldom do)."""
    oai = openai.OpenAI(base_url=gateway + "/v1", api_key="not-needed", max_retries=0, timeout=300)
    ask = {"model": "qwen", "messages": [{"role": "user", "content": "Answer with one word: is water wet?"}],
           "max_tokens": 40, "temperature": 0}
    short = oai.chat.completions.create(**ask)
    assert short.usage.completion_tokens < 40 and short.choices[0].finish_reason == "stop"
    full = oai.chat.completions.create(**ask, extra_body={"ignore_eos": True})
    assert full.usage.completion_tokens == 40 and full.choices[0].finish_reason == "length"


def test_streamed_chat_joins_to_the_non_streamed_text(oai, tiny_gateway):
    messages = [{"role": "user", "content": "Write one short sentence about the sea."}]
    whole = oai.chat.completions.create(model="qwen", messages=messages, max_completion_tokens=20, temperature=0)
    pieces, usage, roles = [], None, []
    for chunk in oai.chat.completions.create(model="qwen", messages=messages, max_completion_tokens=20,
                                             temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            roles.append(choice.delta.role)
            pieces.append(choice.delta.content or "")
    assert len([p for p in pieces if p]) > 1  # it really streamed
    assert "".join(pieces) == whole.choices[0].message.content
    assert roles[0] == "assistant"
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    metrics = requests.get(tiny_gateway + "/metrics", timeout=10).text
    assert 'disagg_gateway_time_to_first_token_seconds_count{model="qwen"}' in metrics
    assert 'disagg_gateway_inter_token_seconds_count{model="qwen"}' in metrics
    assert 'disagg_gateway_requests_total{api="openai",method="kv_handoff",model="qwen",outcome="ok"}' in metrics


def test_stream_is_server_sent_events_with_headers_and_final_facts(tiny_gateway):
    with requests.post(tiny_gateway + "/v1/completions", stream=True, timeout=120, json={
            "model": "qwen", "prompt": "1, 2, 3,", "max_tokens": 5, "temperature": 0, "stream": True}) as resp:
        assert resp.status_code == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["X-Disagg-Method"] == "kv_handoff"
        assert int(resp.headers["X-Disagg-KV-Bytes"]) > 0
        lines = [line for line in resp.iter_lines(decode_unicode=True) if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][6:])
    assert last["choices"][0]["finish_reason"] in ("stop", "length")
    assert last["disagg"]["method"] == "kv_handoff" and last["disagg"]["prompt_tokens_recomputed"] is not None


def test_json_schema_response_format_parses(oai):
    resp = oai.chat.completions.create(
        model="qwen", max_tokens=40, temperature=0,
        messages=[{"role": "user", "content": "Pick a colour and answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}})
    answer = json.loads(resp.choices[0].message.content)
    assert answer["colour"] in ("red", "green", "blue")


PICK = {"type": "function", "function": {
    "name": "pick_colour", "description": "Record the colour the user picked.",
    "parameters": {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
                   "required": ["colour"], "additionalProperties": False}}}
PICK_ONLY = {"type": "function", "function": {"name": "pick_colour"}}


def test_the_embedded_model_calls_a_tool(oai):
    """SmolLM2's template knows no tools: its call is a JSON object under a grammar (chat/template.py's envelope),
    answered as OpenAI's tool_calls, streamed as a tool_calls delta; the result goes back in the next turn."""
    messages = [{"role": "user", "content": "Pick a colour for the chart."}]
    resp = oai.chat.completions.create(model="qwen", max_tokens=80, temperature=0, messages=messages, tools=[PICK],
                                       tool_choice=PICK_ONLY)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "pick_colour"
    arguments = json.loads(call.function.arguments)
    assert arguments["colour"] in ("red", "green", "blue")
    chunks = list(oai.chat.completions.create(model="qwen", max_tokens=80, temperature=0, messages=messages,
                                              tools=[PICK], tool_choice=PICK_ONLY, stream=True))
    deltas = [tc for chunk in chunks for c in chunk.choices for tc in (c.delta.tool_calls or [])]
    assert [(d.index, d.function.name) for d in deltas] == [(0, "pick_colour")]
    assert json.loads(deltas[0].function.arguments) == arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    follow = oai.chat.completions.create(model="qwen", max_tokens=6, temperature=0, messages=[
        *messages, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "recorded"}])
    assert follow.choices[0].finish_reason in ("stop", "length") and follow.choices[0].message.tool_calls is None


@pytest.mark.parametrize("extra, param", [({"n": 2}, "n"), ({"logprobs": True}, "logprobs"),
                                          ({"functions": [{"name": "f"}]}, "functions")])
def test_unsupported_parameter_is_a_400_naming_it(oai, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="qwen", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                    **extra)
    error = info.value.body
    assert info.value.status_code == 400
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_unknown_model_is_a_404(oai):
    with pytest.raises(openai.NotFoundError) as info:
        oai.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"


def test_a_decode_server_streaming_counts_as_busy(tiny_gateway):
    """Least-loaded routing sees a stream for as long as it runs, not only while it opens."""
    def outstanding():
        servers = requests.get(tiny_gateway + "/health", timeout=10).json()["servers"]
        return next(s["outstanding"] for s in servers if s["name"] == "local-decode-qwen")

    with requests.post(tiny_gateway + "/v1/completions", stream=True, timeout=120, json={
            # long enough to still run while /health is asked, at the tiny model's thousands of tokens a second
            "model": "qwen", "prompt": "Once upon a time", "max_tokens": 3000, "temperature": 0,
            "stream": True}) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith(b"data: ")
        during = outstanding()
        rest = [line for line in lines if line]
    assert rest[-1] == b"data: [DONE]"
    assert during == 1 and outstanding() == 0
