"""How a prefill server sends a leased KV bundle to the decode server that pulls it.

The bytes are always a bundle (``bundle.py``); there are two ways to put them
on the wire:

- **In place.** When the backend exported the KV into an in-memory file
  (``buffers.sendable``), the bundle's preamble and end marker are written
  around the payload in that same file, once, when the lease is made
  (``frame_in_place``). Every fetch is then one ``sendfile(2)`` of that byte
  range (gunicorn's ``wsgi.file_wrapper``), straight from the pages the KV
  was exported into: Python never copies the payload on this side.
- **Frames.** Anywhere else (no ``memfd``, a payload over 4 GiB, token-id
  bundles) the payload is sliced into 4 MiB data frames. A WSGI server's
  ``write`` takes only ``bytes``, so each frame is copied once on its way out.

Either way ``on_sent`` runs once the whole bundle has been handed to the
socket, and not after a fetch that broke off, so the lease can be freed then
and kept for a retry otherwise.
"""
from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from werkzeug.wsgi import wrap_file

from . import buffers, bundle

SEND_BLOCK = 1 << 20  # what a WSGI server without sendfile reads from the file at a time


@dataclass(frozen=True)
class Framed:
    """A whole bundle lying in a file: bytes ``start`` up to ``end`` of ``fd``."""
    fd: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


def frame_in_place(header: bundle.BundleHeader, tokens, payload) -> Framed | None:
    """Write the bundle's framing around ``payload`` in its file; None when it is in none or does not fit."""
    span = buffers.span_of(payload)
    if span is None or header.payload_bytes > bundle.MAX_FRAME or span.length != header.payload_bytes:
        return None
    prefix, suffix = bundle.encode_single_frame(header, tokens)
    if len(prefix) > span.offset or len(suffix) > span.tailroom:
        return None
    start, end = span.offset - len(prefix), span.offset + span.length
    os.pwrite(span.fd, prefix, start)
    os.pwrite(span.fd, suffix, end)
    return Framed(span.fd, start, end + len(suffix))


def content_length(header: bundle.BundleHeader, framed: Framed | None) -> int:
    return framed.length if framed is not None else bundle.encoded_length(header)


def body(header: bundle.BundleHeader, tokens, payload, framed: Framed | None, environ: dict,
         on_sent: Callable[[], None]) -> Iterable[bytes]:
    """The response body that carries the bundle (use with ``direct_passthrough``)."""
    if framed is not None:
        try:
            source = RangeFile(framed, on_sent)
        except OSError:  # the file cannot be opened again (no /proc): frames still work
            pass
        else:
            return wrap_file(environ, source, SEND_BLOCK)
    return _frames(header, tokens, payload, on_sent)


def _frames(header, tokens, payload, on_sent) -> Iterator[bytes]:
    for piece in bundle.iter_encoded(header, tokens, payload):
        yield piece if isinstance(piece, bytes) else bytes(piece)
    on_sent()


class RangeFile(io.FileIO):
    """One fetch's own handle on a framed bundle.

    Opened anew through ``/proc/self/fd`` so that it has its own file offset
    (two fetches of one lease must not move each other's). Reads stop at the
    bundle's end; ``sendfile`` (``socket.sendfile`` seeks to where it stopped)
    and reads both record how far they got, and closing tells ``on_sent``
    when that was the end.
    """

    def __init__(self, framed: Framed, on_sent: Callable[[], None]):
        super().__init__(f"/proc/self/fd/{framed.fd}", "rb")
        self._end, self._on_sent = framed.end, on_sent
        self._furthest = super().seek(framed.start)

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        pos = super().seek(pos, whence)
        self._furthest = max(self._furthest, pos)
        return pos

    def read(self, size: int | None = -1) -> bytes:
        left = max(0, self._end - self.tell())
        data = super().read(left if size is None or size < 0 else min(size, left))
        self._furthest = max(self._furthest, self.tell())
        return data

    def close(self) -> None:
        if self.closed:
            return
        sent = self._furthest >= self._end
        super().close()
        if sent:
            self._on_sent()
