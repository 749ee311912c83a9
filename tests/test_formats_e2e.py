"""gpt-oss's harmony through real servers, the KV handoff, the gateway and the official clients.

One cluster of its own (a prefill and a decode server under gunicorn, and the gateway): the model is
a generated tiny ``gpt-oss`` whose vocabulary holds harmony's special tokens (``<|end|>`` no end of
generation, ``<|return|>`` and ``<|call|>`` the ends, as llama.cpp reads a gpt-oss GGUF), served by
``tests/scripted_engine.py``: the llama_cpp engine whose random model writes what the prompt's script
key says (``SCRIPT-THINK``: analysis, then the answer; ``SCRIPT-LONG``: an analysis longer than any
budget; ``SCRIPT-TOOL``: a call; ...). The token loop, the chat format, the handoff, the grammar and
the APIs are the real ones; only the choice of each token is the script's.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import ollama
import openai
import pytest
import requests

from disaggregated_inference.backends import registry
from disaggregated_inference.client import DisaggregatedClient
from disaggregated_inference.grading.analysis import feedback_schema, plan_requests
from disaggregated_inference.grading.evidence import check_rubric, collect_evidence
from disaggregated_inference.grading.options import GradingOptions
from disaggregated_inference.grading.rubric import load_rubric

from . import scripted_engine
from .conftest import EXAMPLES, TINY_THREADS, patient
from .tiny_models import GPT_OSS_HARMONY, tiny_gguf

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
ANSWER = "Blue, the colour of the sea."
REASONING = "The user asks for a colour. Blue is calm; green is fresh. Pick blue."
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}


def harmony_config() -> dict:
    model = {"backend": "scripted_llama_cpp", "model": str(tiny_gguf(GPT_OSS_HARMONY)), "n_ctx": 2048,
             "parallel": 2, "n_threads": TINY_THREADS, "aliases": ["gpt-oss:120b"]}
    return patient({
        "models": {"gpt-oss": model},
        "prefill_servers": [{"name": "prefill-harmony", "host": "127.0.0.1", "port": 8300, "model": "gpt-oss"}],
        "decode_servers": [{"name": "decode-harmony", "host": "127.0.0.1", "port": 8301, "model": "gpt-oss"}],
        "client": {"health_check_interval": 0},
    })


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    """(the running cluster, its gateway's URL); every process knows the scripted engine."""
    from disaggregated_inference.ops.cluster import LocalCluster

    assert registry.is_registered(scripted_engine.ScriptedLlamaCpp.name)
    env = {registry.PLUGINS_VARIABLE: "tests.scripted_engine",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with LocalCluster(harmony_config(), free_ports=True, log_dir=tmp_path_factory.mktemp("harmony-logs"),
                      env=env) as cluster:
        cluster.wait_healthy(timeout=300)
        gateway = cluster.start_gateway()
        cluster.wait_healthy(timeout=120, names=["gateway"])
        yield cluster, gateway.url


@pytest.fixture(scope="module")
def client(harmony):
    with DisaggregatedClient(harmony[0].config, health_check=False) as c:
        c.check_health()
        yield c


def user(text: str) -> list:
    return [{"role": "user", "content": text}]


def test_the_answer_is_the_final_channel_and_the_reasoning_is_in_the_metrics(client, harmony):
    health = requests.get(harmony[0].process("decode-harmony").url + "/health", timeout=10).json()
    assert health["model_info"]["chat_format"] == "harmony" and health["model_info"]["arch"] == "gpt-oss"
    text, metrics = client.generate(model="gpt-oss:120b", messages=user("SCRIPT-THINK which colour?"),
                                    max_tokens=200, reasoning_effort="high")
    assert metrics["method"] == "kv_handoff"  # the decode server read the handed-over prompt's answer
    assert text == ANSWER  # <|end|> closed the analysis without ending the generation
    assert metrics["reasoning"] == REASONING and "<|" not in text + metrics["reasoning"]
    assert 0 < metrics["reasoning_tokens"] < metrics["completion_tokens"]
    assert metrics["finish_reason"] == "stop"
    # a plain prompt is one user turn of the same conversation
    assert client.generate(model="gpt-oss", prompt="SCRIPT-THINK", max_tokens=200)[0] == ANSWER
    # a stream: its pieces are the whole answer; with parts, the reasoning comes as it is written
    *items, streamed = client.stream(model="gpt-oss", messages=user("SCRIPT-THINK"), max_tokens=200, parts=True)
    pieces = [i for i in items if isinstance(i, str)]
    assert len(pieces) > 1 and "".join(pieces) == ANSWER
    assert "".join(i.value for i in items if not isinstance(i, str)) == REASONING == streamed["reasoning"]
    assert streamed["reasoning_tokens"] == metrics["reasoning_tokens"]


def capped_count(harmony) -> float:
    text = requests.get(harmony[0].process("decode-harmony").url + "/metrics", timeout=10).text
    return float(re.search(r"^disagg_reasoning_capped_total (\S+)$", text, re.M).group(1))


def test_a_reasoning_cap_still_yields_an_answer(client, harmony):
    before = capped_count(harmony)
    text, metrics = client.generate(model="gpt-oss", messages=user("SCRIPT-LONG which colour?"), max_tokens=200,
                                    reasoning_budget=16)
    assert text == "Green." and metrics["reasoning_tokens"] == 16 and metrics["method"] == "kv_handoff"
    # without a budget of its own, half of max_tokens: still an answer within max_tokens
    text, metrics = client.generate(model="gpt-oss", messages=user("SCRIPT-LONG"), max_tokens=60)
    assert text == "Green." and metrics["reasoning_tokens"] == 30
    assert metrics["completion_tokens"] <= 60 and metrics["finish_reason"] == "stop"
    # the decode-only path reads it the same way
    text, local = client.generate(model="gpt-oss", messages=user("SCRIPT-LONG"), max_tokens=60, route="decode_only")
    assert text == "Green." and local["method"] == "decode_only" and local["reasoning_tokens"] == 30
    assert capped_count(harmony) == before + 3  # the decode server counts each capped generation


def test_a_model_that_stops_after_its_analysis_is_moved_on_to_an_answer(harmony):
    url = harmony[0].process("decode-harmony").url
    answer = requests.post(url + "/generate", json={"messages": user("SCRIPT-SILENT"), "max_tokens": 24},
                           timeout=120).json()
    assert answer["reasoning"] == "Nothing to add."
    assert answer["generated_text"].strip()  # the random model's own words, after the fed final-channel header
    assert answer["metrics"]["forced_tokens"] > 0


def test_a_schema_constrains_the_final_channel_only(client):
    """The analysis is prose (a grammar from the first token would have refused it); the answer, written by the
    random model itself under the grammar that starts with the final channel, is valid JSON."""
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
              "required": ["colour"], "additionalProperties": False}
    text, metrics = client.generate(model="gpt-oss", messages=user("SCRIPT-FREE-JSON"), max_tokens=80,
                                    json_schema=schema)
    assert metrics["reasoning"].startswith("This is prose, not JSON")
    assert json.loads(text)["colour"] in ("red", "green", "blue")


def test_the_graders_feedback_request_keeps_its_schema(client):
    """The grader's real feedback request (its prompt, schema and default low effort) for a notebook whose text
    carries the script key: schema-valid JSON from the final channel, the reasoning beside it."""
    import nbformat

    rubric = load_rubric(EXAMPLES / "rubric.yaml")
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("SCRIPT-FEEDBACK"),
                                               nbformat.v4.new_code_cell("import pandas as pd")])
    evidence = collect_evidence(notebook)
    options = GradingOptions(feedback_model="gpt-oss", code_model="gpt-oss")
    requests_, _ = plan_requests(rubric, notebook, evidence, check_rubric(rubric, evidence), options)
    (feedback,) = [r for r in requests_ if r.role == "feedback"]
    assert feedback.kwargs["reasoning_effort"] == "low" and feedback.kwargs["json_schema"] == feedback_schema()
    text, metrics = client.generate(**feedback.kwargs)
    answer = json.loads(text)
    assert set(answer) == {"summary", "strengths", "improvements"} and len(answer["summary"]) >= 10
    assert metrics["reasoning"].startswith("The notebook loads the data")


def test_tool_calls_round_trip_through_the_openai_api(harmony):
    oai = openai.OpenAI(base_url=harmony[1] + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = user("SCRIPT-TOOL what is the weather in Paris?")
    resp = oai.chat.completions.create(model="gpt-oss:120b", messages=messages, tools=[WEATHER], max_tokens=200,
                                       reasoning_effort="low")
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    assert choice.message.reasoning_content == "I need the weather first."
    assert resp.usage.completion_tokens_details.reasoning_tokens > 0
    # the result goes back; the model answers from it
    after = oai.chat.completions.create(model="gpt-oss", max_tokens=200, tools=[WEATHER], messages=[
        *messages, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "SCRIPT-AFTER-TOOL 21 degrees"}])
    assert after.choices[0].message.content == "It is 21 degrees in Paris."
    assert after.choices[0].finish_reason == "stop"
    # streamed: reasoning deltas, then the call as one delta, finish_reason tool_calls
    chunks = list(oai.chat.completions.create(model="gpt-oss", messages=messages, tools=[WEATHER], max_tokens=200,
                                              stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "I need the weather first."
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == \
        [(0, "get_weather", {"city": "Paris", "days": 2})]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == resp.usage.completion_tokens_details \
        .reasoning_tokens


def test_a_streamed_answer_keeps_its_reasoning_apart(harmony):
    oai = openai.OpenAI(base_url=harmony[1] + "/v1", api_key="unused", max_retries=0, timeout=120)
    whole = oai.chat.completions.create(model="gpt-oss", messages=user("SCRIPT-THINK"), max_tokens=200)
    assert whole.choices[0].message.content == ANSWER and whole.choices[0].message.reasoning_content == REASONING
    content, reasoning = [], []
    for chunk in oai.chat.completions.create(model="gpt-oss", messages=user("SCRIPT-THINK"), max_tokens=200,
                                             stream=True):
        for c in chunk.choices:
            content.append(c.delta.content or "")
            reasoning.append(getattr(c.delta, "reasoning_content", None) or "")
    assert "".join(content) == ANSWER and "".join(reasoning) == REASONING


def test_thinking_and_tools_through_the_ollama_api(harmony):
    client = ollama.Client(host=harmony[1], timeout=120)
    resp = client.chat(model="gpt-oss:120b", messages=user("SCRIPT-THINK"), think=True, options={"num_predict": 200})
    assert resp.message.content == ANSWER and resp.message.thinking == REASONING
    hidden = client.chat(model="gpt-oss", messages=user("SCRIPT-THINK"), think=False, options={"num_predict": 200})
    assert hidden.message.content == ANSWER and not hidden.message.thinking
    parts = list(client.chat(model="gpt-oss", messages=user("SCRIPT-THINK"), think="low", stream=True,
                             options={"num_predict": 200}))
    assert "".join(p.message.thinking or "" for p in parts) == REASONING
    assert "".join(p.message.content for p in parts) == ANSWER and parts[-1].done
    called = client.chat(model="gpt-oss", messages=user("SCRIPT-TOOL"), tools=[WEATHER], options={"num_predict": 200})
    (call,) = called.message.tool_calls
    assert call.function.name == "get_weather" and dict(call.function.arguments) == {"city": "Paris", "days": 2}
    after = client.chat(model="gpt-oss", tools=[WEATHER], options={"num_predict": 200}, messages=[
        *user("SCRIPT-TOOL"), {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
        {"role": "tool", "content": "SCRIPT-AFTER-TOOL sunny", "tool_name": "get_weather"}])
    assert after.message.content == "It is 21 degrees in Paris."
    shown = client.show("gpt-oss")
    assert {"tools", "thinking"} <= set(shown.capabilities)
    generated = client.generate(model="gpt-oss", prompt="SCRIPT-THINK", think=True, options={"num_predict": 200})
    assert generated.response == ANSWER and generated.thinking == REASONING


def test_langchain_binds_tools_and_round_trips(harmony):
    """LangChain's ``ChatOpenAI(...).bind_tools([...])`` as a new user would write it: the call, then the answer."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str, days: int = 1) -> str:
        """Get the weather in a city."""
        return "SCRIPT-AFTER-TOOL 21 degrees"

    llm = langchain_openai.ChatOpenAI(base_url=harmony[1] + "/v1", api_key="unused", model="gpt-oss:120b",
                                      max_tokens=200, max_retries=0, timeout=120)
    bound = llm.bind_tools([get_weather])
    history = [HumanMessage("SCRIPT-TOOL what is the weather in Paris?")]
    ai = bound.invoke(history)
    assert [(c["name"], c["args"]) for c in ai.tool_calls] == [("get_weather", {"city": "Paris", "days": 2})]
    history += [ai, ToolMessage(get_weather.invoke(ai.tool_calls[0]["args"]), tool_call_id=ai.tool_calls[0]["id"])]
    final = bound.invoke(history)
    assert final.content == "It is 21 degrees in Paris." and not final.tool_calls
    streamed = list(bound.stream([HumanMessage("SCRIPT-TOOL")]))
    joined = streamed[0]
    for chunk in streamed[1:]:
        joined += chunk
    assert [(c["name"], c["args"]) for c in joined.tool_calls] == [("get_weather", {"city": "Paris", "days": 2})]
