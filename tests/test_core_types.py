"""The typed core: the wire's messages (wire.py), a request (request.py), its metrics (metrics.py).

Each wire type's writer and reader are one another's inverse; a request's bodies are what the servers
parse; the metrics keep one name per quantity; the test-only fake client is built from the same types,
so it cannot drift from the real one.
"""
from __future__ import annotations

import inspect
from dataclasses import fields

import pytest

from disaggregated_inference.client import DisaggregatedClient
from disaggregated_inference.errors import BadRequest, PayloadTooLarge
from disaggregated_inference.metrics import Method, RequestMetrics
from disaggregated_inference.observe.figures import METHOD_GROUPS
from disaggregated_inference.request import GenerationRequest, Limits
from disaggregated_inference.server.parse import parse_decode, parse_generate, parse_prefill
from disaggregated_inference.wire import (Answer, DecodeAnswer, ErrorLine, Final, Heartbeat, KVRef, Piece,
                                          PrefillAnswer, read_kv_ref, read_line)

from .fakes import FakeGradingClient, StreamingFakeClient

KV = {"url": "http://127.0.0.1:9001/kv/abc", "handle": "abc", "kind": "llama_seq_state", "bytes": 10,
      "crc32c": 7, "sent_as": "frames", "mode": "whole", "expires_at": 12.5, "lease_seconds": 30.0}


@pytest.mark.parametrize("line", [
    Heartbeat("queued"), Heartbeat("prefill", tokens=100, evaluated=40), Heartbeat("decode", generated=3),
    Piece(text="a"), Piece(reasoning="think"), Piece(tool_call={"name": "f", "arguments": "{}"}),
    Final("stop", {"method": "kv_handoff", "completion_tokens": 3}),
    ErrorLine({"error": "busy", "code": "overloaded"}, 503),
])
def test_every_line_reads_back_as_it_was_written(line):
    assert read_line(line.write()) == line


def test_a_prefill_answer_and_its_kv_reference_read_back_and_go_to_decode_as_the_server_reads_them():
    answer = PrefillAnswer(kv=read_kv_ref(KV), context=(1, 2, 3), metrics={"prefill_time": 0.1}, prompt_tokens=3,
                           model="m", model_key="qwen", server="p", fingerprint={"n_vocab": 5})
    body = answer.write()
    assert body["kv"] == KV and body["prompt_tokens"] == 3 and body["handoff"] == "llama_seq_state"
    assert PrefillAnswer.read(body) == answer
    assert read_line({**body, "done": True}) == Answer(body)  # the last line of a progress answer
    ref = parse_decode({"kv": answer.kv.write(), "max_new_tokens": 4}).kv
    assert (ref.url, ref.handle, ref.bytes, ref.crc32c, ref.streamed) == (KV["url"], "abc", 10, 7, False)
    assert isinstance(ref, KVRef)


@pytest.mark.parametrize("kv, field", [({"url": "ftp://x/kv/a", "handle": "a"}, "kv.url"),
                                       ({"url": "http://x/kv/a", "handle": "b"}, "kv.handle"),
                                       ({**KV, "mode": "sideways"}, "kv.mode")])
def test_a_bad_kv_reference_names_its_field(kv, field):
    with pytest.raises(BadRequest) as caught:
        read_kv_ref(kv)
    assert caught.value.field == field


def test_a_decode_answer_reads_back():
    answer = DecodeAnswer("hi", "tool_calls", {"method": "decode_only"}, "why", [{"name": "f", "arguments": "{}"}])
    assert DecodeAnswer.read(answer.write()) == answer


def test_method_holds_the_documented_values_and_their_groups():
    assert {m.value for m in Method} == set(METHOD_GROUPS)
    assert all(m.group == METHOD_GROUPS[m.value] for m in Method)
    assert f"{Method.KV_HANDOFF}" == str(Method.KV_HANDOFF) == "kv_handoff"


def test_request_metrics_give_one_name_per_quantity_and_refuse_another():
    metrics = RequestMetrics(method=Method.DECODE_ONLY, decode_server="d:1", prefill_time=0.5, prompt_tokens=4,
                             completion_tokens=2, warnings=("slow",))
    given = metrics.as_dict()
    assert given["method"] == "decode_only" and type(given["method"]) is str
    assert given["total_tokens"] == 6 and given["warnings"] == ["slow"] and "reasoning" not in given
    assert RequestMetrics.from_dict(given) == metrics
    with pytest.raises(ValueError, match="prompt_eval_time"):
        RequestMetrics.from_dict({**given, "prompt_eval_time": 0.5})
    with pytest.raises(ValueError):
        RequestMetrics.from_dict({**given, "method": "disaggregated"})


def test_a_request_turns_itself_into_the_bodies_the_servers_parse():
    request = GenerationRequest.of("qwen", messages=[{"role": "user", "content": "hi"}], max_tokens=7, stop="END",
                                   json_schema={"type": "object"}, seed=3, reasoning_effort="low",
                                   tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert request.stop == ("END",) and isinstance(request.messages, tuple)
    pre = parse_prefill(request.prefill_body(handoff_mode="streamed"))
    assert pre.handoff_mode == "streamed" and pre.prompt.messages[0]["content"] == "hi"
    assert pre.prompt.tools is not None and pre.prompt.reasoning_effort == "low"
    dec = parse_decode(request.decode_body(KV, stream=True))
    assert dec.stream and dec.sampling.max_new_tokens == 7 and dec.sampling.stop == ("END",)
    assert dec.sampling.seed == 3 and dec.sampling.json_schema == {"type": "object"}
    assert parse_generate(request.generate_body()).sampling.tools is not None


def test_a_request_is_checked_as_the_servers_check_it():
    with pytest.raises(BadRequest) as caught:
        GenerationRequest.of("qwen", "hi", temperature=9.0).check()
    assert caught.value.field == "temperature"
    with pytest.raises(PayloadTooLarge):
        GenerationRequest.of("qwen", "x" * 11).check(Limits(prompt_chars=10))
    with pytest.raises(BadRequest, match="prompt or messages"):
        GenerationRequest.of("qwen")


def test_the_documents_spellings_are_read_and_named_as_spelled():
    assert parse_decode({"tokens": [1], "max_tokens": 3, "format": "json"}).sampling.json_schema == {"type": "object"}
    for body, field in (({"tokens": [1], "max_tokens": 0}, "max_tokens"), ({"tokens": [1], "format": 5}, "format"),
                        ({"tokens": [1], "max_tokens": 3, "max_new_tokens": 3}, "max_tokens"),
                        ({"tokens": [1], "format": "json", "json_schema": {}}, "format"),
                        ({"kv_cache": {"url": "ftp://x/kv/a", "handle": "a"}}, "kv_cache.url")):
        with pytest.raises(BadRequest) as caught:
            parse_decode(body)
        assert caught.value.field == field and f"'{field}'" in caught.value.message


def test_the_request_type_holds_every_keyword_argument_of_generate_and_stream():
    own = {f.name for f in fields(GenerationRequest)}
    client_options = {"self", "route", "on_route", "parts"}  # how to serve it, not what is asked
    for method in (DisaggregatedClient.generate, DisaggregatedClient.stream):
        assert set(inspect.signature(method).parameters) - client_options == own


def test_the_fake_client_takes_what_the_real_one_takes_and_nothing_else():
    fake = FakeGradingClient()
    text, metrics = fake.generate("qwen", "hi", max_tokens=8, seed=1, route="auto")
    assert RequestMetrics.from_dict(metrics).method == Method.KV_HANDOFF
    assert fake.calls == [{"model": "qwen", "prompt": "hi", "max_tokens": 8, "temperature": 0.0, "seed": 1}]
    with pytest.raises(TypeError):
        fake.generate("qwen", "hi", max_new_tokens=8)  # not an argument of the real client
    *_, last = StreamingFakeClient().stream("qwen", "hi", parts=True)
    assert RequestMetrics.from_dict(last).completion_tokens >= 0
