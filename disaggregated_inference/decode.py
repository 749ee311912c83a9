"""The decode server: continue a prefilled prompt, or generate from scratch (fallback).

Endpoints: ``GET /health``; ``POST /decode`` (a prefill's KV reference, pulled
from the prefill server, or bare token ids, recomputed); ``POST /generate``
(prompt -> text entirely on this machine). Both answer JSON, or NDJSON with
``"stream": true``: one line per text piece, then a final line with metrics.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import time
from functools import partial

from flask import Flask

from . import fingerprint, web
from .api import parse_decode, parse_generate
from .backends.base import Received
from .buffers import BufferPool
from .bundle import KIND_TOKEN_IDS
from .errors import DisaggError
from .handoff import fetch
from .settings import resolve

log = logging.getLogger(__name__)


def _decode_job(received, sampling, pool, backend, cancelled):
    """Runs on the model thread. Nothing it yields leaves before the payload has passed its
    checksum (backends check right after importing; this holds for every backend), and the
    receive buffer goes back to the pool once neither the backend nor the checksum reads it."""
    buffer, verify = received.payload, received.verify
    try:
        for event in backend.decode(received, sampling, cancelled):
            verify()  # returns at once after the first time
            yield event
    finally:
        with contextlib.suppress(DisaggError):  # an error already on its way wins
            verify()
        pool.give(buffer)


def run_events(events, received_at: float, extra: dict, stream: bool, observe=lambda metrics: None):
    """Turn a backend's event stream into the JSON or NDJSON answer.

    ``ttft`` is measured here, from the moment the request arrived to the first
    token, so it includes KV transfer, queueing and import. A stream's answer
    starts with its first event: whatever fails before it (a KV that fails its
    checksum, a prompt too long for the context) is answered with its status
    code, and only what fails later becomes the stream's last line.
    """
    def finish(metrics: dict, first_at: float | None) -> dict:
        out = {**extra, **metrics}
        out["ttft"] = round(first_at - received_at, 6) if first_at is not None else None
        out["server_time"] = round(time.perf_counter() - received_at, 6)
        observe(out)
        return out

    if not stream:
        pieces, first_at, metrics = [], None, {}
        for event in events:
            if event.done:
                metrics = event.metrics
            else:
                first_at = first_at or time.perf_counter()
                pieces.append(event.piece)
        metrics = finish(metrics, first_at)
        return web.json_response({"generated_text": "".join(pieces), "finish_reason": metrics.pop("finish_reason", None),
                                  "metrics": metrics})

    head = next(events, None)  # errors before the first event propagate from here
    head_at = time.perf_counter()

    def lines():
        first_at = None
        try:
            for event in itertools.chain([head] if head is not None else [], events):
                if event.done:
                    metrics = finish(event.metrics, first_at)
                    yield {"done": True, "finish_reason": metrics.pop("finish_reason", None), "metrics": metrics}
                else:
                    first_at = first_at or (head_at if event is head else time.perf_counter())
                    yield {"text": event.piece, "done": False}
        except DisaggError as exc:
            yield {**exc.to_dict(), "done": True}
        except Exception as exc:  # the stream has started: report in-band, keep serving
            log.exception("stream failed")
            yield {"error": f"internal error: {type(exc).__name__}: {exc}", "code": "internal_error", "done": True}
        finally:
            events.close()
    return web.ndjson(lines())


def create_app(config=None, backend=None) -> Flask:
    settings = resolve(config, role="decode")
    app = web.create_base_app(settings, backend)
    st = app.extensions["disagg"]
    # receive buffers stay mapped (and faulted in) between handoffs: fresh memory faults on every page
    pool = st.receive_buffers = BufferPool(idle_seconds=settings.kv_buffer_idle_seconds)
    st.metrics.watch_receive_buffers(pool)

    @app.post("/decode")
    def decode():
        received_at = time.perf_counter()
        req = parse_decode(web.json_body())
        web.check_model(req.model)
        st.owner.require_ready()  # fail before pulling a bundle we could not use
        extra: dict = {}
        if req.kv is not None:
            received, extra = fetch(req.kv, timeout=settings.kv_fetch_timeout,
                                    connect_timeout=settings.connect_timeout, api_token=settings.api_token,
                                    max_bytes=settings.max_kv_bytes, pool=pool,
                                    socket_buffer=settings.kv_socket_buffer_bytes)
            st.metrics.kv_bytes.inc(extra["kv_bytes"])
            st.metrics.kv_transfer_seconds.observe(extra["kv_transfer_time"])
            if extra["kv_transfer_time"] > settings.slow_transfer_seconds:
                st.metrics.slow_transfers.inc()
                log.warning("slow KV transfer: bytes=%d seconds=%.3f url=%s (continuing)", extra["kv_bytes"],
                            extra["kv_transfer_time"], req.kv.url)
        else:
            received = Received(KIND_TOKEN_IDS, list(req.tokens), b"", req.fingerprint or {})
            extra = {"kv_bytes": 0, "kv_transfer_time": 0.0}
        ours = st.backend.fingerprint()
        if req.kv is not None or req.fingerprint:
            fingerprint.check(ours, received.fingerprint)
        extra["handoff"] = received.kind
        extra["kv_fetch_to_queue_time"] = round(time.perf_counter() - received_at, 6)
        # the job holds the only reference to the bundle; the backend drops its payload once imported
        events = st.owner.stream(partial(_decode_job, received, req.sampling, pool))
        del received
        return run_events(events, received_at, extra, req.stream, st.metrics.observe_decode)

    @app.post("/generate")
    def generate():
        received_at = time.perf_counter()
        req = parse_generate(web.json_body())
        web.check_model(req.model)
        events = st.owner.stream(lambda backend, cancelled: backend.generate(req.prompt, req.sampling, cancelled))
        st.metrics.fallbacks.inc()
        return run_events(events, received_at, {"handoff": "none", "kv_bytes": 0}, req.stream,
                          st.metrics.observe_decode)

    return app
