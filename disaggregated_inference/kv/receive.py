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

A **streamed** bundle (the overlapped handoff; ``bundle.py`` version 2) starts
arriving while the prefill server is still evaluating the prompt. ``fetch``
then returns as soon as its preamble is in and checked: the ``Received`` it
gives has an ``Incoming`` whose ``pump`` reads the rest into the payload buffer
piece by piece (each piece checked against its own checksum as it lands),
telling ``on_change`` after each, so that a backend can import what is there
while the rest is on its way. A pull then stays alive as long as the prefill
server sends something every ``progress_timeout`` (it sends progress frames
while it evaluates) and makes progress within ``timeout``.
"""
from __future__ import annotations

import functools
import http.client
import ipaddress
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import urlsplit

from . import bundle, trust
from .buffers import BufferPool, with_room
from ..wire import KVRef  # noqa: F401  (the wire's type; fetched here)
from ..errors import BundleError, DisaggError, LeaseExpired, NotFound, UpstreamError, UpstreamTimeout
from ..metrics import ServerFigures


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
    incoming: "Incoming | None" = field(default=None, repr=False)  # a streamed bundle still arriving


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
    socket's own timeout: the progress timeout). ``first_at`` is when the first read since ``mark()``
    returned: a streamed frame's bytes began to arrive then."""

    def __init__(self, resp, deadline: float):
        self._resp, self.deadline = resp, deadline
        self.first_at: float | None = None

    def mark(self) -> None:
        self.first_at = None

    def _arrived(self, n):
        if self.first_at is None:
            self.first_at = time.perf_counter()
        return n

    def readinto(self, view) -> int:
        if time.perf_counter() > self.deadline:
            raise TimeoutError("KV transfer deadline passed")
        return self._arrived(self._resp.readinto(view))

    def read(self, n: int = -1) -> bytes:
        if time.perf_counter() > self.deadline:
            raise TimeoutError("KV transfer deadline passed")
        return self._arrived(self._resp.read(n))


def _check_declared(ref: KVRef, header: bundle.BundleHeader) -> None:
    """The bundle's header against what the prefill answer declared, before any payload byte is read:
    a mismatch ends the pull there, and the prefill server keeps the lease (it frees it only after a
    whole fetch)."""
    if ref.bytes is not None and ref.bytes != header.payload_bytes:
        raise BundleError(f"KV bundle has {header.payload_bytes} bytes but the prefill answer said {ref.bytes}",
                          field="kv.bytes")
    if ref.crc32c is not None and ref.crc32c != header.payload_crc32c:
        raise BundleError("KV bundle checksum differs from the one the prefill answer gave", field="kv.crc32c")


class Incoming:
    """A streamed bundle arriving: ``pump`` (one thread) reads its pieces into ``payload``; a backend
    reads ``pieces`` as they land (each already checked against its checksum) and the ``trailer``
    once ``finished``. ``verify`` raises the pull's error, or ``BundleError`` while it is not finished.
    ``abandon`` (the decode side gave up) makes ``pump`` stop at the next frame and hang up, which tells
    the prefill server to stop too."""

    def __init__(self, ref: KVRef, conn, src: _Deadline, header: bundle.BundleHeader, tokens: list, payload,
                 meta: dict, timeout: float, stall: float, started: float):
        self.ref, self._conn, self._src = ref, conn, src
        self.header, self.tokens, self.payload, self.meta = header, tokens, payload, meta
        self.pieces: list[bundle.Piece] = []
        self.trailer: dict = {}
        self.finished = self.abandoned = self.closed = False
        self.complete = False  # every payload byte is in (the trailer and end marker may still come)
        self.error: DisaggError | None = None
        self.on_change: Callable[[], None] = lambda: None
        self._timeout, self._stall, self._started = timeout, stall, started
        self._lock = threading.Lock()
        self.receiving_time = 0.0  # seconds spent reading piece bytes (not waiting for the prefill)
        self.progress = 0
        self.complete_at: float | None = None  # time.time() when the last payload byte was in
        self.finished_at: float | None = None  # time.time() at the end marker (after the trailer: the canary)

    def pump(self) -> None:
        """Read the rest of the bundle; raise (and record) what failed. Called once."""
        view, coverage = memoryview(self.payload).cast("B"), bundle.Coverage(self.header.payload_bytes)
        try:
            while not self.abandoned:
                self._src.mark()
                kind, value = bundle.read_stream_frame(self._src, view, coverage)
                if kind == "piece":
                    self.receiving_time += time.perf_counter() - (self._src.first_at or time.perf_counter())
                    self._src.deadline = time.perf_counter() + self._timeout
                    with self._lock:
                        self.pieces.append(value)
                        self.complete = coverage.complete
                    if self.complete:
                        self.complete_at = time.time()
                elif kind == "progress":
                    if value > self.progress:
                        self.progress, self._src.deadline = value, time.perf_counter() + self._timeout
                elif kind == "trailer":
                    self.trailer = value
                elif kind == "end":
                    self.meta.update(self.trailer.get("meta") or {})
                    self.finished_at = time.time()
                    with self._lock:
                        self.finished = True
                    break
                self.on_change()
        except BaseException as exc:
            self.error = _pull_error(self.ref, exc, self._stall, self._timeout, self._started)
            if self.error is None:
                raise
            raise self.error from None
        finally:
            self._conn.close()
            self.closed = True  # nothing writes into the payload any more
            self.on_change()

    def pieces_since(self, seen: int) -> list:
        with self._lock:
            return self.pieces[seen:]

    def settled(self) -> bool:
        """Finished, failed or given up: nothing more will arrive."""
        return self.finished or self.error is not None or self.abandoned

    def abandon(self) -> None:
        """Stop the pump at its next frame (it hangs up, and the prefill server stops)."""
        self.abandoned = True

    def close(self) -> None:
        """Hang up before pumping (the bundle is refused): the prefill server stops."""
        self.abandoned = True
        if not self.closed:
            self._conn.close()
            self.closed = True

    def verify(self) -> None:
        if self.error is not None:
            raise self.error
        if not self.finished:
            raise BundleError(f"the streamed KV bundle from {_origin(self.ref)} is not complete", field="kv")

    def stats(self) -> ServerFigures:
        """What the pull measured: bytes, the time spent receiving them, the wait for the prefill, and what
        was left after the prefill's last chunk was evaluated, on the two machines' wall clocks (meaningful
        where they agree, as on one machine): until the last payload byte was in (``kv_exposed_time``),
        and until the end marker, which follows the canary the prefill side computes after its last chunk
        (``kv_end_after_prefill_time``)."""
        total = time.perf_counter() - self._started
        ended = self.trailer.get("prefill_ended_at")
        out = {"kv_bytes": self.header.payload_bytes, "kv_transfer_time": round(self.receiving_time, 6),
               "kv_transfer_gbps": round(self.header.payload_bytes * 8 / self.receiving_time / 1e9, 3)
               if self.receiving_time > 0 else None,
               "kv_pull_time": round(total, 6), "kv_wait_time": round(max(0.0, total - self.receiving_time), 6),
               "kv_pieces": len(self.pieces), "handoff_mode": "streamed"}
        if isinstance(ended, (int, float)) and self.finished_at is not None:
            out["kv_exposed_time"] = round(max(0.0, (self.complete_at or self.finished_at) - ended), 6)
            out["kv_end_after_prefill_time"] = round(max(0.0, self.finished_at - ended), 6)
        if isinstance(self.trailer.get("send_tail_s"), (int, float)):
            out["kv_send_tail_time"] = self.trailer["send_tail_s"]
        return ServerFigures.of(**out)


def _pull_error(ref: KVRef, exc: BaseException, stall: float, timeout: float, started: float) -> DisaggError | None:
    """One of our errors for what broke a pull (None: not a pull failure, let it through)."""
    if isinstance(exc, DisaggError):
        return exc
    if isinstance(exc, bundle.BundleFormatError):
        return _unusable(ref, exc)
    if isinstance(exc, bundle.BundleRemoteError):
        # the prefill server's own message stays in its log: nothing it says is copied into our answers
        return UpstreamError(f"the prefill server ended the KV transfer with error code {exc.code}",
                             field="kv", upstream_code=exc.code)
    if isinstance(exc, (socket.timeout, TimeoutError)):
        waited = time.perf_counter() - started
        what = (f"no KV bytes arrived for {stall:g}s" if waited < timeout else f"the KV transfer took over {timeout:g}s")
        return UpstreamTimeout(f"KV transfer from {_origin(ref)} abandoned: {what}", field="kv")
    if isinstance(exc, (OSError, http.client.HTTPException)):
        return UpstreamError(f"cannot fetch the KV from the prefill server at {_origin(ref)}: "
                             f"{type(exc).__name__}", field="kv.url")
    return None


def fetch(ref: KVRef, *, timeout: float, connect_timeout: float = 3.0, api_token: str | None = None,
          max_bytes: int | None = None, pool: BufferPool | None = None,
          socket_buffer: int = 0, sources=None, progress_timeout: float | None = None,
          room: tuple[int, int] = (0, 0), streamed: bool = False) -> tuple[Received, ServerFigures]:
    """Pull the bundle ``ref`` names. With ``sources`` (see ``trust.py``) a URL on no source is refused
    (403) before any connection is made; the token is sent only to a URL that passed that check.
    ``timeout`` bounds the whole pull, ``progress_timeout`` each wait for bytes.

    A streamed bundle comes back with its preamble read and checked and ``Received.incoming`` to
    ``pump`` when the caller says it takes one (``streamed``); otherwise it is read whole here."""
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
        src = _Deadline(resp, started + timeout)
        version, header, tokens = bundle.read_any_preamble(src)
        _check_declared(ref, header)
        if max_bytes is not None and header.payload_bytes > max_bytes:
            raise bundle.BundleFormatError(
                f"bundle payload of {header.payload_bytes} bytes exceeds the limit of {max_bytes}")
        if version == bundle.STREAMED_VERSION:
            incoming = Incoming(ref, conn, src, header, tokens, allocate(header.payload_bytes), dict(header.meta),
                                timeout, stall, started)
            conn = None  # the Incoming closes it
            received = Received(header.kind, tokens, incoming.payload, header.fingerprint, incoming.meta,
                                verify=incoming.verify, incoming=incoming)
            if not streamed:
                incoming.pump()
                received.incoming = None
                return received, incoming.stats()
            return received, ServerFigures(kv_bytes=header.payload_bytes, handoff_mode="streamed")
        arrived = bundle.receive_bundle(src, allocate=allocate, checksum_alongside=alongside,
                                        preamble=(header, tokens))
    except BaseException as exc:
        error = _pull_error(ref, exc, stall, timeout, started)
        if error is None:
            raise
        raise error from None
    finally:
        if conn is not None:
            conn.close()
    elapsed = time.perf_counter() - started
    header = arrived.header
    received = Received(header.kind, arrived.tokens, arrived.payload, header.fingerprint, header.meta,
                        verify=functools.partial(_verify, arrived, ref))
    return received, ServerFigures.of(
        kv_bytes=header.payload_bytes, kv_transfer_time=round(elapsed, 6),
        kv_transfer_gbps=round(header.payload_bytes * 8 / elapsed / 1e9, 3) if elapsed > 0 else None)


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
