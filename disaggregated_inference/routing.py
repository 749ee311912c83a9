"""Conditional disaggregation: per request, the KV handoff or the decode server alone, whichever
the client expects to give the first token sooner.

The client keeps a ``CostModel`` up to date from what its own requests measured:

- each prefill server's prompt speed (tokens/s of ``/prefill``) and each decode server's
  (tokens/s of a prompt it evaluated itself, ``/generate``); until it has measured a server
  itself, the ``prompt_speed`` that server's ``/health`` reports (its own recent requests);
- each model's KV bytes per token and the time its export, checksum and import take per byte;
- each (prefill, decode) pair's link throughput (bytes over ``kv_transfer_time``);
- each path's fixed cost: what its end-to-end time to first token measured beyond those parts
  (HTTP round trips, JSON, queueing, the canary's token), per path;
- characters per token of each model, since the client has no tokenizer;
- queue depth: each prompt ahead of this one costs a wait of one of that server's recent prompt
  times: on the prefill server, every prompt of this client it is still evaluating (a batched server
  evaluates prompts oldest first, so one already in a slot goes first all the same) and those its
  ``/health`` says wait for a slot; on the decode server, this client's decode-only requests whose
  prompt it is still evaluating.

Estimated time to first token of a prompt of ``n`` tokens (the last prompt token and the first
sampled one cost the same on both paths and are left out of both):

    handoff     = fixed(handoff) + wait(prefill) + n / prefill_speed + exposed
    decode_only = fixed(decode_only) + wait(decode) + n / decode_side_speed

where ``exposed`` is what the KV's move adds after the prefill. Handed over whole (after the
prefill, as an export, a transfer and an import), all of it:

    exposed(whole)    = n * kv_bytes_per_token * (1/link + 1/copy)

Streamed (the overlapped handoff: each prompt chunk's KV leaves as soon as the chunk is
evaluated, and the decode side imports it as it lands), only what cannot overlap the prefill:
the last chunk (``chunk`` tokens, the prefill server's ``n_batch``), or more when the link is
slower than the prefill produces KV:

    exposed(streamed) = max(tail / link, n * kv_bytes_per_token / link - n / prefill_speed) + tail / copy
    tail              = min(n, chunk) * kv_bytes_per_token

Moving averages (``ALPHA``) follow a server that changes. Before anything is measured the
**prior** speaks: the prefill server is the fast machine by design (``PRIOR_PREFILL_SPEEDUP``
times the decode server's prompt speed) and the handoff costs one more round trip and a
transfer, so a prompt of a few tokens stays on the decode server and a long one is handed off.
A figure measured on one side stands in, through the same ratio, for the other side until that
is measured too.

This module knows nothing of HTTP or of the client: it takes figures and gives decisions.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from .metrics import ServerFigures

MODES = ("auto", "handoff", "decode_only")
HANDOFF, LOCAL = "handoff", "decode_only"
ALPHA = 0.3  # weight of the newest observation in the moving averages

# The cold-start prior (replaced by measurements as they come)
PRIOR_LOCAL_SPEED = 400.0  # tokens/s of prompt evaluation on a decode server
PRIOR_PREFILL_SPEEDUP = 4.0  # a prefill server evaluates prompts this many times faster
PRIOR_KV_BYTES_PER_TOKEN = 64 << 10
PRIOR_LINK_BYTES_PER_S = 1e9
PRIOR_COPY_BYTES_PER_S = 4e9  # export + checksum + import
PRIOR_FIXED = {HANDOFF: 0.05, LOCAL: 0.01}  # seconds: two requests and a transfer, against one request
PRIOR_CHARS_PER_TOKEN = 4.0
PRIOR_CHUNK_TOKENS = 512  # a prefill server's n_batch: the KV of its last chunk is what a stream leaves exposed
MIN_TOKENS_FOR_SPEED = 8  # shorter prompts say more about overheads than about speed
MIN_CHARS_FOR_RATIO = 256  # shorter prompts are mostly chat template: 7 characters can be 30 tokens


class Average:
    """An exponentially weighted moving average; ``None`` until the first value."""

    __slots__ = ("value", "count")

    def __init__(self):
        self.value, self.count = None, 0

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - ALPHA) * self.value + ALPHA * x
        self.count += 1


@dataclass(frozen=True)
class Decision:
    path: str  # "handoff" or "decode_only"
    reason: str
    estimates: dict  # {"handoff": s, "decode_only": s, "prompt_tokens": n, "basis": "measured" | "prior" | ...}

    def as_metrics(self) -> dict:
        return {"route": self.path, "route_reason": self.reason, "route_estimates": self.estimates}


def prompt_chars(source: dict) -> int:
    """Characters of a request's prompt part (prompt or messages, and system)."""
    n = len(source.get("prompt") or "") + len(source.get("system") or "")
    for message in source.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        n += len(content) if isinstance(content, str) else 0
    return n


class CostModel:
    """What the client has measured, and the estimates it makes from them. Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._figures: dict = {}

    def _avg(self, *key) -> Average:
        return self._figures.setdefault(key, Average())

    def _value(self, *key):
        avg = self._figures.get(key)
        return avg.value if avg is not None else None

    # -- learning -----------------------------------------------------------------------------

    def observe(self, model: str, chars: int, path: str, prefill: str | None, decode: str,
                pre: ServerFigures, dec: ServerFigures, ttft: float | None) -> None:
        """One answered request: ``pre``/``dec`` are the prefill and decode servers' metrics, ``ttft``
        the client's end-to-end time to first token."""
        with self._lock:
            tokens = dec.prompt_tokens or pre.prompt_tokens
            if tokens and chars >= MIN_CHARS_FOR_RATIO:
                self._avg("chars_per_token", model).add(chars / tokens)
            if (dec.completion_tokens or 0) >= MIN_TOKENS_FOR_SPEED and dec.decode_speed:
                self._avg("decode_speed", decode).add(float(dec.decode_speed))
            if path == HANDOFF:
                self._observe_handoff(model, prefill, decode, pre, dec, ttft)
            elif path == LOCAL:
                self._observe_local(decode, dec, ttft)

    def _observe_handoff(self, model, prefill, decode, pre, dec, ttft) -> None:
        evaluated = pre.prompt_tokens_evaluated or 0
        prefill_time = pre.prefill_time or 0.0
        if evaluated >= MIN_TOKENS_FOR_SPEED and prefill_time > 0:
            self._avg("prefill_speed", prefill).add(evaluated / prefill_time)
        if prefill_time > 0:
            self._avg("prefill_time", prefill).add(prefill_time)
        kv_bytes = dec.kv_bytes or 0
        # streamed: the time spent receiving the pieces (not waiting for the prefill); whole: the pull
        transfer = dec.kv_transfer_time or 0.0
        # export (streamed: the rows read chunk by chunk) + checksum + import: the KV's copies, per byte
        copy = sum(float(x or 0.0) for x in (pre.kv_export_time, pre.kv_read_time,
                                            pre.kv_checksum_time, dec.kv_load_time))
        held = max(0, (pre.prompt_tokens or 0) - 1) or evaluated  # the state covers cached tokens too
        if kv_bytes and held > 0:
            self._avg("kv_bytes_per_token", model).add(kv_bytes / held)
        if kv_bytes and transfer > 0:
            self._avg("link", prefill, decode).add(kv_bytes / transfer)
        if kv_bytes and copy > 0:
            self._avg("copy", model).add(kv_bytes / copy)
        streamed = dec.handoff_mode == "streamed"
        if streamed and pre.kv_chunk_tokens:
            self._avg("chunk_tokens", prefill).add(pre.kv_chunk_tokens)
        if ttft is not None:
            if streamed and kv_bytes and held > 0 and transfer > 0 and copy > 0:
                moved = _exposed(held, kv_bytes / held, prefill_time, kv_bytes / transfer, kv_bytes / copy,
                                 pre.kv_chunk_tokens or PRIOR_CHUNK_TOKENS)
            else:
                moved = transfer + copy
            parts = prefill_time + moved + float(dec.first_token_time or 0.0)
            self._avg("fixed", HANDOFF).add(max(0.0, ttft - parts))

    def _observe_local(self, decode, dec, ttft) -> None:
        # the tokens it evaluated (a prefix cache hit evaluates fewer than the prompt holds)
        tokens = dec.prompt_tokens_recomputed or dec.prompt_tokens or 0
        took = dec.prefill_time or 0.0
        if tokens >= MIN_TOKENS_FOR_SPEED and took > 0:
            self._avg("local_speed", decode).add(tokens / took)
        if took > 0:
            self._avg("local_time", decode).add(took)
        if ttft is not None:
            parts = took + float(dec.first_token_time or 0.0)
            self._avg("fixed", LOCAL).add(max(0.0, ttft - parts))

    # -- estimating ---------------------------------------------------------------------------

    def server_speeds(self, server: str) -> tuple[float | None, float | None]:
        """(prompt tokens/s, generated tokens/s) this client has measured on ``server`` (None: not yet):
        what the client expects of its answers (watch.py)."""
        with self._lock:
            return (self._value("prefill_speed", server) or self._value("local_speed", server),
                    self._value("decode_speed", server))

    def speeds(self, prefill: str | None, decode: str, reported: tuple = (None, None)) -> tuple[float, float, str]:
        """(prefill speed, decode-side prompt speed, basis): measured (by this client, or as the servers'
        ``/health`` reported them: ``reported``), one side through the prior's ratio, or the prior alone."""
        p = self._value("prefill_speed", prefill) or reported[0]
        d = self._value("local_speed", decode) or reported[1]
        if p and d:
            return p, d, "measured"
        if p:
            return p, p / PRIOR_PREFILL_SPEEDUP, "prefill measured, decode side by the prior's ratio"
        if d:
            return d * PRIOR_PREFILL_SPEEDUP, d, "decode side measured, prefill by the prior's ratio"
        return PRIOR_LOCAL_SPEED * PRIOR_PREFILL_SPEEDUP, PRIOR_LOCAL_SPEED, "prior"

    def estimate(self, model: str, chars: int, prefill: str | None, decode: str,
                 prefill_queue: int = 0, reported: tuple = (None, None), streamed: bool = False,
                 chunk_tokens: int | None = None, decode_queue: int = 0) -> dict:
        """Estimated seconds to first token of each path for a prompt of ``chars`` characters; with
        ``prefill_queue`` prompts ahead of this one on the prefill server and ``decode_queue`` on the
        decode server (each a recent prompt time of that server, this prompt's own until one is
        measured), and the prompt speeds the
        two servers ``reported`` (their ``/health``) standing in for figures not measured yet.
        ``streamed``: the handoff would be the overlapped one (its last ``chunk_tokens``, as the prefill
        server's ``/health`` says, or as measured, are what it leaves exposed)."""
        with self._lock:
            per_token = self._value("chars_per_token", model) or PRIOR_CHARS_PER_TOKEN
            n = max(1, round(chars / per_token))
            p_speed, d_speed, basis = self.speeds(prefill, decode, reported)
            bpt = self._value("kv_bytes_per_token", model) or PRIOR_KV_BYTES_PER_TOKEN
            link = self._value("link", prefill, decode) or PRIOR_LINK_BYTES_PER_S
            copy = self._value("copy", model) or PRIOR_COPY_BYTES_PER_S
            chunk = self._value("chunk_tokens", prefill) or chunk_tokens or PRIOR_CHUNK_TOKENS
            fixed_h = self._value("fixed", HANDOFF)
            fixed_l = self._value("fixed", LOCAL)
            prefill_each = self._value("prefill_time", prefill)
            local_each = self._value("local_time", decode)
        prefill_s = (n - 1) / p_speed
        wait = prefill_queue * (prefill_s if prefill_each is None else prefill_each)
        wait_local = decode_queue * ((n - 1) / d_speed if local_each is None else local_each)
        exposed = (_exposed(n - 1, bpt, prefill_s, link, copy, chunk) if streamed
                   else (n - 1) * bpt * (1 / link + 1 / copy))
        handoff = (PRIOR_FIXED[HANDOFF] if fixed_h is None else fixed_h) + wait + prefill_s + exposed
        local = (PRIOR_FIXED[LOCAL] if fixed_l is None else fixed_l) + wait_local + (n - 1) / d_speed
        return {HANDOFF: round(handoff, 6), LOCAL: round(local, 6), "prompt_tokens": n, "basis": basis,
                "prefill_speed": round(p_speed, 1), "decode_side_speed": round(d_speed, 1),
                "kv_bytes_per_token": round(bpt), "link_bytes_per_s": round(link), "prefill_wait": round(wait, 6),
                "decode_wait": round(wait_local, 6),
                "handoff_mode": "streamed" if streamed else "whole", "kv_exposed": round(exposed, 6)}

    def decide(self, mode: str, model: str, chars: int, prefill: str | None, decode: str | None,
               prefill_queue: int = 0, reported: tuple = (None, None), streamed: bool = False,
               chunk_tokens: int | None = None, decode_queue: int = 0) -> Decision:
        """The path for one request under ``mode`` (``client.route``), with the reason (``streamed``: the
        handoff would be the overlapped one)."""
        if mode == HANDOFF or (mode == "auto" and decode is None):
            return Decision(HANDOFF, f"forced: client.route is {mode!r}" if mode == HANDOFF
                            else "no decode server to estimate for", {})
        if mode == LOCAL:
            return Decision(LOCAL, "forced: client.route is 'decode_only'", {})
        if prefill is None:
            return Decision(LOCAL, "no prefill server up", {})
        est = self.estimate(model, chars, prefill, decode, prefill_queue, reported, streamed, chunk_tokens,
                            decode_queue)
        path = HANDOFF if est[HANDOFF] < est[LOCAL] else LOCAL
        reason = (f"estimated TTFT for ~{est['prompt_tokens']} prompt tokens: handoff ({est['handoff_mode']}) "
                  f"{est[HANDOFF] * 1000:.0f} ms, decode-only {est[LOCAL] * 1000:.0f} ms (speeds "
                  f"{est['prefill_speed']:.0f} vs {est['decode_side_speed']:.0f} tok/s, {est['basis']})")
        return Decision(path, reason, est)

    def snapshot(self) -> dict:
        """Every figure measured so far, for status pages and tests."""
        with self._lock:
            return {"/".join(str(k) for k in key): round(avg.value, 6) for key, avg in self._figures.items()}


def _exposed(tokens: int, bytes_per_token: float, prefill_s: float, link: float, copy: float, chunk: int) -> float:
    """Seconds a streamed handoff's KV adds after a prefill of ``prefill_s``: the last chunk's transfer (or
    the transfer's overrun, when the link is slower than the prefill makes KV) and that chunk's copies."""
    tail = min(tokens, chunk) * bytes_per_token
    return max(tail / link, tokens * bytes_per_token / link - prefill_s) + tail / copy
