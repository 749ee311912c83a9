"""Typed request bodies, parsed once at the edge of the servers.

Each ``parse_*`` takes the decoded JSON body and returns a frozen dataclass, or
raises ``BadRequest`` naming the offending field. Handlers never call
``.get()`` on raw bodies.
"""
from __future__ import annotations

from dataclasses import dataclass

from .backends.base import Prompt, Sampling
from .errors import BadRequest

MAX_STOP_SEQUENCES = 16


@dataclass(frozen=True)
class KVRef:
    """Where a prefilled bundle can be fetched, as a prefill server described it."""

    url: str
    handle: str
    bytes: int | None = None
    crc32c: int | None = None


@dataclass(frozen=True)
class PrefillRequest:
    prompt: Prompt
    model: str | None = None
    lease_seconds: float | None = None


@dataclass(frozen=True)
class DecodeRequest:
    sampling: Sampling
    stream: bool = False
    kv: KVRef | None = None
    tokens: tuple | None = None        # token ids only: the decode side recomputes the prompt
    fingerprint: dict | None = None    # with tokens: what tokenized them
    model: str | None = None


@dataclass(frozen=True)
class GenerateRequest:
    prompt: Prompt
    sampling: Sampling
    stream: bool = False
    model: str | None = None


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


def parse_prompt(body: dict) -> Prompt:
    text = body.get("prompt")
    messages = body.get("messages")
    if text is None and messages is None:
        raise BadRequest("one of 'prompt' or 'messages' is required", field="prompt")
    if text is not None and messages is not None:
        raise BadRequest("give 'prompt' or 'messages', not both", field="messages")
    if text is not None and (not isinstance(text, str) or not text):
        raise BadRequest("'prompt' must be a non-empty string", field="prompt")
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list", field="messages")
        for i, message in enumerate(messages):
            if (not isinstance(message, dict) or not isinstance(message.get("role"), str)
                    or not isinstance(message.get("content"), str)):
                raise BadRequest(f"messages[{i}] must be an object with string 'role' and 'content'",
                                 field=f"messages[{i}]")
        messages = tuple({"role": m["role"], "content": m["content"]} for m in messages)
    raw = _typed(body, "raw", bool, False, what="a boolean")
    if raw and messages is not None:
        raise BadRequest("'raw' applies to 'prompt' only; 'messages' are always rendered with the chat template",
                         field="raw")
    system = _typed(body, "system", str, None, what="a string")
    return Prompt(text=text, messages=messages, raw=raw, system=system)


def parse_sampling(body: dict) -> Sampling:
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
    return Sampling(
        max_new_tokens=max_new,
        temperature=float(_number(body, "temperature", 0.0, 0.0, 5.0)),
        top_p=float(_number(body, "top_p", 1.0, 0.0, 1.0)),
        top_k=_number(body, "top_k", 40, 0, 1 << 20, integer=True),
        seed=_number(body, "seed", None, -(1 << 31), (1 << 32) - 1, integer=True),
        stop=tuple(stop),
        json_schema=schema,
    )


PROMPT_KEYS = {"prompt", "messages", "raw", "system", "model"}
SAMPLING_KEYS = {"max_new_tokens", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                 "json_schema", "format", "stream"}


def parse_prefill(body) -> PrefillRequest:
    body = _require_object(body)
    _known_keys(body, PROMPT_KEYS | {"lease_seconds"})
    return PrefillRequest(
        prompt=parse_prompt(body),
        model=_typed(body, "model", str, None, what="a string"),
        lease_seconds=_number(body, "lease_seconds", None, 0.1, 3600.0),
    )


def parse_kv_ref(value) -> KVRef:
    if not isinstance(value, dict):
        raise BadRequest("'kv' must be the object a /prefill answer gave", field="kv")
    for key in ("url", "handle"):
        if not isinstance(value.get(key), str) or not value[key]:
            raise BadRequest(f"'kv.{key}' must be a non-empty string", field=f"kv.{key}")
    if not value["url"].startswith(("http://", "https://")):
        raise BadRequest("'kv.url' must be an http(s) URL", field="kv.url")
    size = value.get("bytes")
    crc = value.get("crc32c")
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
        raise BadRequest("'kv.bytes' must be a non-negative integer", field="kv.bytes")
    if crc is not None and (not isinstance(crc, int) or isinstance(crc, bool)):
        raise BadRequest("'kv.crc32c' must be an integer", field="kv.crc32c")
    return KVRef(url=value["url"], handle=value["handle"], bytes=size, crc32c=crc)


def parse_decode(body) -> DecodeRequest:
    body = _require_object(body)
    _known_keys(body, SAMPLING_KEYS | {"kv", "tokens", "fingerprint", "model", "prompt_tokens"})
    kv = body.get("kv")
    tokens = body.get("tokens")
    if (kv is None) == (tokens is None):
        raise BadRequest("exactly one of 'kv' (a prefill's KV reference) or 'tokens' (token ids) is required",
                         field="kv")
    if tokens is not None:
        if (not isinstance(tokens, list) or not tokens
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens)):
            raise BadRequest("'tokens' must be a non-empty list of non-negative integers", field="tokens")
        tokens = tuple(tokens)
    fingerprint = _typed(body, "fingerprint", dict, None, what="an object")
    return DecodeRequest(
        sampling=parse_sampling(body),
        stream=_typed(body, "stream", bool, False, what="a boolean"),
        kv=parse_kv_ref(kv) if kv is not None else None,
        tokens=tokens,
        fingerprint=fingerprint,
        model=_typed(body, "model", str, None, what="a string"),
    )


def parse_generate(body) -> GenerateRequest:
    body = _require_object(body)
    _known_keys(body, PROMPT_KEYS | SAMPLING_KEYS)
    return GenerateRequest(
        prompt=parse_prompt(body),
        sampling=parse_sampling(body),
        stream=_typed(body, "stream", bool, False, what="a boolean"),
        model=_typed(body, "model", str, None, what="a string"),
    )
