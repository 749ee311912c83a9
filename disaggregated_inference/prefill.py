"""The prefill server: evaluate a prompt, hold its KV bundle under a lease, serve it to a decode server.

Endpoints: ``GET /health``, ``POST /prefill``, ``GET /kv/<handle>`` (the bundle,
binary, pulled by the decode server), ``DELETE /kv/<handle>`` (give a lease up).
"""
from __future__ import annotations

import logging
import time

from flask import Flask, Response, request

from . import bundle, sender, web
from .api import parse_prefill
from .lease import LeaseTable
from .settings import resolve

log = logging.getLogger(__name__)


def create_app(config=None, backend=None) -> Flask:
    settings = resolve(config, role="prefill")
    app = web.create_base_app(settings, backend, leases=LeaseTable(settings.lease_seconds))
    st = app.extensions["disagg"]

    @app.post("/prefill")
    def prefill():
        req = parse_prefill(web.json_body())
        web.check_model(req.model)
        started = time.perf_counter()
        result = st.owner.call(lambda backend: backend.prefill(req.prompt))
        t = time.perf_counter()
        crc = bundle.payload_checksum(result.payload)
        checksum_time = time.perf_counter() - t
        header = bundle.BundleHeader(
            kind=result.kind, n_tokens=len(result.tokens), payload_bytes=len(memoryview(result.payload)),
            payload_crc32c=crc, fingerprint=result.fingerprint, meta=result.meta,
        )
        framed = sender.frame_in_place(header, result.tokens, result.payload)
        lease = st.leases.put(header, result.tokens, result.payload, req.lease_seconds, framed=framed)
        base = (settings.data_url or request.host_url).rstrip("/")
        metrics = dict(result.metrics)
        metrics["kv_checksum_time"] = round(checksum_time, 6)
        metrics["server_time"] = round(time.perf_counter() - started, 6)
        st.metrics.prefill_seconds.observe(metrics.get("prefill_time", 0.0))
        if metrics.get("prefill_speed"):
            st.metrics.prefill_speed.observe(metrics["prefill_speed"])
        st.metrics.kv_bytes.inc(header.payload_bytes)
        log.info("prefill tokens=%d kv_bytes=%d time=%.3fs", len(result.tokens), header.payload_bytes,
                 metrics.get("prefill_time", 0.0))
        return web.json_response({
            "model": settings.model.name or settings.model.model,
            "server": settings.name,
            "prompt_tokens": len(result.tokens),
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
        })

    @app.get("/kv/<handle>")
    def kv(handle: str):
        lease = st.leases.get(handle)
        # fetched whole: freed now; a broken fetch keeps the lease (for a retry) until it expires
        body = sender.body(lease.header, lease.tokens, lease.payload, lease.framed, request.environ,
                           on_sent=lambda: st.leases.release(handle))
        headers = {
            "Content-Length": str(sender.content_length(lease.header, lease.framed)),
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

    return app
