"""The typed core: the wire's messages (wire.py), a request (request.py), its metrics (metrics.py).

Each wire type's writer and reader are one another's inverse; a request's bodies are what the servers
parse; the metrics keep one name per quantity; the test-only fake client is built from the same types,
so it cannot drift from the real one.
"""
from __future__ import annotations

import inspect
import json
from dataclasses import fields

import pytest

from disaggregated_inference.client import DisaggregatedClient
from disaggregated_inference.errors import BadRequest, PayloadTooLarge
from disaggregated_inference.metrics import Method, RequestMetrics, ServerFigures
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
    Final("stop", ServerFigures.of(method="kv_handoff", completion_tokens=3)),
    ErrorLine({"error": "busy", "code": "overloaded"}, 503),
])
def test_every_line_reads_back_as_it_was_written(line):
    assert read_line(line.write()) == line


def test_a_prefill_answer_and_its_kv_reference_read_back_and_go_to_decode_as_the_server_reads_them():
    answer = PrefillAnswer(kv=read_kv_ref(KV), context=(1, 2, 3), metrics=ServerFigures(prefill_time=0.1),
                           prompt_tokens=3, model="m", model_key="qwen", server="p", fingerprint={"n_vocab": 5})
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
    answer = DecodeAnswer("hi", "tool_calls", ServerFigures(method=Method.DECODE_ONLY), "why",
                          [{"name": "f", "arguments": "{}"}])
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


# -- what a server reports of a request: every engine's figures are ServerFigures ------------------------

def _engine(name: str):
    from disaggregated_inference.backends import ModelSettings, create

    from .conftest import tiny_model_settings

    if name == "echo":
        from disaggregated_inference.backends import registry

        from . import echo_engine
        # registered on import; again here, since a test before this one may have reset the registry
        registry.register("echo", echo_engine.EchoBackend)
        settings = ModelSettings(model="echo", backend="echo")
    else:
        settings = ModelSettings(**tiny_model_settings())
    backend = create(settings)
    backend.load()
    return backend


def _drive(backend, out):
    """(events, result) of an engine's request: a batched engine's generator run alone, a simple one's."""
    if hasattr(backend, "run"):
        return backend.run(out)
    if not inspect.isgenerator(out):
        return [], out
    events = list(out)
    return events, None


@pytest.mark.parametrize("name", ["echo", "llama_cpp"])
def test_every_engine_reports_typed_figures_that_travel_as_the_wire_writes_them(name):
    from disaggregated_inference.backends import Event, Prompt, Received, Sampling

    backend = _engine(name)
    try:
        prompt, sampling = Prompt(text="Say the regions back: north, south."), Sampling(max_new_tokens=4, temperature=0)
        _, prefilled = _drive(backend, backend.prefill(prompt))
        received = Received(prefilled.kind, prefilled.tokens, prefilled.payload, prefilled.fingerprint,
                            dict(prefilled.meta))
        decoded, _ = _drive(backend, backend.decode(received, sampling, lambda: False))
        generated, _ = _drive(backend, backend.generate(prompt, sampling, lambda: False))
    finally:
        backend.close()
    assert isinstance(prefilled.metrics, ServerFigures) and prefilled.metrics.prompt_tokens == len(prefilled.tokens)
    for events, method in ((decoded, {Method.KV_HANDOFF, Method.TOKEN_IDS_RECOMPUTE}),
                           (generated, {Method.DECODE_ONLY})):
        last = [e for e in events if isinstance(e, Event)][-1]
        assert last.done and isinstance(last.metrics, ServerFigures) and last.metrics.method in method
        assert last.metrics.finish_reason in ("stop", "length") and last.metrics.completion_tokens >= 1
    for figures in (prefilled.metrics, last.metrics):  # what the wire writes reads back the same, typed
        assert ServerFigures.from_dict(json.loads(json.dumps(figures.as_dict()))) == figures
        assert Final("stop", figures).write()["metrics"] == figures.as_dict()


def test_server_figures_refuse_a_figure_they_do_not_name_or_of_the_wrong_type():
    with pytest.raises(ValueError, match="kv_byte"):
        ServerFigures.of(kv_byte=3)  # a renamed quantity fails here, not in a dashboard
    with pytest.raises(ValueError, match="prompt_eval_time"):
        read_line({"done": True, "finish_reason": "stop", "metrics": {"prompt_eval_time": 0.1}})
    with pytest.raises(ValueError, match="prompt_tokens"):
        DecodeAnswer.read({"generated_text": "", "metrics": {"prompt_tokens": "four"}})
    with pytest.raises(TypeError, match="completion_tokens"):
        ServerFigures(completion_tokens=1.5)
    with pytest.raises(ValueError):
        ServerFigures.of(method="telepathy")


def test_server_figures_write_a_figure_reported_unknown_as_null_and_leave_out_what_was_not_reported():
    figures = ServerFigures.of(prompt_tokens=4, canary_ms=None, method="decode_only")
    assert figures.as_dict() == {"method": "decode_only", "prompt_tokens": 4, "canary_ms": None}
    later = figures.with_(ttft=0.25, finish_reason="stop").without("finish_reason", "canary_ms")
    assert later.as_dict() == {"method": "decode_only", "prompt_tokens": 4, "ttft": 0.25}
    assert later.method is Method.DECODE_ONLY and "canary_ms" not in later and later["ttft"] == 0.25
    nested = ServerFigures.of(kv_pieces=3, prefill_metrics=ServerFigures.of(prefill_time=0.5))
    assert ServerFigures.from_dict(nested.as_dict()) == nested
    assert set(fields_of(ServerFigures)) >= set(fields_of(RequestMetrics)) - _CLIENT_ONLY  # one name per quantity


_CLIENT_ONLY = {"decode_server", "prefill_server", "total_time", "ttft_end_to_end", "decode_connect_retries", "route",
                "route_reason", "route_estimates", "reasoning", "tool_calls", "warnings",
                "resumed", "tokens_recomputed_by_moves"}  # the client's own: a move between decode servers (resume.py)


def fields_of(cls) -> list[str]:
    return [f.name for f in fields(cls)]
