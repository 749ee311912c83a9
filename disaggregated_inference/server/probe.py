"""Measuring the KV data path before the first request (``disagg doctor``).

- prefill server: ``GET /kv/probe?bytes=N`` answers N bytes (at most ``MAX_PROBE_BYTES``) from
  the endpoint family the decode servers pull KV bundles from, behind the same API token.
- decode server: ``POST /kv/probe {"url": "<prefill>/kv/probe?bytes=N"}`` pulls that blob the
  way it pulls a bundle (its own connection, its own token) and answers how long it took, so the
  figure is the path from that prefill server to that decode server, not to the operator's laptop.
  Only URLs whose path ends in ``/kv/probe`` are fetched.
"""
from __future__ import annotations

import http.client
import time
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from flask import Response, request

from ..errors import BadRequest, UpstreamError, UpstreamTimeout

MAX_PROBE_BYTES = 64 << 20
DEFAULT_PROBE_BYTES = 4 << 20
_CHUNK = bytes(1 << 20)  # gunicorn writes bytes only, not memoryviews


@dataclass(frozen=True)
class ProbePull:
    url: str
    n_bytes: int


def parse_probe_bytes(args) -> int:
    raw = args.get("bytes", str(DEFAULT_PROBE_BYTES))
    try:
        n = int(raw)
    except ValueError:
        raise BadRequest(f"'bytes' must be an integer, got {raw!r}", field="bytes") from None
    if not 0 <= n <= MAX_PROBE_BYTES:
        raise BadRequest(f"'bytes' must be 0..{MAX_PROBE_BYTES}, got {n}", field="bytes")
    return n


def parse_probe_pull(body: dict) -> ProbePull:
    url = body.get("url")
    if not isinstance(url, str) or not url:
        raise BadRequest("'url' must be the prefill server's /kv/probe URL", field="url")
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or not parts.path.endswith("/kv/probe"):
        raise BadRequest(f"'url' must be an http URL ending in /kv/probe, got {url!r}", field="url")
    n_bytes = parse_probe_bytes({k: v[-1] for k, v in parse_qs(parts.query).items()})
    return ProbePull(url, n_bytes)


def register_prefill(app) -> None:
    @app.get("/kv/probe")
    def kv_probe():
        n = parse_probe_bytes(request.args)

        def body():
            left = n
            while left:
                piece = _CHUNK if left >= len(_CHUNK) else _CHUNK[:left]
                left -= len(piece)
                yield piece

        return Response(body(), mimetype="application/octet-stream", headers={"Content-Length": str(n)},
                        direct_passthrough=True)


def register_decode(app, settings, metrics) -> None:
    """``POST /kv/probe``; the result is kept as that path's capacity (``metrics.observe_probe``: the
    ``disagg_kv_probe_bytes_per_second`` gauge and ``/health``'s ``kv_probes``) for the dashboards."""
    from . import web

    @app.post("/kv/probe")
    def kv_probe_pull():
        req = parse_probe_pull(web.json_body())
        result = pull(req, settings.api_token, settings.connect_timeout, settings.kv_fetch_timeout)
        metrics.observe_probe(req.url, result)
        return web.json_response(result)


def pull(req: ProbePull, api_token: str | None, connect_timeout: float, timeout: float) -> dict:
    parts = urlsplit(req.url)
    headers = {"Authorization": f"Bearer {api_token}"} if api_token else {}
    started = time.perf_counter()
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=connect_timeout)
    try:
        conn.connect()
        connected = time.perf_counter()
        conn.sock.settimeout(timeout)
        conn.request("GET", f"{parts.path}?{parts.query}", headers=headers)
        resp = conn.getresponse()
        first_byte = time.perf_counter()
        if resp.status != 200:
            raise UpstreamError(f"probe from {req.url} answered {resp.status}: "
                                f"{resp.read(2000).decode('utf-8', 'replace')}", field="url", status_code=resp.status)
        buf = bytearray(1 << 20)
        got = 0
        while True:
            n = resp.readinto(buf)
            if not n:
                break
            got += n
    except (TimeoutError, OSError, http.client.HTTPException) as exc:
        if isinstance(exc, TimeoutError):
            raise UpstreamTimeout(f"probe from {req.url} timed out", field="url") from None
        raise UpstreamError(f"cannot pull the probe from {req.url}: {type(exc).__name__}: {exc}", field="url") from None
    finally:
        conn.close()
    done = time.perf_counter()
    if got != req.n_bytes:
        raise UpstreamError(f"probe from {req.url} sent {got} bytes, expected {req.n_bytes}", field="url")
    transfer = done - first_byte
    return {"bytes": got, "connect_seconds": round(connected - started, 6),
            "first_byte_seconds": round(first_byte - started, 6), "transfer_seconds": round(transfer, 6),
            "total_seconds": round(done - started, 6),
            "bytes_per_second": round(got / (done - connected), 1) if done > connected else None}
