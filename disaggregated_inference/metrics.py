"""A request's metrics: one type, one name per quantity, whichever engine served it.

``Method`` is how a request was served (the values the documents name);
``RequestMetrics`` is what ``DisaggregatedClient.generate`` measured and merged
from the prefill's and the decode's figures (client/figures.py), given to the
caller as ``as_dict()``; ``Move`` is one move of a streamed answer from a decode
server that failed mid-answer to another (resume.py). The engines name the same quantities alike: the prompt's
evaluation is ``prefill_time`` / ``prefill_speed`` wherever it ran (on the
prefill server, or on the decode server for a recompute or a decode-only request).
This module imports nothing of the package.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
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


__all__ = ["Method", "Move", "RequestMetrics"]
