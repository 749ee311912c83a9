"""Large byte buffers for KV state.

A KV bundle of a long prompt is tens of megabytes (hundreds in production).
Fresh memory costs a page fault per 4 KiB page on first touch, which on a small
machine took longer than copying the bytes. Buffers from 8 MiB up are therefore
anonymous mappings advised to use transparent huge pages (one fault per 2 MiB)
where the kernel offers them, and are unmapped as soon as their last reference
goes, so a freed lease gives its memory straight back to the system.

A buffer that is going to be sent (a prefill server's exported KV) is better
placed inside an anonymous in-memory file (Linux ``memfd``): the server then
writes the bundle's framing around it in the same file and sends every fetch
with ``sendfile(2)`` straight from those pages, without Python ever copying
the payload (``sendable`` and ``span_of``).
"""
from __future__ import annotations

import ctypes
import mmap
import os
import time
import threading
import weakref
from dataclasses import dataclass

HUGE_THRESHOLD = 8 << 20
PAGE = mmap.PAGESIZE


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
    _advise_huge(buf)
    return buf


def _advise_huge(buf: mmap.mmap) -> None:
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            buf.madvise(advice)
        except OSError:  # huge pages disabled: plain pages still work
            pass


@dataclass(frozen=True)
class FileSpan:
    """Where a buffer lies inside an in-memory file: ``fd``, first byte at ``offset``, ``length`` bytes.

    The ``offset`` bytes before the buffer and the ``tailroom`` bytes after it
    belong to the file too, free for framing.
    """
    fd: int
    offset: int
    length: int
    tailroom: int


_FILES: "weakref.WeakKeyDictionary[mmap.mmap, tuple[int, int]]" = weakref.WeakKeyDictionary()  # map -> (fd, size)


def sendable(n: int, tailroom: int = PAGE):
    """A zeroed, writable buffer of ``n`` bytes, inside an in-memory file where the platform has them.

    The file reserves room before the buffer (64 KiB plus 1/128 of ``n``: a
    bundle's header and token ids, 4 bytes a token, fit for any model whose KV
    takes at least 512 bytes a token) and ``tailroom`` bytes after it. Small
    sizes, and platforms without ``memfd_create``, get ``allocate(n)``.
    """
    if n < HUGE_THRESHOLD or not hasattr(os, "memfd_create"):
        return allocate(n)
    headroom = -(-((64 << 10) + n // 128) // PAGE) * PAGE
    size = headroom + n + tailroom
    fd = os.memfd_create("disagg-kv", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        buf = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError:
        os.close(fd)
        return allocate(n)
    usage.add(size)
    weakref.finalize(buf, _close_file, fd, size)  # the file lives as long as its mapping
    _FILES[buf] = (fd, size)
    _advise_huge(buf)
    return memoryview(buf)[headroom:headroom + n]


MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in, writable, without writing to them


def populate(buf) -> threading.Thread | None:
    """Fault a fresh buffer's pages in on a thread of its own, so that whoever writes into it meanwhile (a
    streamed export, chunk by chunk) does not pay a page fault per page; nothing is written, so the two
    never race. None where the kernel cannot (the writes then fault as usual)."""
    view = memoryview(buf).cast("B")
    if len(view) < HUGE_THRESHOLD or not hasattr(os, "memfd_create"):
        return None
    start = _address(view) // PAGE * PAGE
    length = -(-(_address(view) + len(view) - start) // PAGE) * PAGE
    libc = ctypes.CDLL(None, use_errno=True)

    def run() -> None:
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), MADV_POPULATE_WRITE)  # EINVAL: too old

    worker = threading.Thread(target=run, name="kv-populate", daemon=True)
    worker.start()
    return worker


def _close_file(fd: int, size: int) -> None:
    os.close(fd)
    usage.add(-size)


def span_of(buf) -> FileSpan | None:
    """Where ``buf`` (a view of a ``sendable`` buffer, or any part of it) lies in its file; None if in none."""
    view = memoryview(buf)
    known = _FILES.get(view.obj) if isinstance(view.obj, mmap.mmap) else None
    if known is None or view.readonly or not view.contiguous or not view.nbytes:
        return None
    fd, size = known
    offset = _address(view) - _address(memoryview(view.obj))
    return FileSpan(fd, offset, view.nbytes, size - offset - view.nbytes)


def with_room(allocate, head: int, tail: int):
    """``allocate`` for buffers that keep ``head`` spare bytes before them and ``tail`` after them, so
    that a format can be converted in place (``room_around`` finds them again)."""
    if not head and not tail:
        return allocate
    return lambda n: memoryview(allocate(n + head + tail)).cast("B")[head:head + n]


def room_around(buf, head: int, tail: int) -> memoryview | None:
    """A writable view from ``head`` bytes before ``buf`` to ``tail`` bytes after it, if the memory
    ``buf`` is a view of has that room; else None."""
    view = memoryview(buf)
    if view.readonly or not view.contiguous or view.obj is None or isinstance(view.obj, bytes):
        return None
    whole = memoryview(view.obj).cast("B")
    if not len(view):
        return None
    offset = _address(view) - _address(whole)
    if offset < head or len(whole) - offset - len(view) < tail:
        return None
    return whole[offset - head:offset + len(view) + tail]


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class BufferPool:
    """Freed large buffers kept, warm, for the next transfer of about the same size.

    A fresh mapping costs a page fault (and the kernel zeroing the page) per page
    on first touch, which on a small machine took as long as receiving the bytes;
    reusing one costs neither. At most ``keep`` buffers are kept, each for at most
    ``idle_seconds`` after it was given back; then it is unmapped (one timer
    thread at a time does that). A buffer of ``size`` bytes serves a request for
    ``n`` bytes when ``n <= size <= 2 * n``.
    """

    def __init__(self, keep: int = 2, idle_seconds: float = 10.0, clock=time.monotonic):
        self.keep, self.idle_seconds, self._clock = keep, idle_seconds, clock
        self._lock = threading.Lock()
        self._idle: list = []  # (buffer, given_back_at), oldest first
        self._timer: threading.Timer | None = None
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
            self._arm_locked()

    def sweep(self) -> None:
        with self._lock:
            self._timer = None
            self._sweep_locked()
            self._arm_locked()

    def idle_bytes(self) -> int:
        return self.stats()["idle_bytes"]

    def stats(self) -> dict:
        with self._lock:
            self._sweep_locked()
            return {"idle": len(self._idle), "idle_bytes": sum(len(buf) for buf, _ in self._idle),
                    "idle_seconds": self.idle_seconds, "reused_total": self.reused, "fresh_total": self.fresh}

    def _arm_locked(self) -> None:
        """Make sure a timer will unmap the oldest idle buffer when its time is up."""
        if self._timer is not None or not self._idle:
            return
        due = self._idle[0][1] + self.idle_seconds - self._clock()
        self._timer = threading.Timer(max(0.0, due) + 0.05, self.sweep)
        self._timer.daemon = True
        self._timer.start()

    def _sweep_locked(self) -> None:
        now = self._clock()
        self._idle = [(buf, at) for buf, at in self._idle if now - at < self.idle_seconds]
