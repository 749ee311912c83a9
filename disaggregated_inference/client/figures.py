"""The client's figures: a request's metrics, merged once from what its servers measured.

``Served`` is how one request was served (its servers, their answers, when); its
``metrics`` merges the prefill's figures (the /prefill answer's, and for a streamed
handoff those its KV stream ended with, which the decode server passes on) with the
decode's into one ``RequestMetrics`` (metrics.py). ``overlap_figures`` is what
concurrent requests measure.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..metrics import Method, RequestMetrics, ServerFigures
from ..wire import DecodeAnswer, PrefillAnswer
from .servers import TrackedServer

# the decode's own figures, passed on as the decode server reported them (when it did)
_CANARY = ("canary", "canary_top1_match", "canary_divergence", "canary_tolerance", "canary_check_ms")
_SPECULATION = ("speculation", "draft_tokens", "accepted_tokens")
# how the KV went (whole after the prefill, or streamed during it) and, streamed, what was left after it
_HANDOFF = ("handoff_mode_reason", "kv_import", "kv_wait_time", "kv_exposed_time")


@dataclass
class Served:
    """How one request was served: the servers it went to, what they answered, and when."""

    decode_server: TrackedServer
    method: Method
    prefill_server: TrackedServer | None = None
    prefill: PrefillAnswer | None = None  # the prefill server's answer (a handoff)
    decode: DecodeAnswer | None = None  # the decode server's answer
    decode_sent_at: float | None = None  # when the request that the decode server answered was sent
    decode_connect_retries: list = field(default_factory=list)  # connections it refused, each retried once
    first_piece_at: float | None = None  # a stream: when its first piece arrived
    lines: object = None  # a stream: the decode server's NDJSON lines, open until the last

    def prefill_metrics(self) -> ServerFigures:
        """The prefill's figures: its /prefill answer's, and for a streamed handoff (answered before the prompt
        was evaluated) those its KV stream ended with, which the decode server passes on."""
        pre = self.prefill.metrics if self.prefill is not None else ServerFigures()
        trailer = self.decode.metrics.prefill_metrics if self.decode is not None else None
        return pre.with_(**trailer.given()) if trailer is not None else pre

    def metrics(self, started: float, notes: list, route: dict) -> RequestMetrics:
        """The request's metrics (``started``: when it began; ``notes``: what went wrong on the way;
        ``route``: the router's choice, ``routing.Decision.as_metrics``). The one place where a prefill's and
        a decode's figures meet: the prompt's evaluation is the prefill server's for a handoff, the decode
        server's (same names) otherwise."""
        pre = self.prefill_metrics()
        dec = self.decode.metrics
        handoff = self.prefill is not None
        evaluated = pre if handoff else dec  # where the prompt was evaluated
        prompt_tokens = dec.prompt_tokens or pre.prompt_tokens or 0
        given = {key: getattr(dec, key) for key in _CANARY + _SPECULATION if getattr(dec, key) is not None}
        if handoff:
            given["handoff_mode"] = dec.handoff_mode or pre.handoff_mode or "whole"
            given.update({key: getattr(dec if key in dec.given() else pre, key) for key in _HANDOFF})
        notes = list(notes) + [f"decode server did not accept the connection, retried once: {m}"
                               for m in self.decode_connect_retries]
        return RequestMetrics(
            method=self.method,
            prefill_server=self.prefill_server.entry.address if self.prefill_server else None,
            decode_server=self.decode_server.entry.address,
            prefill_time=_first(pre.prefill_time, dec.prefill_time, 0.0),
            decode_time=dec.decode_time,
            total_time=round(time.perf_counter() - started, 6),
            prompt_tokens=prompt_tokens,
            completion_tokens=dec.completion_tokens or 0,
            prefill_speed=evaluated.prefill_speed,
            decode_speed=dec.decode_speed,
            kv_bytes=dec.kv_bytes or 0,
            kv_transfer_time=_first(dec.kv_transfer_time, 0.0),
            kv_load_time=dec.kv_load_time,
            ttft=dec.ttft,
            # a stream's first piece arrives here: measured whole on the client's clock
            ttft_end_to_end=(round(self.first_piece_at - started, 6) if self.first_piece_at is not None
                             else _end_to_end_ttft(started, self.decode_sent_at, dec.ttft)),
            decode_connect_retries=len(self.decode_connect_retries),
            prompt_tokens_recomputed=dec.prompt_tokens_recomputed,
            prompt_tokens_cached=evaluated.prompt_tokens_cached,
            finish_reason=self.decode.finish_reason,
            reasoning_tokens=dec.reasoning_tokens,
            # what the model's chat format read apart from the answer: never part of the text
            reasoning=self.decode.reasoning or None,
            tool_calls=self.decode.tool_calls or None,
            canary_ms=pre.canary_ms,
            warnings=tuple(notes),
            **route,
            **given,
        )


def method_of(prefilled: PrefillAnswer, decoded: DecodeAnswer | None = None) -> Method:
    """A handoff's method: the decode server's word for it, else what the prefill handed over."""
    reported = decoded.metrics.method if decoded is not None else None
    if reported:
        return reported
    return Method.TOKEN_IDS_RECOMPUTE if prefilled.kv.kind == "token_ids" else Method.KV_HANDOFF


def overlap_figures(request_time: float, wall_time: float) -> dict:
    """What concurrent requests measure, named for what it is: ``request_time`` (the sum of the requests'
    own times, each including any wait behind the others), ``wall_time``, and ``overlap`` = their ratio,
    the mean number of requests in flight. Requests that queue on one server still overlap in flight, so
    this is never a speedup; a speedup needs a measured sequential baseline."""
    return {"request_time": round(request_time, 6), "wall_time": round(wall_time, 6),
            "overlap": round(request_time / wall_time, 3) if wall_time > 0 and request_time > 0 else None}


def describe_overlap(figures: dict) -> str:
    """'N s of request time in M s of wall time (X requests in flight on average)'."""
    overlap = figures.get("overlap")
    return (f"{figures.get('request_time') or 0:.2f} s of request time in {figures.get('wall_time') or 0:.2f} s "
            f"of wall time" + (f" ({overlap:.2f} requests in flight on average)" if overlap else ""))


def _first(*values):
    """The first of ``values`` that is not None (a figure reported, else the next, else the default)."""
    return next((v for v in values if v is not None), None)


def _end_to_end_ttft(started: float, decode_sent_at: float, server_ttft: float | None) -> float | None:
    """Seconds from the client's start of the request to the decode server's first token.

    The client's own clock up to sending the /decode (or fallback /generate) that answered:
    routing, the /prefill round trip, failed attempts, retries and recomputes; plus the decode
    server's ``ttft``, measured from that request's arrival: KV pull, queueing, import (or the
    prompt's evaluation) and the first token. Not counted: the one-way time of that request
    from the client to the decode server (no shared clock), so this is a lower bound by that much.
    """
    if server_ttft is None:
        return None
    return round(decode_sent_at - started + server_ttft, 6)
