"""The prefill server: evaluate a prompt, hold its KV bundle under a lease, serve it to a decode server.

Endpoints: ``GET /health``, ``POST /prefill``, ``GET /kv/<handle>`` (the bundle,
binary, pulled by the decode server), ``DELETE /kv/<handle>`` (give a lease up).
``/prefill`` with ``"progress": true`` answers NDJSON: heartbeats while the request
waits and its prompt is evaluated, then the answer (``progress.py``).

``/prefill`` with ``"handoff_mode": "streamed"`` (what the client asks for) is the
overlapped handoff where the model allows it: the answer comes as soon as the
prompt is tokenized and its slot taken, and ``/kv/<handle>`` streams the KV while
the prompt is evaluated (``kv/stream.py``). Without it, or for a model whose KV
cannot be streamed (the answer's ``handoff_mode_reason`` says why), the answer
comes after the export, with the whole bundle leased.
"""
from __future__ import annotations

import inspect
import logging
import time

from flask import Flask, Response, request

from . import probe, progress, web
from ..errors import BadRequest, DisaggError, NotFound
from ..kv import bundle, send
from ..kv.stream import DONE, StreamingBundle
from .parse import parse_prefill
from ..kv.lease import LeaseTable
from .settings import resolve
from ..metrics import ServerFigures
from ..wire import KVRef, PrefillAnswer

log = logging.getLogger(__name__)


def as_kind(backend, result, kind: str | None):
    """The prefilled result as the bundle kind the decode side asked for (``kv_kind``): converted by the
    backend after its export (llama.cpp state -> ``neutral_kv``, kv/convert.py); a conversion it cannot
    make is refused, naming ``kv_kind``."""
    if kind is None or kind == result.kind:
        return result
    started = time.perf_counter()
    converted = backend.convert(result, kind)
    if converted is None:
        raise BadRequest(f"this {backend.name} prefill server hands over {result.kind!r}; it cannot convert it to "
                         f"{kind!r}", field="kv_kind")
    converted.metrics = converted.metrics.with_(kv_convert_time=round(time.perf_counter() - started, 6),
                                                kv_state_bytes=result.metrics.kv_bytes, kv_bytes=len(converted.payload))
    return converted


def streaming_refused(owner, req) -> str | None:
    """Why this request's KV is handed over whole although it asked for a stream (None: it streams).
    The backend's check runs once, on the model's thread, at the first request that asks."""
    backend = owner.backend
    if req.kv_kind not in (None, backend.handoff_kind):
        return f"the KV is converted to {req.kv_kind!r} after the prefill"
    streaming = getattr(backend, "kv_streaming", None)
    if not streaming:
        return f"the {backend.name} backend does not stream its KV"
    if streaming.get("enabled") is None:
        streaming = owner.call(lambda backend: backend.probe_kv_streaming())
    return None if streaming.get("enabled") else streaming.get("reason") or "streaming is off"


def _error_frame(exc: BaseException) -> tuple[int, str]:
    """What an error frame says of a prefill that failed half-way: a status-like code and a message."""
    if isinstance(exc, DisaggError):
        return exc.status, exc.message
    if isinstance(exc, GeneratorExit):
        return 499, "the prefill was cancelled"
    return 500, f"{type(exc).__name__}: {exc}"


def prefill_streamed(st, req, prompt, tokenize_time, reservation, started: float, base: str, status):
    """Answer once the prompt is tokenized and its slot taken; the KV leaves as it is evaluated."""
    settings = st.settings
    streaming = StreamingBundle()

    def job(backend, cancelled):
        try:
            out = backend.prefill(prompt, kv_stream=streaming)
            result = (yield from out) if inspect.isgenerator(out) else out
        except BaseException as exc:
            streaming.fail(*_error_frame(exc), failure=exc)
            raise
        st.metrics.observe_prefill(result.metrics, len(memoryview(result.payload).cast("B")))
        trailer_meta = {k: v for k, v in result.meta.items() if k not in streaming.header.meta}
        streaming.finish({"meta": trailer_meta, "metrics": result.metrics.as_dict()})

    events = st.owner.stream(job, reservation, status)  # closing it cancels the prefill
    try:
        streaming.wait_open(settings.queue_timeout + settings.kv_fetch_timeout)
        lease = st.leases.put(streaming.header, streaming.tokens, streaming.payload, req.lease_seconds,
                              streaming=streaming)  # 503 when its KV would not fit under max_lease_bytes
    except BaseException:
        events.close()
        raise

    def abandoned() -> None:  # the pull broke off, or the lease was given up: stop, free it all
        events.close()
        st.leases.release(lease.handle, why="abandoned")

    def settled(state: str) -> None:
        if state == DONE:
            st.leases.start_clock(lease.handle, req.lease_seconds)
        else:
            st.leases.release(lease.handle, why="failed")

    streaming.on_abandoned = abandoned
    streaming.on_settled(settled)
    header = streaming.header
    metrics = ServerFigures(queue_time=round(reservation.waited, 6),
                            server_time=round(time.perf_counter() - started, 6), handoff_mode="streamed",
                            tokenize_time=tokenize_time)
    return answer(st, base, header, streaming.tokens, lease, metrics, {
        "crc32c": None, "sent_as": "stream", "mode": "streamed", "expires_at": None,
        "lease_seconds": req.lease_seconds or st.leases.ttl})


def answer(st, base: str, header, tokens, lease, metrics: ServerFigures, kv: dict) -> dict:
    settings = st.settings
    ref = KVRef(url=f"{base}/kv/{lease.handle}", handle=lease.handle, bytes=header.payload_bytes,
                crc32c=kv["crc32c"], streamed=kv["mode"] == "streamed", kind=header.kind, sent_as=kv["sent_as"],
                expires_at=kv["expires_at"], lease_seconds=kv["lease_seconds"])
    return PrefillAnswer(
        kv=ref,
        # the prompt's token ids (the design documents' "context"): POST /decode {"context": ...}
        # continues from them by recomputing the prompt; "kv" hands over the KV itself
        context=tuple(int(t) for t in tokens),
        metrics=metrics,
        prompt_tokens=len(tokens),
        model=st.backend.served_model(),  # as /health names it; "model_key" is the config's key
        model_key=settings.model.name,
        server=settings.name,
        fingerprint=header.fingerprint,
        handoff_mode=metrics.handoff_mode,
        handoff_mode_reason=metrics.handoff_mode_reason,
    ).write()


def prefill():
    """``POST /prefill``."""
    st = web.state()
    settings = st.settings
    req = parse_prefill(web.json_body(), web.request_limits(), settings.max_lease_seconds)
    web.check_model(req.model)
    st.leases.check_room()  # 503 before the work when the held KV is already at its cap
    base = (settings.data_url or request.host_url).rstrip("/")
    if req.progress:  # heartbeats until the answer, which is the last line
        return web.ndjson(progress.lines(lambda status: iter([{**prefilled(st, req, base, status), "done": True}])))
    return web.json_response(prefilled(st, req, base, progress.Progress()))


def prefilled(st, req, base: str, status: progress.Progress) -> dict:
    """Tokenize (here, on the request's thread), wait for a slot, evaluate, lease the KV: the answer."""
    started = time.perf_counter()
    refused = streaming_refused(st.owner, req) if req.handoff_mode == "streamed" else None
    status.phase = "tokenizing"
    prompt, tokenize_time = web.tokenized(st, req.prompt)
    status.phase, status.tokens = "queued", len(prompt.tokens) if prompt.tokens is not None else None
    reservation = st.owner.reserve()
    status.phase = "prefill"
    if req.handoff_mode == "streamed" and refused is None:
        return prefill_streamed(st, req, prompt, tokenize_time, reservation, started, base, status)
    result = st.owner.call(lambda backend: backend.prefill(prompt), reservation, status)
    # a conversion the decode side asked for runs here, on the request's thread, not the model's
    result = as_kind(st.backend, result, req.kv_kind)
    t = time.perf_counter()
    crc = bundle.payload_checksum(result.payload)
    checksum_time = time.perf_counter() - t
    header = bundle.BundleHeader(
        kind=result.kind, n_tokens=len(result.tokens), payload_bytes=len(memoryview(result.payload)),
        payload_crc32c=crc, fingerprint=result.fingerprint, meta=result.meta,
    )
    framed = send.frame_in_place(header, result.tokens, result.payload)
    lease = st.leases.put(header, result.tokens, result.payload, req.lease_seconds, framed=framed)
    metrics = result.metrics.with_(kv_checksum_time=round(checksum_time, 6), queue_time=round(reservation.waited, 6),
                                   server_time=round(time.perf_counter() - started, 6), handoff_mode="whole")
    if tokenize_time is not None:
        metrics = metrics.with_(tokenize_time=tokenize_time)
    if refused:
        metrics = metrics.with_(handoff_mode_reason=refused)
    st.metrics.observe_prefill(metrics, header.payload_bytes)
    log.info("prefill tokens=%d kv_bytes=%d time=%.3fs", len(result.tokens), header.payload_bytes,
             metrics.prefill_time or 0.0)
    return answer(st, base, header, result.tokens, lease, metrics, {
        "crc32c": crc, "sent_as": "sendfile" if framed is not None else "frames", "mode": "whole",
        "expires_at": lease.expires_at, "lease_seconds": round(lease.expires_at - time.time(), 3)})


def kv(handle: str):
    """``GET /kv/<handle>``: the bundle, pulled by a decode server."""
    st = web.state()
    lease = st.leases.get(handle)
    if lease.streaming is not None:  # the overlapped handoff: one pull, pieces as they become final
        if not lease.streaming.claim():
            raise NotFound(f"KV bundle {handle} is already being fetched", field="handle")
        body = lease.streaming.frames(on_sent=lambda: st.leases.release(handle))
        headers = {"X-KV-Bytes": str(lease.header.payload_bytes), "X-KV-Kind": lease.header.kind,
                   "X-KV-Mode": "streamed"}
        return Response(body, mimetype=bundle.CONTENT_TYPE, headers=headers, direct_passthrough=True)
    # fetched whole: freed now; a broken fetch keeps the lease (for a retry) until it expires
    body = send.body(lease.header, lease.tokens, lease.payload, lease.framed, request.environ,
                       on_sent=lambda: st.leases.release(handle))
    headers = {
        "Content-Length": str(send.content_length(lease.header, lease.framed)),
        "X-KV-Bytes": str(lease.header.payload_bytes),
        "X-KV-CRC32C": str(lease.header.payload_crc32c),
        "X-KV-Kind": lease.header.kind,
    }
    return Response(body, mimetype=bundle.CONTENT_TYPE, headers=headers, direct_passthrough=True)


def kv_release(handle: str):
    """``DELETE /kv/<handle>``: a lease given up."""
    st = web.state()
    lease = st.leases.get(handle)  # 404/410 if it is not there
    st.leases.release(handle, why="released")
    if lease.streaming is not None:  # a prefill still running for it is cancelled
        lease.streaming.abandon()
    return web.json_response({"released": handle})


def create_app(config=None, backend=None) -> Flask:
    settings = resolve(config, role="prefill")
    app = web.create_base_app(settings, backend, leases=LeaseTable(settings.lease_seconds, max_bytes=settings.max_lease_bytes))
    app.add_url_rule("/prefill", view_func=prefill, methods=["POST"])
    app.add_url_rule("/kv/<handle>", view_func=kv, methods=["GET"])
    app.add_url_rule("/kv/<handle>", view_func=kv_release, methods=["DELETE"])
    probe.register_prefill(app)  # GET /kv/probe?bytes=N: a test blob for disagg doctor

    return app
