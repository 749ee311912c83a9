"""Typed request bodies of the servers' own API, parsed once at the edge of the servers.

Each ``parse_*`` takes a body's JSON (``http.parse_json``) and returns a frozen
dataclass, or raises ``BadRequest`` naming the offending field. Handlers never
call ``.get()`` on raw bodies. The prompt and sampling parts are read as the client
checks them (request.py); the design documents' spellings of some fields are read
in one adapter here (``_sampling``, ``_decode_source``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..backends.base import Prompt, Sampling
from ..errors import BadRequest
from ..fields import format_schema, known_keys, number, require_object, typed
from ..request import DEFAULT_LIMITS, Limits, parse_prompt, parse_sampling
from ..wire import HANDOFF_MODES, KVRef, read_kv_ref


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


# tools and tool_choice belong to both: the prompt renders them, the decode side reads the calls
PROMPT_KEYS = {"prompt", "messages", "raw", "system", "model", "tools", "tool_choice", "reasoning_effort"}
SAMPLING_KEYS = {"max_new_tokens", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                 "json_schema", "format", "stream", "ignore_eos", "tools", "tool_choice", "reasoning_budget",
                 "speculation"}


def _progress(body: dict, stream: bool | None = None) -> bool:
    """``progress``: heartbeat lines (server/progress.py); on /decode and /generate only with ``stream``."""
    progress = typed(body, "progress", bool, False, what="a boolean")
    if progress and stream is False:
        raise BadRequest("'progress' needs 'stream': true (the heartbeats are lines of the stream)", field="progress")
    return progress


def parse_prefill(body, limits: Limits = DEFAULT_LIMITS, max_lease_seconds: float = 3600.0) -> PrefillRequest:
    body = require_object(body)
    known_keys(body, PROMPT_KEYS | {"lease_seconds", "kv_kind", "handoff_mode", "progress"})
    kv_kind = typed(body, "kv_kind", str, None, what="a string")
    if kv_kind not in (None, "llama_seq_state", "neutral_kv"):
        raise BadRequest("'kv_kind' must be 'llama_seq_state' or 'neutral_kv'", field="kv_kind")
    mode = typed(body, "handoff_mode", str, "whole", what="a string")
    if mode not in HANDOFF_MODES:
        raise BadRequest(f"'handoff_mode' must be one of {', '.join(HANDOFF_MODES)}", field="handoff_mode")
    return PrefillRequest(
        prompt=parse_prompt(body, limits),
        model=typed(body, "model", str, None, what="a string"),
        lease_seconds=number(body, "lease_seconds", None, 0.1, max_lease_seconds),
        kv_kind=kv_kind,
        handoff_mode=mode,
        progress=_progress(body),
    )



# -- the design documents' spellings -------------------------------------------------------------
# Clients written to the design documents send "max_tokens" for "max_new_tokens" and "format" (Ollama's:
# "json" or a schema) for "json_schema"; on /decode, "kv_cache" for "kv" and "context" (the token ids
# /prefill answered with, beside the original "prompt") for "tokens". They are read here and nowhere else.
DOCUMENT_DECODE_KEYS = {"kv_cache", "context", "prompt"}


def _sampling(body: dict, limits: Limits) -> Sampling:
    """The sampling part (``request.parse_sampling``) in either spelling; an error names the field as the
    request spelled it."""
    own, spelled = dict(body), {}
    if "max_tokens" in body:
        if "max_new_tokens" in body:
            raise BadRequest("give 'max_new_tokens' or 'max_tokens', not both", field="max_tokens")
        own["max_new_tokens"], spelled["max_new_tokens"] = own.pop("max_tokens"), "max_tokens"
    fmt = own.pop("format", None)
    if fmt is not None:
        if body.get("json_schema") is not None:
            raise BadRequest("give 'json_schema' or 'format', not both", field="format")
        own["json_schema"], spelled["json_schema"] = format_schema(fmt, blank=False), "format"
    try:
        return parse_sampling(own, limits)
    except BadRequest as exc:
        if exc.field not in spelled:
            raise
        raise BadRequest(exc.message.replace(f"'{exc.field}'", f"'{spelled[exc.field]}'"),
                         field=spelled[exc.field]) from None


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
        typed(body, "prompt", str, None, what="a string (the prompt the context came from)")
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
    body = require_object(body)
    known_keys(body, SAMPLING_KEYS | {"kv", "tokens", "fingerprint", "model", "prompt_tokens", "progress"}
                | DOCUMENT_DECODE_KEYS)
    kv, tokens = _decode_source(body)
    fingerprint = typed(body, "fingerprint", dict, None, what="an object")
    stream = typed(body, "stream", bool, False, what="a boolean")
    return DecodeRequest(
        sampling=_sampling(body, limits),
        stream=stream,
        kv=kv,
        tokens=tokens,
        fingerprint=fingerprint,
        model=typed(body, "model", str, None, what="a string"),
        progress=_progress(body, stream),
    )


def parse_generate(body, limits: Limits = DEFAULT_LIMITS) -> GenerateRequest:
    body = require_object(body)
    known_keys(body, PROMPT_KEYS | SAMPLING_KEYS | {"progress"})
    stream = typed(body, "stream", bool, False, what="a boolean")
    return GenerateRequest(
        prompt=parse_prompt(body, limits),
        sampling=_sampling(body, limits),
        stream=stream,
        model=typed(body, "model", str, None, what="a string"),
        progress=_progress(body, stream),
    )

