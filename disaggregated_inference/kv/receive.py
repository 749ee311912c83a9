"""The decode side of the handoff: pull a KV bundle from a prefill server and check it.

The bundle travels prefill server -> decode server directly, as a binary HTTP
response read frame by frame into one buffer. The pull uses ``http.client``
rather than ``requests``: its ``readinto`` receives straight into our buffer
(urllib3's reads into a temporary bytes object and copies). Every failure maps
to one error of ``errors.py`` that names the problem.

The payload's checksum runs on a thread of its own and may still be finishing
when ``fetch`` returns; ``Received.verify`` waits for it (the backend calls it
after the import, which it overlaps). From another machine it is computed as
the bytes arrive; from this one (``same_host``: the local cluster) only after
the last byte, since a loopback transfer is a copy that keeps every core and
the memory bus busy, and a checksum beside it would slow it down.

Each pull opens a fresh connection, whose kernel receive buffer would start
small (128 KiB) and grow only as the transfer proceeds; on Linux the socket is
given a fixed receive buffer up front (``socket_buffer``) when the kernel allows
one that large (``net.core.rmem_max``), since asking for more than that would
cap the buffer below what autotuning reaches.
"""
from __future__ import annotations

import functools
import http.client
import ipaddress
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import urlsplit

from . import bundle, trust
from .buffers import BufferPool, with_room
from ..errors import BundleError, LeaseExpired, NotFound, UpstreamError, UpstreamTimeout


@dataclass(frozen=True)
class KVRef:
    """Where a prefilled bundle can be fetched, as a prefill server described it."""

    url: str
    handle: str
    bytes: int | None = None
    crc32c: int | None = None


def _intact() -> None:
    """A payload that needs no checking (token ids only, or built in this process)."""


@dataclass
class Received:
    """A bundle as the decode side got it (header fields, token ids, payload).

    ``verify()`` returns once the payload is known to be intact and raises
    ``BundleError`` if it is not. A large payload's checksum is still finishing
    when the bundle arrives, alongside the import: a backend imports, then calls
    ``verify()``, and only then generates.
    """

    kind: str
    tokens: list
    payload: object
    fingerprint: dict
    meta: dict = field(default_factory=dict)
    verify: Callable[[], None] = field(default=_intact, repr=False)


@functools.cache
def receive_buffer_limit() -> int | None:
    """The largest receive buffer a socket may ask for (Linux ``net.core.rmem_max``, read once); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None  # macOS and others: leave buffer sizing to the kernel's autotuning
    try:
        with open("/proc/sys/net/core/rmem_max") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def socket_buffer_in_effect(size: int) -> int | None:
    """The receive buffer a KV pull asks for: ``size`` where the kernel allows that much, else None.

    A fixed size turns the kernel's autotuning off, so a request above the
    system's limit (which the kernel would silently cut down) is not made at all.
    """
    limit = receive_buffer_limit()
    return size if 0 < size and limit is not None and size <= limit else None


def size_receive_buffer(sock: socket.socket, size: int) -> bool:
    """Give ``sock`` a ``size``-byte receive buffer if the kernel allows that much; True when set."""
    if socket_buffer_in_effect(size) is None:
        return False
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
    return True


def same_host(sock: socket.socket) -> bool:
    """Whether a connected socket's peer is this machine (a loopback address, or the socket's own)."""
    try:
        peer, own = sock.getpeername()[0], sock.getsockname()[0]
    except (OSError, IndexError, TypeError):
        return False
    try:
        return peer == own or ipaddress.ip_address(peer.split("%")[0]).is_loopback
    except ValueError:
        return False


def _connect(url, connect_timeout: float, timeout: float, socket_buffer: int = 0) -> http.client.HTTPConnection:
    cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
    conn = cls(url.hostname, url.port, timeout=connect_timeout)
    conn.connect()
    conn.sock.settimeout(timeout)
    size_receive_buffer(conn.sock, socket_buffer)
    return conn


class _Deadline:
    """A response whose reads fail once ``deadline`` has passed (each read is also bounded by the
    socket's own timeout: the progress timeout)."""

    def __init__(self, resp, deadline: float):
        self._resp, self._deadline = resp, deadline

    def readinto(self, view) -> int:
        if time.perf_counter() > self._deadline:
            raise TimeoutError("KV transfer deadline passed")
        return self._resp.readinto(view)

    def read(self, n: int = -1) -> bytes:
        if time.perf_counter() > self._deadline:
            raise TimeoutError("KV transfer deadline passed")
        return self._resp.read(n)


def _check_declared(ref: KVRef, header: bundle.BundleHeader) -> None:
    """The bundle's header against what the prefill answer declared, before any payload byte is read:
    a mismatch ends the pull there, and the prefill server keeps the lease (it frees it only after a
    whole fetch)."""
    if ref.bytes is not None and ref.bytes != header.payload_bytes:
        raise BundleError(f"KV bundle has {header.payload_bytes} bytes but the prefill answer said {ref.bytes}",
                          field="kv.bytes")
    if ref.crc32c is not None and ref.crc32c != header.payload_crc32c:
        raise BundleError("KV bundle checksum differs from the one the prefill answer gave", field="kv.crc32c")


def fetch(ref: KVRef, *, timeout: float, connect_timeout: float = 3.0, api_token: str | None = None,
          max_bytes: int | None = None, pool: BufferPool | None = None,
          socket_buffer: int = 0, sources=None, progress_timeout: float | None = None,
          room: tuple[int, int] = (0, 0)) -> tuple[Received, dict]:
    """Pull the bundle ``ref`` names. With ``sources`` (see ``trust.py``) a URL on no source is refused
    (403) before any connection is made; the token is sent only to a URL that passed that check.
    ``timeout`` bounds the whole pull, ``progress_timeout`` each wait for bytes."""
    if sources is not None:
        trust.check_source(ref.url, sources)
    headers = {"Authorization": f"Bearer {api_token}"} if api_token else {}
    url = urlsplit(ref.url)
    path = url.path + (f"?{url.query}" if url.query else "")
    allocate = with_room(pool.take if pool is not None else bytearray, *room)  # room: see kv/buffers.with_room
    started = time.perf_counter()
    stall = min(timeout, progress_timeout) if progress_timeout else timeout
    conn = None
    try:
        conn = _connect(url, connect_timeout, stall, socket_buffer)
        alongside = not same_host(conn.sock)
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        if resp.status != 200:
            _raise_for_status(resp.status, ref)
        arrived = bundle.receive_bundle(_Deadline(resp, started + timeout), max_payload_bytes=max_bytes,
                                        allocate=allocate, checksum_alongside=alongside,
                                        check_header=functools.partial(_check_declared, ref))
    except bundle.BundleFormatError as exc:
        raise _unusable(ref, exc) from None
    except bundle.BundleRemoteError as exc:
        # the prefill server's own message stays in its log: nothing it says is copied into our answers
        raise UpstreamError(f"the prefill server ended the KV transfer with error code {exc.code}",
                            field="kv", upstream_code=exc.code) from None
    except (socket.timeout, TimeoutError):
        waited = time.perf_counter() - started
        what = (f"no KV bytes arrived for {stall:g}s" if waited < timeout else f"the KV transfer took over {timeout:g}s")
        raise UpstreamTimeout(f"KV transfer from {_origin(ref)} abandoned: {what}", field="kv") from None
    except (OSError, http.client.HTTPException) as exc:
        raise UpstreamError(f"cannot fetch the KV from the prefill server at {_origin(ref)}: "
                            f"{type(exc).__name__}", field="kv.url") from None
    finally:
        if conn is not None:
            conn.close()
    elapsed = time.perf_counter() - started
    header = arrived.header
    received = Received(header.kind, arrived.tokens, arrived.payload, header.fingerprint, header.meta,
                        verify=functools.partial(_verify, arrived, ref))
    stats = {
        "kv_bytes": header.payload_bytes,
        "kv_transfer_time": round(elapsed, 6),
        "kv_transfer_gbps": round(header.payload_bytes * 8 / elapsed / 1e9, 3) if elapsed > 0 else None,
    }
    return received, stats


def _unusable(ref: KVRef, exc: bundle.BundleFormatError) -> BundleError:
    return BundleError(f"KV bundle from {ref.url} is unusable: {exc}", field="kv")


def _verify(arrived: bundle.Arrived, ref: KVRef) -> None:
    try:
        arrived.check()
    except bundle.BundleFormatError as exc:
        raise _unusable(ref, exc) from None


def _origin(ref: KVRef) -> str:
    url = urlsplit(ref.url)
    return f"{url.scheme}://{url.netloc}"


def _raise_for_status(status: int, ref: KVRef) -> None:
    """Map a refused fetch to our own error; the upstream's body is not read, let alone repeated."""
    where = f"prefill server {_origin(ref)}"
    if status == 404:
        raise NotFound(f"{where} has no KV bundle {ref.handle!r} (unknown, or already fetched)", field="kv.handle")
    if status == 410:
        raise LeaseExpired(f"{where}: the lease on KV bundle {ref.handle!r} expired", field="kv.handle")
    raise UpstreamError(f"{where} refused the KV fetch (HTTP {status})", field="kv", upstream_status=status)
