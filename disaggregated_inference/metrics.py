"""A request's metrics: one type, one name per quantity, whichever engine served it.

``Method`` is how a request was served (the values the documents name);
``ServerFigures`` is what a server reports of one request (its engine's figures and its own), on the wire
as the answers' ``metrics`` object; ``RequestMetrics`` is what ``DisaggregatedClient.generate`` measured and merged
from the prefill's and the decode's figures (client/figures.py), given to the
caller as ``as_dict()``; ``Move`` is one move of a streamed answer from a decode
server that failed mid-answer to another (resume.py). The engines name the same quantities alike: the prompt's
evaluation is ``prefill_time`` / ``prefill_speed`` wherever it ran (on the
prefill server, or on the decode server for a recompute or a decode-only request).
This module imports nothing of the package.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field, fields, replace
from enum import Enum


class Method(str, Enum):
    """How a request was served (``metrics["method"]``)."""

    KV_HANDOFF = "kv_handoff"  # the prefill server's KV, imported by the decode server
    TOKEN_IDS_RECOMPUTE = "token_ids_recompute"  # the prompt's token ids handed over, evaluated again
    OLLAMA_CONTEXT = "ollama_context"  # an Ollama decode server continued from the prompt's context
    DECODE_ONLY = "decode_only"  # the router kept the request on the decode server
    DECODE_ONLY_FALLBACK = "decode_only_fallback"  # no handoff could be made: the decode server alone

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def group(self) -> str:
        """The dashboards' four kinds: kv_handoff, recompute, decode_only, fallback."""
        return _GROUPS[self]

    @property
    def local(self) -> bool:
        """Served by the decode server alone (no prefill server)."""
        return self in (Method.DECODE_ONLY, Method.DECODE_ONLY_FALLBACK)


_GROUPS = {Method.KV_HANDOFF: "kv_handoff", Method.TOKEN_IDS_RECOMPUTE: "recompute",
           Method.OLLAMA_CONTEXT: "recompute", Method.DECODE_ONLY: "decode_only",
           Method.DECODE_ONLY_FALLBACK: "fallback"}


@dataclass(frozen=True)
class Move:
    """An answer moved: its decode server (``from_decode_server``) failed mid-answer (``reason``) after
    ``after_pieces`` pieces, and the request was served again (``method``, on ``to_decode_server``, from a
    fresh prefill on ``to_prefill_server`` or none); ``pieces_replayed`` pieces were generated again and
    checked, ``tokens_recomputed`` = the prompt's tokens evaluated again + those pieces."""

    from_decode_server: str
    to_decode_server: str | None
    to_prefill_server: str | None
    method: Method | None
    after_pieces: int
    reason: str
    pieces_replayed: int
    tokens_recomputed: int

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["method"] = self.method.value if self.method is not None else None
        return out

    @classmethod
    def from_dict(cls, move: dict) -> Move:
        values = {f.name: move.get(f.name) for f in fields(cls)}
        values["method"] = Method(values["method"]) if values["method"] is not None else None
        return cls(**values)


# what a RequestMetrics gives only when it has it (the others it always gives, None when unknown)
_WHEN_GIVEN = ("reasoning", "tool_calls", "canary", "canary_top1_match", "canary_divergence", "canary_tolerance",
               "canary_check_ms", "handoff_mode", "handoff_mode_reason", "kv_import", "kv_wait_time",
               "kv_exposed_time", "canary_ms", "speculation", "draft_tokens", "accepted_tokens", "resumed",
               "tokens_recomputed_by_moves", "warnings")
_EMPTY_NOT_GIVEN = ("reasoning", "tool_calls", "resumed", "warnings")


@dataclass(frozen=True)
class RequestMetrics:
    """One request's figures, as ``generate`` returns them (``as_dict``) and its history keeps them."""

    method: Method
    decode_server: str
    prefill_server: str | None = None
    prefill_time: float = 0.0  # the prompt's evaluation, wherever it ran
    decode_time: float | None = None
    total_time: float = 0.0  # on the client's clock, the whole request
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefill_speed: float | None = None
    decode_speed: float | None = None
    kv_bytes: int = 0
    kv_transfer_time: float = 0.0
    kv_load_time: float | None = None
    ttft: float | None = None  # the decode server's, from the request's arrival there
    ttft_end_to_end: float | None = None  # the client's, from the request's start
    decode_connect_retries: int = 0
    prompt_tokens_recomputed: int | None = None
    prompt_tokens_cached: int | None = None  # prompt tokens whose KV the evaluating server's slot already held
    finish_reason: str | None = None
    reasoning_tokens: int | None = None  # of completion_tokens, those the model reasoned with
    route: str | None = None  # the router's choice (routing.Decision)
    route_reason: str | None = None
    route_estimates: dict | None = None
    # given only when known (_WHEN_GIVEN)
    reasoning: str | None = None
    tool_calls: list | None = None
    canary: str | None = None
    canary_top1_match: bool | None = None
    canary_divergence: float | None = None
    canary_tolerance: float | None = None
    canary_check_ms: float | None = None
    handoff_mode: str | None = None
    handoff_mode_reason: str | None = None
    kv_import: str | None = None
    kv_wait_time: float | None = None
    kv_exposed_time: float | None = None
    canary_ms: float | None = None
    speculation: str | None = None
    draft_tokens: int | None = None
    accepted_tokens: int | None = None
    resumed: tuple = ()  # the answer's moves (``Move``), each time its decode server failed mid-answer
    tokens_recomputed_by_moves: int | None = None  # the moves' ``tokens_recomputed``, summed
    warnings: tuple = field(default=())

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def as_dict(self) -> dict:
        """The ``metrics`` dict a caller of ``generate`` gets (JSON-ready; ``method`` its value)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _WHEN_GIVEN and (value is None or (f.name in _EMPTY_NOT_GIVEN and not value)):
                continue
            out[f.name] = value
            if f.name == "completion_tokens":
                out["total_tokens"] = self.total_tokens
        out["method"] = self.method.value
        if self.resumed:
            out["resumed"] = [move.as_dict() for move in self.resumed]
        if self.warnings:
            out["warnings"] = list(self.warnings)
        return out

    @classmethod
    def from_dict(cls, metrics: dict) -> RequestMetrics:
        """Back from ``as_dict`` (unknown keys refused: a renamed quantity fails here)."""
        known = {f.name for f in fields(cls)}
        unknown = set(metrics) - known - {"total_tokens"}
        if unknown:
            raise ValueError(f"not a request's metric: {', '.join(sorted(unknown))}")
        values = {k: v for k, v in metrics.items() if k in known}
        values["method"] = Method(values["method"])
        if "warnings" in values:
            values["warnings"] = tuple(values["warnings"])
        if "resumed" in values:
            values["resumed"] = tuple(Move.from_dict(move) for move in values["resumed"])
        return cls(**values)


_KINDS = {"int": numbers.Integral, "float": numbers.Real, "str": str, "bool": bool, "Method": Method}


@dataclass(frozen=True)
class ServerFigures:
    """What a server reports of one request: the figures its engine measured (``Prefilled.metrics``, a
    generation's last ``Event``) and its own (queueing, transfer, timings), one field per quantity under
    the names ``RequestMetrics`` uses. A figure not reported is None and not written; one reported as
    unknown (None) is written as null (``nulls``), so the JSON is what the server meant. ``of`` and
    ``with_`` take the names (a name that is no field is refused: a renamed quantity fails there); the
    wire writes ``as_dict`` and reads ``from_dict``."""

    method: Method | None = None  # how the decode server served it (a decode's figures)
    finish_reason: str | None = None  # an engine's; the servers move it out of the answer's metrics
    handoff: str | None = None  # the bundle's kind the decode server received
    handoff_mode: str | None = None
    handoff_mode_reason: str | None = None
    # the prompt
    prompt_tokens: int | None = None
    prompt_tokens_evaluated: int | None = None
    prompt_tokens_cached: int | None = None
    prompt_tokens_recomputed: int | None = None
    context_tokens: int | None = None
    tokenize_time: float | None = None
    prefill_time: float | None = None
    prefill_speed: float | None = None
    # the generation
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None
    reasoning_capped: bool | None = None
    forced_tokens: int | None = None
    chat_format: str | None = None
    decode_time: float | None = None
    decode_speed: float | None = None
    first_token_time: float | None = None
    backend_time: float | None = None
    sample_time: float | None = None
    ttft: float | None = None
    server_time: float | None = None
    queue_time: float | None = None
    speculation: str | None = None
    draft_tokens: int | None = None
    accepted_tokens: int | None = None
    # the KV
    kv_bytes: int | None = None
    kv_state_bytes: int | None = None
    kv_export_time: float | None = None
    kv_read_time: float | None = None
    kv_chunk_tokens: int | None = None
    kv_convert_time: float | None = None
    kv_checksum_time: float | None = None
    kv_load_time: float | None = None
    kv_import: str | None = None
    kv_transfer_time: float | None = None
    kv_transfer_gbps: float | None = None
    kv_pull_time: float | None = None
    kv_wait_time: float | None = None
    kv_pieces: int | None = None
    kv_exposed_time: float | None = None
    kv_end_after_prefill_time: float | None = None
    kv_send_tail_time: float | None = None
    kv_fetch_to_queue_time: float | None = None
    fingerprint_checked: bool | None = None
    # the canary (kv/canary.py)
    canary: str | None = None
    canary_ms: float | None = None
    canary_top1_match: bool | None = None
    canary_divergence: float | None = None
    canary_tolerance: float | None = None
    canary_engines: str | None = None
    canary_check_ms: float | None = None
    first_token_matches_prefill: bool | None = None  # Ollama's: the decode's text starts with the prefill's token
    # an Ollama engine's own timings
    ollama_load_time: float | None = None
    ollama_total_time: float | None = None
    # a streamed handoff: the prefill's figures, from its KV stream's trailer (the decode server passes them on)
    prefill_metrics: ServerFigures | None = None
    nulls: frozenset = field(default=frozenset(), repr=False)  # the figures reported as unknown

    def __post_init__(self):
        if isinstance(self.method, str) and not isinstance(self.method, Method):
            object.__setattr__(self, "method", Method(self.method))  # an engine's word: one of the documented
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or f.name == "nulls":
                continue
            kind = ServerFigures if f.name == "prefill_metrics" else _KINDS[f.type.split(" |")[0]]
            if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
                raise TypeError(f"the figure {f.name!r} is {type(value).__name__} {value!r}, not {f.type}")

    @classmethod
    def of(cls, **values) -> ServerFigures:
        """The figures named (None: reported as unknown, written as null)."""
        return cls().with_(**values)

    def with_(self, **values) -> ServerFigures:
        """These figures with ``values`` added or replaced (a name that is no figure: ``ValueError``)."""
        unknown = set(values) - _FIGURES
        if unknown:
            raise ValueError(f"not a server's figure: {', '.join(sorted(unknown))}")
        nulls = (self.nulls - values.keys()) | {k for k, v in values.items() if v is None}
        return replace(self, **values, nulls=frozenset(nulls))

    def without(self, *names: str) -> ServerFigures:
        """These figures with ``names`` not reported."""
        return replace(self, **dict.fromkeys(names), nulls=self.nulls - set(names))

    def given(self) -> dict:
        """The figures reported, by name (values as they are: ``method`` a ``Method``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "nulls" and (getattr(self, f.name) is not None or f.name in self.nulls)}

    def as_dict(self) -> dict:
        """The JSON ``metrics`` object of an answer."""
        out = self.given()
        if self.method is not None:
            out["method"] = self.method.value
        if self.prefill_metrics is not None:
            out["prefill_metrics"] = self.prefill_metrics.as_dict()
        return out

    def __getitem__(self, name: str):
        """Read as the JSON reads (``KeyError``: not reported): for tests and scripts; the package reads fields."""
        return self.as_dict()[name]

    def __contains__(self, name: str) -> bool:
        return name in self.given()

    def get(self, name: str, default=None):
        return self.as_dict().get(name, default)

    @classmethod
    def from_dict(cls, metrics: dict) -> ServerFigures:
        """Back from ``as_dict`` (unknown keys refused: a renamed quantity fails here)."""
        if not isinstance(metrics, dict):
            raise ValueError("a server's 'metrics' is a JSON object")
        values = dict(metrics)
        if isinstance(values.get("prefill_metrics"), dict):
            values["prefill_metrics"] = cls.from_dict(values["prefill_metrics"])
        try:
            return cls.of(**values)
        except TypeError as exc:
            raise ValueError(str(exc)) from None


_FIGURES = {f.name for f in fields(ServerFigures)} - {"nulls"}


__all__ = ["Method", "Move", "RequestMetrics", "ServerFigures"]
