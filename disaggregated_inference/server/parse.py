"""Typed request bodies, parsed once at the edge of the servers.

Each ``parse_*`` takes a body's JSON (``http.parse_json``) and returns a frozen
dataclass, or raises ``BadRequest`` naming the offending field. Handlers never
call ``.get()`` on raw bodies.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from .. import chat
from ..backends.base import Prompt, Sampling
from ..backends.speculate import PROPOSERS, requested_proposer
from ..errors import BadRequest, PayloadTooLarge
from ..http import MAX_JSON_DEPTH, check_text, parse_json  # noqa: F401  (the servers' bodies)
from ..wire import HANDOFF_MODES, KVRef, read_kv_ref

MAX_STOP_SEQUENCES = 16
MAX_SCHEMA_DEPTH = 32  # nesting of a json_schema: grammar compile time grows with it


@dataclass(frozen=True)
class Limits:
    """Sizes a request may not exceed (``ServerOptions``: max_prompt_chars, max_schema_bytes)."""

    prompt_chars: int = 1 << 20
    schema_bytes: int = 64 << 10
    schema_depth: int = MAX_SCHEMA_DEPTH


DEFAULT_LIMITS = Limits()


def _message_chars(m: dict) -> int:
    calls = m.get("tool_calls", ())
    return (len(m["content"]) + len(m["role"]) + len(m.get("reasoning", ""))
            + sum(len(c["name"]) + len(json.dumps(c["arguments"])) for c in calls))


def check_prompt_size(prompt, limits: Limits) -> None:
    """The prompt's characters (text or messages' contents, plus system and tools) against the limit, before any
    work."""
    if prompt.text is not None:
        field, size = "prompt", len(prompt.text)
    else:
        field, size = "messages", sum(_message_chars(m) for m in prompt.messages)
    size += len(prompt.system or "")
    if prompt.tools is not None:
        size += len(json.dumps(prompt.tools.as_openai()))
    if size > limits.prompt_chars:
        raise PayloadTooLarge(f"'{field}' has {size} characters (with 'system'); this server takes at most "
                              f"{limits.prompt_chars}", field=field)


def _depth(value, limit: int, level: int = 1) -> int:
    if level > limit:
        return level
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return max((_depth(c, limit, level + 1) for c in children), default=level)


def check_schema(schema: dict, field: str, limits: Limits) -> None:
    size = len(json.dumps(schema, separators=(",", ":")))
    if size > limits.schema_bytes:
        raise PayloadTooLarge(f"'{field}' is {size} bytes as JSON; this server takes at most {limits.schema_bytes}",
                              field=field)
    if _depth(schema, limits.schema_depth) > limits.schema_depth:
        raise BadRequest(f"'{field}' is nested deeper than {limits.schema_depth} levels", field=field)


@dataclass(frozen=True)
class PrefillRequest:
    prompt: Prompt
    model: str | None = None
    lease_seconds: float | None = None
    kv_kind: str | None = None  # the bundle kind the decode side wants (None: the backend's own)
    handoff_mode: str = "whole"  # "streamed": answer at once, the KV leaving as it is evaluated, where it can
    progress: bool = False  # answer with heartbeat lines until the answer (server/progress.py)


@dataclass(frozen=True)
class DecodeRequest:
    sampling: Sampling
    stream: bool = False
    kv: KVRef | None = None
    tokens: tuple | None = None        # token ids only: the decode side recomputes the prompt
    fingerprint: dict | None = None    # with tokens: what tokenized them
    model: str | None = None
    progress: bool = False  # with stream: heartbeat lines until the first piece, and between slow ones


@dataclass(frozen=True)
class GenerateRequest:
    prompt: Prompt
    sampling: Sampling
    stream: bool = False
    model: str | None = None
    progress: bool = False  # as DecodeRequest's


def _require_object(body) -> dict:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", field="body")
    return body


def _typed(body: dict, key: str, kinds, default=None, *, what: str):
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in _as_tuple(kinds)):
        raise BadRequest(f"'{key}' must be {what}", field=key)
    return value


def _as_tuple(kinds):
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _number(body, key, default, lo, hi, *, integer=False):
    kinds = int if integer else (int, float)
    value = _typed(body, key, kinds, default, what="an integer" if integer else "a number")
    if value is not None and not lo <= value <= hi:
        raise BadRequest(f"'{key}' must be between {lo} and {hi}, got {value}", field=key)
    return value


def _known_keys(body: dict, allowed: set) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unknown field '{unknown[0]}' (allowed: {', '.join(sorted(allowed))})", field=unknown[0])


def parse_prompt(body: dict, limits: Limits = DEFAULT_LIMITS) -> Prompt:
    text = body.get("prompt")
    messages = body.get("messages")
    if text is None and messages is None:
        raise BadRequest("one of 'prompt' or 'messages' is required", field="prompt")
    if text is not None and messages is not None:
        raise BadRequest("give 'prompt' or 'messages', not both", field="messages")
    if text is not None and (not isinstance(text, str) or not text):
        raise BadRequest("'prompt' must be a non-empty string", field="prompt")
    if messages is not None:
        messages = chat.parse_messages(messages)  # roles, contents, tool calls and results; valid text
    raw = _typed(body, "raw", bool, False, what="a boolean")
    if raw and messages is not None:
        raise BadRequest("'raw' applies to 'prompt' only; 'messages' are always rendered with the chat template",
                         field="raw")
    system = _typed(body, "system", str, None, what="a string")
    if text is not None:
        check_text(text, "prompt")
    if system is not None:
        check_text(system, "system")
    tools = chat.parse_tools(body.get("tools"), body.get("tool_choice"))
    prompt = Prompt(text=text, messages=messages, raw=raw, system=system, tools=tools,
                    reasoning_effort=chat.parse_effort(body.get("reasoning_effort")))
    check_prompt_size(prompt, limits)
    return prompt


def parse_sampling(body: dict, limits: Limits = DEFAULT_LIMITS) -> Sampling:
    if "max_new_tokens" in body and "max_tokens" in body:
        raise BadRequest("give 'max_new_tokens' or 'max_tokens', not both", field="max_tokens")
    key = "max_tokens" if "max_tokens" in body else "max_new_tokens"
    max_new = _number(body, key, 256, 1, 1 << 20, integer=True)
    stop = body.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("'stop' must be a string or a list of non-empty strings", field="stop")
    if len(stop) > MAX_STOP_SEQUENCES:
        raise BadRequest(f"'stop' has more than {MAX_STOP_SEQUENCES} sequences", field="stop")
    schema = body.get("json_schema")
    fmt = body.get("format")
    if schema is not None and fmt is not None:
        raise BadRequest("give 'json_schema' or 'format', not both", field="format")
    if fmt is not None:  # Ollama's spelling: "json" or a schema object
        if fmt == "json":
            schema = {"type": "object"}
        elif isinstance(fmt, dict):
            schema = fmt
        else:
            raise BadRequest("'format' must be \"json\" or a JSON schema object", field="format")
    if schema is not None and not isinstance(schema, dict):
        raise BadRequest("'json_schema' must be a JSON schema object", field="json_schema")
    if schema is not None:
        check_schema(schema, "format" if fmt is not None else "json_schema", limits)
        if body.get("ignore_eos") is True:  # a grammar ends the output with an end-of-generation token
            raise BadRequest("'ignore_eos' cannot be combined with a JSON schema", field="ignore_eos")
    for i, seq in enumerate(stop):
        check_text(seq, "stop")
    speculation = requested_proposer(_typed(body, "speculation", str, None,
                                              what=f"one of {', '.join(PROPOSERS)}"))
    tools = chat.parse_tools(body.get("tools"), body.get("tool_choice"))
    if tools is not None:
        check_schema({"tools": tools.as_openai()}, "tools", limits)
    return Sampling(
        max_new_tokens=max_new,
        temperature=float(_number(body, "temperature", 0.0, 0.0, 5.0)),
        top_p=float(_number(body, "top_p", 1.0, 0.0, 1.0)),
        top_k=_number(body, "top_k", 40, 0, 1 << 20, integer=True),
        seed=_number(body, "seed", None, -(1 << 31), (1 << 32) - 1, integer=True),
        stop=tuple(stop),
        json_schema=schema,
        ignore_eos=_typed(body, "ignore_eos", bool, False, what="a boolean"),
        tools=tools,
        reasoning_budget=_number(body, "reasoning_budget", None, 0, 1 << 20, integer=True),
        speculation=speculation,
    )


# tools and tool_choice belong to both: the prompt renders them, the decode side reads the calls
PROMPT_KEYS = {"prompt", "messages", "raw", "system", "model", "tools", "tool_choice", "reasoning_effort"}
SAMPLING_KEYS = {"max_new_tokens", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                 "json_schema", "format", "stream", "ignore_eos", "tools", "tool_choice", "reasoning_budget",
                 "speculation"}


def _progress(body: dict, stream: bool | None = None) -> bool:
    """``progress``: heartbeat lines (server/progress.py); on /decode and /generate only with ``stream``."""
    progress = _typed(body, "progress", bool, False, what="a boolean")
    if progress and stream is False:
        raise BadRequest("'progress' needs 'stream': true (the heartbeats are lines of the stream)", field="progress")
    return progress


def parse_prefill(body, limits: Limits = DEFAULT_LIMITS, max_lease_seconds: float = 3600.0) -> PrefillRequest:
    body = _require_object(body)
    _known_keys(body, PROMPT_KEYS | {"lease_seconds", "kv_kind", "handoff_mode", "progress"})
    kv_kind = _typed(body, "kv_kind", str, None, what="a string")
    if kv_kind not in (None, "llama_seq_state", "neutral_kv"):
        raise BadRequest("'kv_kind' must be 'llama_seq_state' or 'neutral_kv'", field="kv_kind")
    mode = _typed(body, "handoff_mode", str, "whole", what="a string")
    if mode not in HANDOFF_MODES:
        raise BadRequest(f"'handoff_mode' must be one of {', '.join(HANDOFF_MODES)}", field="handoff_mode")
    return PrefillRequest(
        prompt=parse_prompt(body, limits),
        model=_typed(body, "model", str, None, what="a string"),
        lease_seconds=_number(body, "lease_seconds", None, 0.1, max_lease_seconds),
        kv_kind=kv_kind,
        handoff_mode=mode,
        progress=_progress(body),
    )



# The other spellings of what /decode continues from, which clients written to the design documents
# send: "kv_cache" for "kv", and "context" (the token ids /prefill answered with, beside the original
# "prompt") for "tokens".
DOCUMENT_DECODE_KEYS = {"kv_cache", "context", "prompt"}


def _kv_cache(value) -> KVRef:
    """``kv_cache``: the ``kv`` object a /prefill answered with, under the documents' name.

    The KV itself never travels inside JSON here (the decode server pulls it from the prefill
    server), so anything but that reference is refused, saying so."""
    if not isinstance(value, dict):
        raise BadRequest("'kv_cache' must be the 'kv' object a /prefill answer gave (the decode server pulls the "
                         "KV from the prefill server itself; KV bytes are not accepted inside JSON)", field="kv_cache")
    return read_kv_ref(value, "kv_cache")  # naming the field as the request spelled it


def _decode_source(body: dict) -> tuple[KVRef | None, tuple | None]:
    """What to continue from: a KV reference (``kv``, or ``kv_cache``) or token ids (``tokens``, or
    ``context``: both are recomputed by the decode server)."""
    given = [key for key in ("kv", "kv_cache", "tokens", "context") if body.get(key) is not None]
    if len(given) != 1:
        raise BadRequest("exactly one of 'kv' (a prefill's KV reference, also spelled 'kv_cache') or 'tokens' "
                         "(token ids, also spelled 'context') is required", field=given[0] if given else "kv")
    key = given[0]
    if body.get("prompt") is not None:
        if key != "context":
            raise BadRequest("'prompt' on /decode only comes beside 'context' (the documents' shape); "
                             "to generate from a prompt alone, POST /generate", field="prompt")
        _typed(body, "prompt", str, None, what="a string (the prompt the context came from)")
    if key == "kv":
        return read_kv_ref(body["kv"]), None
    if key == "kv_cache":
        return _kv_cache(body["kv_cache"]), None
    tokens = body[key]
    if (not isinstance(tokens, list) or not tokens
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens)):
        what = " (the 'context' a /prefill answer gave)" if key == "context" else ""
        raise BadRequest(f"'{key}' must be a non-empty list of non-negative integers{what}", field=key)
    return None, tuple(tokens)


def parse_decode(body, limits: Limits = DEFAULT_LIMITS) -> DecodeRequest:
    body = _require_object(body)
    _known_keys(body, SAMPLING_KEYS | {"kv", "tokens", "fingerprint", "model", "prompt_tokens", "progress"}
                | DOCUMENT_DECODE_KEYS)
    kv, tokens = _decode_source(body)
    fingerprint = _typed(body, "fingerprint", dict, None, what="an object")
    stream = _typed(body, "stream", bool, False, what="a boolean")
    return DecodeRequest(
        sampling=parse_sampling(body, limits),
        stream=stream,
        kv=kv,
        tokens=tokens,
        fingerprint=fingerprint,
        model=_typed(body, "model", str, None, what="a string"),
        progress=_progress(body, stream),
    )


def parse_generate(body, limits: Limits = DEFAULT_LIMITS) -> GenerateRequest:
    body = _require_object(body)
    _known_keys(body, PROMPT_KEYS | SAMPLING_KEYS | {"progress"})
    stream = _typed(body, "stream", bool, False, what="a boolean")
    return GenerateRequest(
        prompt=parse_prompt(body, limits),
        sampling=parse_sampling(body, limits),
        stream=stream,
        model=_typed(body, "model", str, None, what="a string"),
        progress=_progress(body, stream),
    )
