"""The decode side of the handoff: pull a KV bundle from a prefill server and check it.

The bundle travels prefill server -> decode server directly, as a binary HTTP
response read frame by frame into one preallocated buffer. Every failure maps
to one error of ``errors.py`` that names the problem.
"""
from __future__ import annotations

import logging
import time

import requests

from . import bundle
from .api import KVRef
from .backends.base import Received
from .errors import BundleError, LeaseExpired, NotFound, UpstreamError, UpstreamTimeout

log = logging.getLogger(__name__)


def fetch(ref: KVRef, session: requests.Session, *, timeout: float, connect_timeout: float = 3.0,
          api_token: str | None = None, max_bytes: int | None = None) -> tuple[Received, dict]:
    headers = {"Authorization": f"Bearer {api_token}"} if api_token else {}
    started = time.perf_counter()
    try:
        resp = session.get(ref.url, stream=True, timeout=(connect_timeout, timeout), headers=headers)
    except requests.Timeout:
        raise UpstreamTimeout(f"timed out connecting to the prefill server for {ref.url}", field="kv.url") from None
    except requests.RequestException as exc:
        raise UpstreamError(f"cannot reach the prefill server at {ref.url}: {exc}", field="kv.url") from None
    with resp:
        if resp.status_code != 200:
            _raise_for_status(resp, ref)
        try:
            header, tokens, payload = bundle.read_bundle(resp.raw, max_payload_bytes=max_bytes)
        except bundle.BundleFormatError as exc:
            raise BundleError(f"KV bundle from {ref.url} is unusable: {exc}", field="kv") from None
        except bundle.BundleRemoteError as exc:
            raise UpstreamError(str(exc), field="kv") from None
        except requests.RequestException as exc:  # urllib3 errors surface through requests here
            raise UpstreamError(f"KV transfer from {ref.url} broke off: {exc}", field="kv") from None
        except (OSError, ValueError) as exc:
            if "timed out" in str(exc):
                raise UpstreamTimeout(f"KV transfer from {ref.url} timed out", field="kv") from None
            raise UpstreamError(f"KV transfer from {ref.url} broke off: {exc}", field="kv") from None
    elapsed = time.perf_counter() - started
    if ref.bytes is not None and ref.bytes != header.payload_bytes:
        raise BundleError(f"KV bundle has {header.payload_bytes} bytes but the prefill answer said {ref.bytes}",
                          field="kv.bytes")
    if ref.crc32 is not None and ref.crc32 != header.payload_crc32:
        raise BundleError("KV bundle checksum differs from the one the prefill answer gave", field="kv.crc32")
    received = Received(header.kind, tokens, payload, header.fingerprint, header.meta)
    stats = {
        "kv_bytes": header.payload_bytes,
        "kv_transfer_time": round(elapsed, 6),
        "kv_transfer_gbps": round(header.payload_bytes * 8 / elapsed / 1e9, 3) if elapsed > 0 else None,
    }
    return received, stats


def _raise_for_status(resp: requests.Response, ref: KVRef) -> None:
    try:
        message = resp.json().get("error", resp.text)
    except ValueError:
        message = resp.text[:200]
    where = f"prefill server {ref.url.split('/kv/')[0]}"
    if resp.status_code == 404:
        raise NotFound(f"{where}: {message}", field="kv.handle")
    if resp.status_code == 410:
        raise LeaseExpired(f"{where}: {message}", field="kv.handle")
    raise UpstreamError(f"{where} refused the KV fetch ({resp.status_code}): {message}", field="kv",
                        upstream_status=resp.status_code)
