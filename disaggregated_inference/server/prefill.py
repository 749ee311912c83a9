"""The prefill server: evaluate a prompt, hold its KV bundle under a lease, serve it to a decode server.

Endpoints: ``GET /health``, ``POST /prefill``, ``GET /kv/<handle>`` (the bundle,
binary, pulled by the decode server), ``DELETE /kv/<handle>`` (give a lease up).
``/prefill`` with ``"progress": true`` answers NDJSON: heartbeats while the request
waits and its prompt is evaluated, then the answer (``progress.py``).
"""
from __future__ import annotations

import logging
import time

from flask import Flask, Response, request

from . import probe, progress, web
from ..errors import BadRequest
from ..kv import bundle, send
from .parse import parse_prefill
from ..kv.lease import LeaseTable
from .settings import resolve

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
    converted.metrics["kv_convert_time"] = round(time.perf_counter() - started, 6)
    converted.metrics["kv_state_bytes"] = result.metrics.get("kv_bytes")
    converted.metrics["kv_bytes"] = len(converted.payload)
    return converted


def create_app(config=None, backend=None) -> Flask:
    settings = resolve(config, role="prefill")
    app = web.create_base_app(settings, backend, leases=LeaseTable(settings.lease_seconds, max_bytes=settings.max_lease_bytes))
    st = app.extensions["disagg"]

    @app.post("/prefill")
    def prefill():
        req = parse_prefill(web.json_body(), web.request_limits(), settings.max_lease_seconds)
        web.check_model(req.model)
        st.leases.check_room()  # 503 before the work when the held KV is already at its cap
        base = (settings.data_url or request.host_url).rstrip("/")
        if req.progress:  # heartbeats until the answer, which is the last line
            return web.ndjson(progress.lines(lambda status: iter([{**prefilled(req, base, status), "done": True}])))
        return web.json_response(prefilled(req, base, progress.Progress()))

    def prefilled(req, base: str, status: progress.Progress) -> dict:
        """Tokenize (here, on the request's thread), wait for a slot, evaluate, lease the KV: the answer."""
        started = time.perf_counter()
        status.phase = "tokenizing"
        prompt, tokenize_time = web.tokenized(st, req.prompt)
        status.phase, status.tokens = "queued", len(prompt.tokens) if prompt.tokens is not None else None
        reservation = st.owner.reserve()
        status.phase = "prefill"
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
        metrics = dict(result.metrics)
        if tokenize_time is not None:
            metrics["tokenize_time"] = tokenize_time
        metrics["kv_checksum_time"] = round(checksum_time, 6)
        metrics["queue_time"] = round(reservation.waited, 6)
        metrics["server_time"] = round(time.perf_counter() - started, 6)
        st.metrics.observe_prefill(metrics, header.payload_bytes)
        log.info("prefill tokens=%d kv_bytes=%d time=%.3fs", len(result.tokens), header.payload_bytes,
                 metrics.get("prefill_time", 0.0))
        return {
            "model": st.backend.served_model(),  # as /health names it; "model_key" is the config's key
            "model_key": settings.model.name,
            "server": settings.name,
            "prompt_tokens": len(result.tokens),
            # the prompt's token ids (the design documents' "context"): POST /decode {"context": ...}
            # continues from them by recomputing the prompt; "kv" below hands over the KV itself
            "context": [int(t) for t in result.tokens],
            "handoff": result.kind,
            "metrics": metrics,
            "fingerprint": result.fingerprint,
            "kv": {
                "url": f"{base}/kv/{lease.handle}",
                "handle": lease.handle,
                "kind": result.kind,
                "bytes": header.payload_bytes,
                "crc32c": crc,
                "sent_as": "sendfile" if framed is not None else "frames",
                "expires_at": lease.expires_at,
                "lease_seconds": round(lease.expires_at - time.time(), 3),
            },
        }

    @app.get("/kv/<handle>")
    def kv(handle: str):
        lease = st.leases.get(handle)
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

    @app.delete("/kv/<handle>")
    def kv_release(handle: str):
        st.leases.get(handle)  # 404/410 if it is not there
        st.leases.release(handle, why="released")
        return web.json_response({"released": handle})

    probe.register_prefill(app)  # GET /kv/probe?bytes=N: a test blob for disagg doctor

    return app
