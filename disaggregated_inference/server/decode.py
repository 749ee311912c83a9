"""The decode server: continue a prefilled prompt, or generate from scratch (fallback).

Endpoints: ``GET /health``; ``POST /decode`` (a prefill's KV reference, pulled
from the prefill server, or bare token ids, recomputed); ``POST /generate``
(prompt -> text entirely on this machine). Both answer JSON, or NDJSON with
``"stream": true``: one line per text piece, then a final line with metrics;
with ``"progress": true`` as well, heartbeat lines until the first piece and
between slow ones, and errors as the last line (``progress.py``).

A model that reasons or calls tools (its chat format reads them apart, chat/)
answers them beside the text: ``reasoning`` (its chain of thought, never in
``generated_text``) and ``tool_calls`` (``{"name", "arguments"}``, the
arguments as JSON text); a stream has ``{"reasoning": ...}`` and
``{"tool_call": ...}`` lines between its ``{"text": ...}`` lines.

A streamed KV reference (``kv.mode: "streamed"``, the overlapped handoff) is
pulled while the prefill server still evaluates the prompt: its fingerprint is
checked as soon as its header is in, and a backend that imports as the pieces
arrive (llama.cpp) gets the job before the pull ends (the request thread pumps
the pieces in and wakes the model's owner after each); any other receives it
whole first. The prefill's own measurements come with the stream's trailer and
go into the answer's metrics as ``prefill_metrics``.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import time
from functools import partial

from flask import Flask

from . import probe, progress, web
from ..kv import fingerprint, trust
from .parse import parse_decode, parse_generate
from ..backends.base import Event, Received
from ..kv.buffers import BufferPool
from ..kv.bundle import KIND_NEUTRAL_KV, KIND_TOKEN_IDS
from ..errors import BadRequest, CanaryMismatch, DisaggError
from ..kv.receive import fetch
from .settings import resolve
from ..metrics import ServerFigures
from ..wire import DecodeAnswer, Final, Piece

log = logging.getLogger(__name__)


def _decode_job(received, sampling, pool, metrics, backend, cancelled):
    """Runs on the model thread. Nothing it yields leaves before the payload has passed its
    checksum (backends check right after importing; this holds for every backend), and the
    receive buffer goes back to the pool once neither the backend nor the checksum reads it.
    A canary that fails (the backend raises before its first event) is counted here."""
    buffer, verify, incoming = received.payload, received.verify, received.incoming
    try:
        for event in backend.decode(received, sampling, cancelled):
            if isinstance(event, Event):  # what leaves the server (not an Eval or Wait for the owner)
                verify()  # returns at once after the first time
            yield event
    except CanaryMismatch as exc:
        metrics.observe_canary_failure(exc.details.get("canary_divergence"))
        log.warning("canary failed, nothing generated: %s", exc.message)
        raise
    finally:
        with contextlib.suppress(DisaggError):  # an error already on its way wins
            verify()
        if incoming is not None and not incoming.finished:
            incoming.abandon()  # the pull stops at its next frame and hangs up: the prefill server stops too
        if incoming is None or incoming.closed:  # a pull still writing into the buffer keeps it
            pool.give(buffer)


def check_supported(sampling, backend) -> None:
    """400 for a sampling option this server's backend would otherwise silently not honour."""
    if sampling.ignore_eos and not backend.ignores_eos:
        raise BadRequest(f"'ignore_eos' is not supported by the {backend.name} backend", field="ignore_eos")


def vocabulary_size(backend) -> int | None:
    """The backend's vocabulary size, where its fingerprint or description gives one (``n_vocab``)."""
    for facts in (backend.fingerprint(), backend.describe()):
        size = facts.get("n_vocab") if isinstance(facts, dict) else None
        if isinstance(size, int) and size > 0:
            return size
    return None


def check_vocabulary(tokens, backend) -> None:
    """Token ids beyond the vocabulary are a 400 naming ``tokens``, before anything is queued."""
    size = vocabulary_size(backend)
    if size is not None and max(tokens) >= size:
        raise BadRequest(f"'tokens' holds id {max(tokens)}, beyond this model's vocabulary of {size}", field="tokens")


def _finish(figures: ServerFigures, extra: ServerFigures, first_at: float | None, received_at: float,
            observe) -> ServerFigures:
    """The engine's figures over this server's (``extra``), with the times measured here."""
    out = extra.with_(**figures.given()).with_(
        ttft=round(first_at - received_at, 6) if first_at is not None else None,
        server_time=round(time.perf_counter() - received_at, 6))
    observe(out)
    return out


def event_lines(events, received_at: float, extra: ServerFigures, observe, status=None, head=None,
                first_at: float | None = None):
    """A backend's events as NDJSON lines: ``{"text", "done": false}`` per piece (``reasoning`` and
    ``tool_call`` lines for those, ``_line``), then ``{"done": true,
    "finish_reason", "metrics"}``; counts the pieces in ``status`` (a request's Progress), if given.
    ``head``: the first event, taken from ``events`` before these lines began (at ``first_at``)."""
    try:
        for event in itertools.chain([head] if head is not None else [], events):
            if event.done:
                metrics = _finish(event.metrics, extra, first_at, received_at, observe)
                yield Final(metrics.finish_reason, metrics.without("finish_reason")).write()
            else:
                first_at = first_at or time.perf_counter()
                if status is not None:
                    status.phase, status.generated = "decode", status.generated + 1
                yield _line(event)
    finally:
        events.close()


def run_events(events, received_at: float, extra: ServerFigures, stream: bool, observe=lambda figures: None):
    """Turn a backend's event stream into the JSON or NDJSON answer.

    ``ttft`` is measured here, from the moment the request arrived to the first
    token, so it includes KV transfer, queueing and import. A stream's answer
    starts with its first event: whatever fails before it (a KV that fails its
    checksum, a prompt too long for the context) is answered with its status
    code, and only what fails later becomes the stream's last line.
    """
    if not stream:
        pieces, reasoning, calls, first_at, metrics = [], [], [], None, ServerFigures()
        for event in events:
            if event.done:
                metrics = event.metrics
                continue
            first_at = first_at or time.perf_counter()
            if event.reasoning is not None:
                reasoning.append(event.reasoning)
            elif event.tool_call is not None:
                calls.append(event.tool_call)
            else:
                pieces.append(event.piece)
        metrics = _finish(metrics, extra, first_at, received_at, observe)
        return web.json_response(DecodeAnswer("".join(pieces), metrics.finish_reason, metrics.without("finish_reason"),
                                              "".join(reasoning) or None, calls or None).write())

    head = next(events, None)  # errors before the first event propagate from here
    head_at = time.perf_counter() if head is not None and not head.done else None

    def lines():
        try:
            yield from event_lines(events, received_at, extra, observe, head=head, first_at=head_at)
        except Exception as exc:  # the stream has started: report in-band, keep serving
            yield progress.error_line(exc)
        finally:
            events.close()
    return web.ndjson(lines())


def _line(event) -> dict:
    """A stream's line for one piece of a generation: of the answer, of the reasoning, or a tool call."""
    return Piece(text=event.piece, reasoning=event.reasoning, tool_call=event.tool_call).write()


def decode():
    """``POST /decode``."""
    st = web.state()
    settings = st.settings
    received_at = time.perf_counter()
    req = parse_decode(web.json_body(), web.request_limits())
    web.check_model(req.model)
    check_supported(req.sampling, st.backend)
    if req.kv is not None:  # before anything else: an untrusted URL is never contacted
        trust.check_source(req.kv.url, settings.trusted_kv_sources)
    if req.tokens is not None:
        check_vocabulary(req.tokens, st.backend)
    return answer(st, req, received_at, lambda status: decoding(st, req, received_at, status))


def answer(st, req, received_at: float, start):
    """``start(status) -> (events, extra)`` answered as the request asked: with heartbeats (``progress``:
    the whole of it runs on a helper thread), as a stream, or whole."""
    if req.progress:
        def work(status):
            events, extra = start(status)
            return event_lines(events, received_at, extra, st.metrics.observe_decode, status)
        return web.ndjson(progress.lines(work))
    events, extra = start(progress.Progress())
    return run_events(events, received_at, extra, req.stream, st.metrics.observe_decode)


def decoding(st, req, received_at: float, status):
    pool = st.receive_buffers
    # a slot first: a server that cannot serve the request now must not consume the lease
    status.phase = "queued"
    reservation = st.owner.reserve()
    try:
        status.phase = "fetching"
        received, extra = _receive(st, req)
        incoming = received.incoming
        if incoming is not None and received.kind not in st.backend.imports_streamed:
            extra = _pump(st, incoming, extra)  # this backend takes the bundle whole: all of it first
            received.incoming = incoming = None
    except BaseException:
        reservation.release()
        raise
    if incoming is not None and received.kind not in st.backend.accepts:
        incoming.close()  # let the backend refuse it (409) without pulling the rest
    extra = extra.with_(queue_time=round(reservation.waited, 6), handoff=received.kind,
                        kv_fetch_to_queue_time=round(time.perf_counter() - received_at, 6))
    if received.kind == KIND_TOKEN_IDS:  # the prompt is evaluated here
        status.phase, status.tokens = "prefill", max(0, len(received.tokens) - 1)
    else:
        status.phase = "importing"
    if incoming is not None:
        incoming.on_change = st.owner.wake  # the job parks until pieces are in
    # the job holds the only reference to the bundle; the backend drops its payload once imported
    events = st.owner.stream(partial(_decode_job, received, req.sampling, pool, st.metrics), reservation, status)
    del received
    if incoming is not None:  # the rest of the stream, read here while the model's thread imports it
        try:
            extra = _pump(st, incoming, extra)
        except BaseException:
            events.close()  # the job stops; its cleanup leaves nothing imported
            raise
    return events, extra


def _pump(st, incoming, extra: ServerFigures) -> ServerFigures:
    """Read a streamed bundle to its end: ``extra`` with its figures (and the prefill's, from its trailer)."""
    incoming.pump()
    extra = extra.with_(**incoming.stats().given())
    if isinstance(incoming.trailer.get("metrics"), dict):
        extra = extra.with_(prefill_metrics=ServerFigures.from_dict(incoming.trailer["metrics"]))
    _observe_transfer(st, extra, incoming.ref)
    return extra


def _receive(st, req):
    settings, pool = st.settings, st.receive_buffers
    if req.kv is not None:
        received, extra = fetch(req.kv, timeout=settings.kv_fetch_timeout,
                                connect_timeout=settings.connect_timeout, api_token=settings.api_token,
                                max_bytes=settings.max_kv_bytes, pool=pool,
                                socket_buffer=settings.kv_socket_buffer_bytes,
                                sources=settings.trusted_kv_sources,
                                progress_timeout=settings.kv_progress_timeout, room=st.backend.receive_room(),
                                streamed=True)
        if received.incoming is None:
            extra = extra.with_(handoff_mode="whole")
            _observe_transfer(st, extra, req.kv)
    else:
        received = Received(KIND_TOKEN_IDS, list(req.tokens), b"", req.fingerprint or {})
        extra = ServerFigures(kv_bytes=0, kv_transfer_time=0.0)
    ours = st.backend.fingerprint()
    # a neutral bundle may come from another engine: the backend checks the weights it names (meta.neutral.model)
    if (req.kv is not None or req.fingerprint) and received.kind != KIND_NEUTRAL_KV:
        try:  # a streamed bundle's fingerprint, before any of its pieces is used
            fingerprint.check(ours, received.fingerprint)
        except BaseException:
            if received.incoming is not None:
                received.incoming.close()
            raise
    # bare ids ("tokens"/"context") without a fingerprint: nothing says which tokenizer made them
    extra = extra.with_(fingerprint_checked=bool(req.kv is not None or req.fingerprint))
    return received, extra


def _observe_transfer(st, extra: ServerFigures, ref) -> None:
    settings = st.settings
    st.metrics.observe_pull(ref.url, extra.kv_bytes, extra.kv_transfer_time)
    if extra.kv_transfer_time > settings.slow_transfer_seconds:
        st.metrics.slow_transfers.inc()
        log.warning("slow KV transfer: bytes=%d seconds=%.3f url=%s (continuing)", extra.kv_bytes,
                    extra.kv_transfer_time, ref.url)


def generate():
    """``POST /generate``."""
    st = web.state()
    received_at = time.perf_counter()
    req = parse_generate(web.json_body(), web.request_limits())
    web.check_model(req.model)
    check_supported(req.sampling, st.backend)
    return answer(st, req, received_at, lambda status: generating(st, req, status))


def generating(st, req, status):
    status.phase = "tokenizing"  # on this request's thread, never the model's
    prompt, tokenize_time = web.tokenized(st, req.prompt)
    status.phase, status.tokens = "queued", len(prompt.tokens) - 1 if prompt.tokens is not None else None
    events = st.owner.stream(lambda backend, cancelled: backend.generate(prompt, req.sampling, cancelled),
                             progress=status)
    status.phase = "prefill"
    st.metrics.decode_only.inc()
    return events, ServerFigures(handoff="none", kv_bytes=0, queue_time=round(events.queue_time, 6),
                                 tokenize_time=tokenize_time)


def create_app(config=None, backend=None) -> Flask:
    settings = resolve(config, role="decode")
    app = web.create_base_app(settings, backend)
    st = app.extensions["disagg"]
    # receive buffers stay mapped (and faulted in) between handoffs: fresh memory faults on every page
    pool = st.receive_buffers = BufferPool(idle_seconds=settings.kv_buffer_idle_seconds)
    st.metrics.watch_receive_buffers(pool)
    app.add_url_rule("/decode", view_func=decode, methods=["POST"])
    app.add_url_rule("/generate", view_func=generate, methods=["POST"])
    probe.register_decode(app, settings, st.metrics)  # POST /kv/probe: measure the path from a prefill server
    return app
