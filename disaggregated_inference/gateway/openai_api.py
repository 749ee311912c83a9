"""The OpenAI-compatible API: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``.

A streamed answer is Server-Sent Events (``data: {chunk}`` lines, then ``data:
[DONE]``). Its headers say what is known when they leave: the method as routed,
the prefill and decode servers and the bundle's size; the last chunk with choices
carries every fact (with the final method and the recomputed prompt tokens) in
its ``disagg`` field, as every non-streamed answer does.

A model's reasoning is ``message.reasoning_content`` (``delta.reasoning_content``
in a stream), never part of ``content``, and its token count is
``usage.completion_tokens_details.reasoning_tokens``. Tool calls are
``message.tool_calls`` (one ``tool_calls`` delta per call in a stream, its
arguments whole) with ``finish_reason: "tool_calls"``.
"""
from __future__ import annotations

import json
import time
import uuid

from flask import Blueprint, Response

from . import sse
from ..http import STREAM_HEADERS
from ..metrics import RequestMetrics
from .relay import complete, fact_headers, facts, json_body, open_stream, openai_type, state
from .parse import GatewayRequest, api_field, parse_openai_chat, parse_openai_completion

openai = Blueprint("openai", __name__, url_prefix="/v1")
OWNER = "disaggregated-inference"


def _finish_reason(reason) -> str:
    return reason if reason in ("length", "tool_calls") else "stop"


def _usage(metrics: RequestMetrics) -> dict:
    usage = {"prompt_tokens": metrics.prompt_tokens or 0, "completion_tokens": metrics.completion_tokens or 0,
             "total_tokens": metrics.total_tokens or 0}
    if metrics.prompt_tokens_cached is not None:  # OpenAI's field for prompt tokens served from a cache
        usage["prompt_tokens_details"] = {"cached_tokens": metrics.prompt_tokens_cached}
    if metrics.reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": metrics.reasoning_tokens}
    return usage


def _tool_call(call: dict, index: int | None = None) -> dict:
    """A call as the OpenAI API writes it (with an id of its own; ``index`` in a stream's delta)."""
    out = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
           "function": {"name": call["name"], "arguments": call["arguments"]}}
    return out if index is None else {"index": index, **out}


def _calls(req: GatewayRequest, metrics: RequestMetrics) -> list:
    calls = metrics.tool_calls or []
    return calls if req.parallel_tool_calls else calls[:1]


def _json(body: dict, headers: dict) -> Response:
    return Response(json.dumps(body), mimetype="application/json", headers=headers)


@openai.get("/models")
def models():
    cfg = state().config
    created = int(state().started_at)
    data = []
    for key, entry in cfg.models.items():
        for name in [key, *entry.get("aliases", [])]:
            data.append({"id": name, "object": "model", "created": created, "owned_by": OWNER})
    return _json({"object": "list", "data": data}, {})


@openai.get("/models/<path:name>")
def model(name: str):
    state().config.resolve_model(name)  # 404 if unknown
    return _json({"id": name, "object": "model", "created": int(state().started_at), "owned_by": OWNER}, {})


@openai.post("/chat/completions")
def chat_completions():
    return _answer(parse_openai_chat(json_body()), chat=True)


@openai.post("/completions")
def completions():
    return _answer(parse_openai_completion(json_body()), chat=False)


def _answer(req: GatewayRequest, chat: bool) -> Response:
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    if req.stream:
        return _stream(req, chat, ident, created)
    text, metrics = complete(req, "openai")
    reason = _finish_reason(metrics.finish_reason)
    if chat:
        message = {"role": "assistant", "content": text}
        if metrics.reasoning:
            message["reasoning_content"] = metrics.reasoning
        calls = _calls(req, metrics)
        if calls:
            message["tool_calls"] = [_tool_call(c) for c in calls]
            message["content"] = text or None  # as OpenAI answers a call without text
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    body = {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": req.model, "choices": [choice], "usage": _usage(metrics), "disagg": facts(metrics)}
    return _json(body, fact_headers(body["disagg"]))


def _stream(req: GatewayRequest, chat: bool, ident: str, created: int) -> Response:
    route, events = open_stream(req, "openai")
    base = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": req.model}

    def chunk(delta: dict | None, reason=None, role: bool = False) -> dict:
        if chat:
            delta = {**({"role": "assistant"} if role else {}), **(delta or {})}
            return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}
        return {**base, "choices": [{"index": 0, "text": (delta or {}).get("content", ""), "logprobs": None,
                                     "finish_reason": reason}]}

    def body():
        first, calls = True, 0
        for kind, value in events:
            if kind in ("piece", "reasoning", "tool_call"):
                if kind == "piece":
                    delta = {"content": value}
                elif kind == "reasoning":
                    if not chat:
                        continue
                    delta = {"reasoning_content": value}
                else:
                    if not chat or (calls and not req.parallel_tool_calls):
                        continue
                    delta = {"tool_calls": [_tool_call(value, calls)]}
                    calls += 1
                yield sse.event(chunk(delta, role=first and chat))
                first = False
            elif kind == "done":
                last = chunk(None, _finish_reason(value.finish_reason))
                last["disagg"] = facts(value)
                yield sse.event(last)
                if req.include_usage:
                    yield sse.event({**base, "choices": [], "usage": _usage(value)})
            else:  # the stream had started: the error goes in-band, as OpenAI's streams do
                yield sse.event({"error": {"message": value.message, "type": openai_type(value.status),
                                           "param": api_field(value.field, "openai"), "code": value.code}})
        yield sse.DONE

    return Response(body(), mimetype="text/event-stream", headers={**fact_headers(route), **STREAM_HEADERS})
