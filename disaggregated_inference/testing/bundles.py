"""Whole KV bundles in memory, for tests and benchmarks: written and read in one call.

The servers never hold a bundle whole: they send it while it is read (``kv/send.py``) and receive
it into the buffer it is imported from (``bundle.receive_bundle``, ``kv/receive.py``). These read
or write a bundle from or to a file object in one go, with the same checks.
"""
from __future__ import annotations

import io
from typing import BinaryIO, Callable

from ..kv.bundle import (DEFAULT_CHUNK, STREAMED_VERSION, BundleHeader, Coverage, encode_piece, encode_preamble,
                         encode_stream_end, encode_trailer, iter_encoded, read_preamble, read_stream_frame,
                         receive_bundle)


def write_bundle(out: BinaryIO, header: BundleHeader, tokens, payload, chunk_size: int = DEFAULT_CHUNK) -> None:
    for piece in iter_encoded(header, tokens, payload, chunk_size):
        out.write(piece)


def read_bundle(src: BinaryIO, max_payload_bytes: int | None = None,
                allocate: Callable[[int], object] = bytearray) -> tuple[BundleHeader, list[int], object]:
    """Read one bundle and check it; return its header, token ids and payload."""
    arrived = receive_bundle(src, max_payload_bytes, allocate)
    arrived.check()
    return arrived.header, arrived.tokens, arrived.payload


def to_bytes(header: BundleHeader, tokens, payload) -> bytes:
    """The whole bundle in memory (tests, small token-id bundles)."""
    buf = io.BytesIO()
    write_bundle(buf, header, tokens, payload)
    return buf.getvalue()


def read_streamed(src: BinaryIO, allocate: Callable[[int], object] = bytearray
                  ) -> tuple[BundleHeader, list[int], object, dict]:
    """Read one whole streamed bundle (tests, tools): header, token ids, the assembled payload, trailer."""
    header, tokens = read_preamble(src, (STREAMED_VERSION,))
    payload = allocate(header.payload_bytes)
    view, coverage, trailer = memoryview(payload).cast("B"), Coverage(header.payload_bytes), {}
    while True:
        kind, value = read_stream_frame(src, view, coverage)
        if kind == "trailer":
            trailer = value
        elif kind == "end":
            return header, tokens, payload, trailer


def write_streamed(out: BinaryIO, header: BundleHeader, tokens, payload, pieces, trailer: dict | None = None) -> None:
    """Write a whole streamed bundle whose ``pieces`` (lists of segments) are all final (tests, tools)."""
    view = memoryview(payload).cast("B")
    out.write(encode_preamble(header, tokens, STREAMED_VERSION))
    for segments in pieces:
        head, parts = encode_piece(view, segments)
        out.write(head)
        for part in parts:
            out.write(part)
    out.write(encode_trailer(trailer or {}))
    out.write(encode_stream_end(len(pieces), sum(n for segments in pieces for _, n in segments)))

