"""Large byte buffers for KV state.

A KV bundle of a long prompt is tens of megabytes (hundreds in production).
Fresh memory costs a page fault per 4 KiB page on first touch, which on a small
machine took longer than copying the bytes. Buffers from 8 MiB up are therefore
anonymous mappings advised to use transparent huge pages (one fault per 2 MiB)
where the kernel offers them, and are unmapped as soon as their last reference
goes, so a freed lease gives its memory straight back to the system.
"""
from __future__ import annotations

import mmap
import time
import threading
import weakref

HUGE_THRESHOLD = 8 << 20


class _Usage:
    """Bytes held in mapped buffers now and at most since the last reset (tracemalloc cannot see them)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.live = self.peak = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.live += n
            self.peak = max(self.peak, self.live)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.live


usage = _Usage()


def allocate(n: int):
    """A zeroed, writable buffer of ``n`` bytes (a bytearray, or an mmap for large sizes)."""
    if n < HUGE_THRESHOLD or not hasattr(mmap, "MAP_ANONYMOUS"):
        return bytearray(n)
    buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    usage.add(n)
    weakref.finalize(buf, usage.add, -n)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            buf.madvise(advice)
        except OSError:  # huge pages disabled: plain pages still work
            pass
    return buf


class BufferPool:
    """Freed large buffers kept for the next transfer of about the same size.

    A fresh mapping costs a page fault per page on first touch; reusing one does
    not. At most ``keep`` buffers are kept, each for at most ``idle_seconds``
    after it was given back; then it is unmapped. A buffer of ``size`` bytes
    serves a request for ``n`` bytes when ``n <= size <= 2 * n``.
    """

    def __init__(self, keep: int = 2, idle_seconds: float = 10.0, clock=time.monotonic):
        self.keep, self.idle_seconds, self._clock = keep, idle_seconds, clock
        self._lock = threading.Lock()
        self._idle: list = []  # (buffer, given_back_at)
        self.reused = self.fresh = 0

    def take(self, n: int):
        """A writable buffer of exactly ``n`` bytes (a view of a reused mapping, or a new one)."""
        if n < HUGE_THRESHOLD:
            return bytearray(n)
        with self._lock:
            self._sweep_locked()
            fits = [item for item in self._idle if n <= len(item[0]) <= 2 * n]
            if fits:
                item = min(fits, key=lambda entry: len(entry[0]))
                self._idle.remove(item)
                self.reused += 1
                return memoryview(item[0])[:n]
            self.fresh += 1
        return memoryview(allocate(n))

    def give(self, payload) -> None:
        """Give a buffer from ``take`` back once nothing reads or writes it any more."""
        buf = payload.obj if isinstance(payload, memoryview) else payload
        if not isinstance(buf, mmap.mmap):
            return
        with self._lock:
            self._idle.append((buf, self._clock()))
            while len(self._idle) > self.keep:
                self._idle.pop(0)
        timer = threading.Timer(self.idle_seconds + 0.05, self.sweep)
        timer.daemon = True
        timer.start()

    def sweep(self) -> None:
        with self._lock:
            self._sweep_locked()

    def idle_bytes(self) -> int:
        with self._lock:
            return sum(len(buf) for buf, _ in self._idle)

    def _sweep_locked(self) -> None:
        now = self._clock()
        self._idle = [(buf, at) for buf, at in self._idle if now - at < self.idle_seconds]
