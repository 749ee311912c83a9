"""Leases on prefilled KV bundles held by a prefill server.

A bundle is held until it has been fetched whole or its lease runs out,
whichever comes first; then the table drops its last reference and the
payload's memory is freed. A failed or partial fetch leaves the lease in place
so the decode side can try again before it expires.

A streamed bundle (``kv/stream.py``) is leased while its prompt is still being
evaluated: its lease does not run out before the prefill ends (``start_clock``
starts it then), and it is freed at once when its one pull breaks off or the
prefill fails, since what it holds can no longer be handed over whole.
"""
from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from ..errors import LeaseExpired, NotFound, Overloaded


@dataclass
class Lease:
    handle: str
    header: object  # bundle.BundleHeader
    tokens: list
    payload: object  # any buffer; the only reference the server keeps
    expires_at: float
    created_at: float = field(default_factory=time.time)
    framed: object = None  # sender.Framed when the whole bundle lies in the payload's file
    streaming: object = None  # stream.StreamingBundle while (and after) its payload is produced

    @property
    def nbytes(self) -> int:
        return self.header.payload_bytes


class LeaseTable:
    """Thread-safe table of leases, with a sweeper thread for expiry."""

    def __init__(self, ttl_seconds: float = 30.0, sweep_every: float = 1.0, remember: int = 4096, clock=time.time,
                 max_bytes: int | None = None):
        self.ttl = float(ttl_seconds)
        self.max_bytes = max_bytes  # KV bytes held at once; a lease beyond it is refused (503)
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        # handle -> why it is gone ("fetched" or "expired"), so a late caller learns the reason.
        self._gone: OrderedDict[str, str] = OrderedDict()
        self._remember = remember
        self.expired_total = 0
        self.fetched_total = 0
        self._stop = threading.Event()
        self._sweeper = None
        if sweep_every:
            self._sweeper = threading.Thread(target=self._sweep_loop, args=(sweep_every,), name="lease-sweeper", daemon=True)
            self._sweeper.start()

    def put(self, header, tokens, payload, ttl_seconds: float | None = None, framed=None, streaming=None) -> Lease:
        """Hold a bundle for ``ttl_seconds`` (a ``streaming`` one: from ``start_clock`` on)."""
        ttl = self.ttl if ttl_seconds is None else float(ttl_seconds)
        expires = float("inf") if streaming is not None else self._clock() + ttl
        lease = Lease(secrets.token_urlsafe(18), header, tokens, payload, expires, framed=framed, streaming=streaming)
        with self._lock:
            self._sweep_locked()
            self._check_room_locked(lease.nbytes)
            self._leases[lease.handle] = lease
        return lease

    def check_room(self, nbytes: int = 0) -> None:
        """Raise ``Overloaded`` (503, Retry-After) if ``nbytes`` more would exceed ``max_bytes``."""
        with self._lock:
            self._sweep_locked()
            self._check_room_locked(nbytes)

    def _check_room_locked(self, nbytes: int) -> None:
        if self.max_bytes is None:
            return
        held = sum(lease.nbytes for lease in self._leases.values())
        if held + nbytes > self.max_bytes or (nbytes == 0 and held >= self.max_bytes):
            soonest = min((lease.expires_at for lease in self._leases.values()), default=self._clock())
            raise Overloaded(f"this prefill server holds {held} bytes of KV under leases (limit {self.max_bytes}); "
                             "try another server or later", retry_after=max(1.0, soonest - self._clock()))

    def start_clock(self, handle: str, ttl_seconds: float | None = None) -> float | None:
        """Start a streamed bundle's lease now (its prefill has ended); the time it expires, None if gone."""
        with self._lock:
            lease = self._leases.get(handle)
            if lease is None:
                return None
            lease.expires_at = self._clock() + (self.ttl if ttl_seconds is None else float(ttl_seconds))
            return lease.expires_at

    def get(self, handle: str) -> Lease:
        """The live lease for ``handle``; 410 if it expired, 404 if unknown or fetched."""
        with self._lock:
            self._sweep_locked()
            lease = self._leases.get(handle)
            if lease is not None:
                return lease
            why = self._gone.get(handle)
        if why == "expired":
            raise LeaseExpired(f"KV lease {handle} expired before it was fetched", field="handle")
        if why == "fetched":
            raise NotFound(f"KV bundle {handle} was already fetched and freed", field="handle")
        if why in ("failed", "abandoned"):
            raise NotFound(f"KV bundle {handle} is gone: its prefill {'failed' if why == 'failed' else 'was abandoned'} "
                           "before it was handed over", field="handle")
        raise NotFound(f"unknown KV handle {handle!r}", field="handle")

    def release(self, handle: str, why: str = "fetched") -> None:
        with self._lock:
            if self._leases.pop(handle, None) is not None:
                self._forget_locked(handle, why)
                if why == "fetched":
                    self.fetched_total += 1

    def stats(self) -> dict:
        with self._lock:
            self._sweep_locked()
            return {
                "held": len(self._leases),
                "bytes": sum(lease.nbytes for lease in self._leases.values()),
                "ttl_seconds": self.ttl,
                "expired_total": self.expired_total,
                "fetched_total": self.fetched_total,
            }

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._leases.clear()

    def _forget_locked(self, handle: str, why: str) -> None:
        self._gone[handle] = why
        while len(self._gone) > self._remember:
            self._gone.popitem(last=False)

    def _sweep_locked(self) -> None:
        now = self._clock()
        for handle in [h for h, lease in self._leases.items() if lease.expires_at <= now]:
            del self._leases[handle]
            self._forget_locked(handle, "expired")
            self.expired_total += 1

    def _sweep_loop(self, every: float) -> None:
        while not self._stop.wait(every):
            with self._lock:
                self._sweep_locked()
