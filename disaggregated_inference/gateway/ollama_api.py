"""The Ollama-compatible API: ``/api/generate``, ``/api/chat`` (NDJSON streams by default),
``/api/tags``, ``/api/ps``, ``/api/show``, ``/api/version``.

Final objects carry Ollama's fields, durations in nanoseconds: ``total_duration``
(the gateway's wall time), ``prompt_eval_duration`` (the prefill, or the decode
server's own prompt evaluation in a fallback), ``eval_duration`` (the decode),
``load_duration`` (what is neither: routing, KV transfer and import, queueing;
every model is loaded already), plus a ``disagg`` object with the handoff's facts.

A model's reasoning is ``thinking`` (``message.thinking`` on /api/chat), beside
the answer, in stream lines as it comes; ``think: false`` leaves it out, a level
(``low``, ``medium``, ``high``) sets the reasoning effort. Tool calls are
``message.tool_calls``, each ``{"function": {"name", "arguments"}}`` with the
arguments an object.
"""
from __future__ import annotations

import json
import time
from datetime import datetime, timezone

from flask import Blueprint, Response, g

from .. import __version__
from ..http import STREAM_HEADERS
from ..metrics import RequestMetrics
from . import sse
from .relay import complete, fact_headers, facts, json_body, open_stream, state
from .parse import GatewayRequest, api_field, parse_model_name, parse_ollama_chat, parse_ollama_generate

ollama = Blueprint("ollama", __name__)
NS = 1_000_000_000


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _json(body: dict, headers: dict | None = None) -> Response:
    return Response(json.dumps(body), mimetype="application/json", headers=headers)


def _final(metrics: RequestMetrics, wall: float) -> dict:
    """Ollama's closing fields; zero-valued ones are left out, as Ollama does."""
    prompt = metrics.prefill_time or 0.0
    decode = metrics.decode_time or 0.0
    fields = {
        "done_reason": "length" if metrics.finish_reason == "length" else "stop",
        "total_duration": int(wall * NS),
        "load_duration": int(max(0.0, wall - prompt - decode) * NS),
        "prompt_eval_count": metrics.prompt_tokens or 0,
        "prompt_eval_duration": int(prompt * NS),
        "eval_count": metrics.completion_tokens or 0,
        "eval_duration": int(decode * NS),
    }
    return {k: v for k, v in fields.items() if v or k == "done_reason"}


@ollama.get("/")
def root():
    return Response("Ollama is running", mimetype="text/plain")


@ollama.get("/api/version")
def version():
    return _json({"version": __version__})


def _arguments(text: str) -> dict:
    """A call's arguments as the object Ollama answers with (JSON text that is no object: under ``arguments``)."""
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError:
        value = text
    return value if isinstance(value, dict) else {"arguments": value}


def _tool_calls(calls) -> list:
    return [{"function": {"name": c["name"], "arguments": _arguments(c["arguments"])}} for c in calls]


def _generate_fields(text: str, thinking: str = "", calls=()) -> dict:
    return {"response": text, **({"thinking": thinking} if thinking else {})}


def _chat_fields(text: str, thinking: str = "", calls=()) -> dict:
    message = {"role": "assistant", "content": text}
    if thinking:
        message["thinking"] = thinking
    if calls:
        message["tool_calls"] = _tool_calls(calls)
    return {"message": message}


@ollama.post("/api/generate")
def generate():
    req = parse_ollama_generate(json_body())
    if req.prompt == "":  # Ollama: an empty prompt only loads the model; ours are always loaded
        state().config.resolve_model(req.model)
        return _json({"model": req.model, "created_at": _now(), "response": "", "done": True, "done_reason": "load"})
    return _answer(req, _generate_fields)


@ollama.post("/api/chat")
def chat():
    req = parse_ollama_chat(json_body())
    return _answer(req, _chat_fields)


def _answer(req: GatewayRequest, content) -> Response:
    if not req.stream:
        text, metrics = complete(req, "ollama")
        body = {"model": req.model, "created_at": _now(),
                **content(text, metrics.reasoning or "", metrics.tool_calls or ()), "done": True,
                **_final(metrics, time.perf_counter() - g.arrived), "disagg": facts(metrics)}
        return _json(body, fact_headers(body["disagg"]))
    arrived = g.arrived
    route, events = open_stream(req, "ollama")

    def lines():
        for kind, value in events:
            if kind in ("piece", "reasoning", "tool_call"):
                fields = (content(value) if kind == "piece" else content("", value) if kind == "reasoning"
                          else content("", "", [value]))
                yield sse.ndjson_line({"model": req.model, "created_at": _now(), **fields, "done": False})
            elif kind == "done":
                yield sse.ndjson_line({"model": req.model, "created_at": _now(), **content(""), "done": True,
                                       **_final(value, time.perf_counter() - arrived), "disagg": facts(value)})
            else:  # an error after the stream started: an extra line, as Ollama does
                field = api_field(value.field, "ollama")
                yield sse.ndjson_line({"error": value.message, **({"field": field} if field else {})})

    return Response(lines(), mimetype="application/x-ndjson", headers={**fact_headers(route), **STREAM_HEADERS})


def _details(entry: dict) -> dict:
    backend = entry.get("backend", "llama_cpp")
    return {"parent_model": "", "format": "gguf" if backend == "llama_cpp" else backend, "family": "",
            "families": None, "parameter_size": "", "quantization_level": ""}


def _names():
    for key, entry in state().config.models.items():
        for name in [key, *entry.get("aliases", [])]:
            yield name, key, entry


@ollama.get("/api/tags")
def tags():
    modified = datetime.fromtimestamp(state().started_at, timezone.utc).isoformat().replace("+00:00", "Z")
    return _json({"models": [{"name": name, "model": name, "modified_at": modified, "size": 0, "digest": "",
                              "details": _details(entry)} for name, _, entry in _names()]})


@ollama.get("/api/ps")
def ps():
    """The models with at least one prefill or decode server up (as the client last saw them)."""
    up = {s["model"] for s in state().client.status() if s["up"]}
    return _json({"models": [{"name": name, "model": name, "size": 0, "digest": "", "details": _details(entry),
                              "expires_at": "0001-01-01T00:00:00Z", "size_vram": 0,
                              "context_length": entry.get("n_ctx", 0)}
                             for name, key, entry in _names() if key in up]})


@ollama.post("/api/show")
def show():
    name = parse_model_name(json_body())
    st = state()
    key = st.config.resolve_model(name)
    entry = st.config.models[key]
    def model_info():
        return next((s.health.get("model_info") for s in st.client.servers.values()
                     if s.entry.model == key and s.health.get("model_info")), None)

    info = model_info()
    if info is None:  # no health check has reached its servers yet: ask them now
        st.client.check_health()
        info = model_info() or {}
    return _json({"modelfile": "", "parameters": "", "template": "", "details": _details(entry),
                  "model_info": {"disagg.model": key, "disagg.aliases": entry.get("aliases", []),
                                 "disagg.backend": entry.get("backend", "llama_cpp"),
                                 "disagg.n_ctx": entry.get("n_ctx"), **{f"disagg.{k}": v for k, v in info.items()}},
                  "capabilities": _capabilities(entry, info), "modified_at": _now()})


def _capabilities(entry: dict, info: dict) -> list:
    """Ollama's capability names for what the model's chat format (as its servers report it) can do."""
    found = ["completion"]
    fmt = info.get("chat_format")
    grammar = entry.get("backend", "llama_cpp") == "llama_cpp"  # the JSON-envelope tool calls need one
    if fmt in ("harmony", "qwen3_coder") or (fmt == "template" and grammar):
        found.append("tools")
    if fmt == "harmony":
        found.append("thinking")
    return found
