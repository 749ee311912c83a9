"""llama.cpp's per-sequence state, as far as its stream count goes.

A server with several slots gives each slot a KV stream of its own (``kv_unified``
off): sequences then never share cells, so one request's numerics do not depend on
what else is running (a unified cache shifted first-token logits by up to 0.7 when
another sequence held cells; per-slot streams by 0). But llama.cpp writes a
sequence's state with the context's stream count in it and refuses to read it into
a context with another count. So bundles travel in the **single-stream** form that
a one-slot context writes (the form every earlier bundle had), and each end
converts in place:

    prefix (8 bytes)                   opaque to us
    then, per KV cache (one; two for sliding-window models: full layers, then SWA):
      n_stream   u32
      per stream: cell_count u32, and when it is not 0:
        cells    cell_count x (pos i32, n_seq_id u32, n_seq_id x seq_id i32)
        v_trans u32, n_layer u32
        K        per layer: type i32, row_size u64, cell_count x row_size bytes
        V        per layer: type i32, row_size u64, cell_count x row_size bytes          (v_trans 0)
                 per layer: type i32, el_size u32, n_embd u32, n_embd x cell_count x el_size (v_trans 1)

A sequence has cells in one stream only, and llama.cpp reads a non-empty stream
block into the destination sequence's stream wherever the block stands, so
converting is: drop (export) or add (import) the empty streams' zero counts and
rewrite ``n_stream``. Only a few bytes move for a one-cache model; the second
cache of a sliding-window model (the window's cells) is shifted by a memmove.

**Where a cell's rows lie** (``SeqLayout``): in the single-stream state of a
one-cache model with V not transposed, the cells are in position order and each
layer's K (then V) rows are one contiguous run of ``cell_count x row_size``
bytes, so the state of ``n`` cells has a fixed shape: the rows of cells
``c0..c1`` of layer ``l`` lie at an offset known before any of them exists.
That is what lets a prefill server send each prompt chunk's rows as soon as the
chunk is evaluated, into the place they take in the whole state (a streamed
bundle, ``bundle.py``), and a decode server lay that state out before the rows
arrive. The **skeleton** is every byte of the state that is not a row (the
prefix, the cells' metadata, the per-layer type and row size): the first piece
of a streamed ``llama_seq_state`` bundle carries it.
"""
from __future__ import annotations

import bisect
import ctypes
import struct
from dataclasses import dataclass

PREFIX = 8
_U32 = struct.Struct("<I")
_I32_U64 = struct.Struct("<iQ")
_CELL = struct.Struct("<iIi")  # pos, n_seq_id (1), seq_id: a cell of one sequence, without extra data


class StateLayoutError(ValueError):
    """The bytes are not a per-sequence state this module understands."""


def _u32(view, at: int) -> int:
    if at + 4 > len(view):
        raise StateLayoutError(f"state truncated at byte {at}")
    return _U32.unpack_from(view, at)[0]


def _block_end(view, at: int, cells: int) -> int:
    """Where the data of one non-empty stream block that starts at ``at`` (after its cell count) ends."""
    for _ in range(cells):
        n_seq = _u32(view, at + 4)
        if n_seq > 64:
            raise StateLayoutError(f"implausible seq id count {n_seq} in a cell")
        at += 8 + 4 * n_seq
    v_trans, n_layer = _u32(view, at), _u32(view, at + 4)
    at += 8
    for _ in range(n_layer):  # K
        _, row = _I32_U64.unpack_from(view, at)
        at += 12 + row * cells
    for _ in range(n_layer):  # V
        if v_trans:
            el, n_embd = _u32(view, at + 4), _u32(view, at + 8)
            at += 12 + el * n_embd * cells
        else:
            _, row = _I32_U64.unpack_from(view, at)
            at += 12 + row * cells
    if at > len(view):
        raise StateLayoutError("state shorter than its layer sizes say")
    return at


def sections(view) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
    """Each KV cache's section: (offset of n_stream, n_stream, [(stream, block start, block end)])."""
    out, at = [], PREFIX
    while at < len(view):
        n_stream = _u32(view, at)
        if not 0 < n_stream <= 4096:
            raise StateLayoutError(f"implausible stream count {n_stream} at byte {at}")
        start, at, blocks = at, at + 4, []
        for s in range(n_stream):
            cells = _u32(view, at)
            if cells:
                end = _block_end(view, at + 4, cells)
                blocks.append((s, at, end))
                at = end
            else:
                at += 4
        if len(blocks) > 1:
            raise StateLayoutError("a sequence's state has cells in more than one stream")
        out.append((start, n_stream, blocks))
    return out


def to_single_stream(buf: memoryview) -> memoryview:
    """The single-stream form of a state written by a context with several streams, in place.

    Returns a view of ``buf`` (it may start a few bytes in). Bytes move only to
    close the gaps the empty streams left; for a one-cache model that is the
    12-byte prefix.
    """
    view = memoryview(buf).cast("B")
    parts = sections(view)
    if all(n == 1 for _, n, _ in parts):
        return view
    # the pieces to keep, in order: prefix, then per section a new n_stream=1 and its block (or a zero count)
    pieces: list[tuple[int, int] | bytes] = [(0, PREFIX)]
    for _, _, blocks in parts:
        pieces.append(_U32.pack(1))
        pieces.append((blocks[0][1], blocks[0][2]) if blocks else _U32.pack(0))
    # the first block stays where it is; what comes before it is written just in front of it
    first = next((i for i, p in enumerate(pieces) if isinstance(p, tuple) and p[0] != 0), None)
    if first is None:  # no cells at all (a one-token prompt): a few bytes, built anew
        return memoryview(bytearray(b"".join(bytes(view[p[0]:p[1]]) if isinstance(p, tuple) else p for p in pieces)))
    head = b"".join(bytes(view[p[0]:p[1]]) if isinstance(p, tuple) else p for p in pieces[:first])
    start = pieces[first][0] - len(head)
    view[start:start + len(head)] = head
    at = pieces[first][1]
    for piece in pieces[first + 1:]:
        if isinstance(piece, bytes):
            view[at:at + len(piece)] = piece
            at += len(piece)
        else:
            n = piece[1] - piece[0]
            if piece[0] != at:
                _memmove(view, at, piece[0], n)
            at += n
    return view[start:at]


def to_streams(buf: memoryview, n_stream: int, headroom: int, tailroom: int) -> memoryview:
    """The ``n_stream``-stream form of a single-stream state lying in ``buf[headroom:len(buf) - tailroom]``.

    Each section gets ``n_stream`` and the empty streams' zero counts in front of
    its block: the first section's go into the headroom (its block stays put),
    each later section's block moves right into the tailroom (``extra_room``).
    """
    view = memoryview(buf).cast("B")
    state_len = len(view) - headroom - tailroom
    state = view[headroom:headroom + state_len]
    if n_stream == 1:
        return state
    parts = sections(state)
    if any(n != 1 for _, n, _ in parts):
        raise StateLayoutError("expected a single-stream state")
    pad = 4 * (n_stream - 1)
    if headroom < pad or tailroom < pad * (len(parts) - 1):
        raise StateLayoutError("not enough room around the state to convert it")
    header = _U32.pack(n_stream) + bytes(pad)
    bounds = [start for start, _, _ in parts] + [state_len]
    for k in range(len(parts) - 1, 0, -1):  # last first: nothing is overwritten before it has moved
        block, block_end = headroom + bounds[k] + 4, headroom + bounds[k + 1]
        _memmove(view, block + pad * k, block, block_end - block)
        at = block + pad * k - len(header)
        view[at:at + len(header)] = header
    prefix = bytes(state[:PREFIX])
    start = headroom - pad
    view[start:start + PREFIX] = prefix
    view[start + PREFIX:start + PREFIX + len(header)] = header
    return view[start:start + state_len + pad * len(parts)]


def extra_room(n_stream: int, n_sections: int = 2) -> tuple[int, int]:
    """(headroom, tailroom) ``to_streams`` needs for a state of up to ``n_sections`` KV caches."""
    pad = 4 * (n_stream - 1)
    return pad, pad * (n_sections - 1)


def _memmove(view: memoryview, dst: int, src: int, n: int) -> None:
    base = ctypes.addressof(ctypes.c_char.from_buffer(view))
    ctypes.memmove(base + dst, base + src, n)


@dataclass(frozen=True)
class SeqLayout:
    """The shape of a single-stream, one-cache state with V rows (not transposed), any number of cells.

    ``prefix`` is the state's first 8 bytes (llama.cpp's magic, then the
    exporting sequence's id, which the importer ignores); ``k_rows`` and
    ``v_rows`` are (ggml type, row bytes) per layer.
    """

    magic: bytes
    k_rows: tuple
    v_rows: tuple

    @classmethod
    def of_state(cls, state) -> "SeqLayout":
        """The layout of an exported single-stream state; ``StateLayoutError`` when it has none of this shape
        (two caches: a sliding-window model; V transposed: no flash attention; cells with extra data)."""
        view = memoryview(state).cast("B")
        parts = sections(view)
        if len(parts) != 1 or parts[0][1] != 1 or not parts[0][2]:
            raise StateLayoutError("the state is not one cache of one stream with cells (a sliding-window model "
                                   "keeps two)")
        cells = _u32(view, PREFIX + 4)
        at = PREFIX + 8
        for i in range(cells):
            if len(view) < at + _CELL.size:
                raise StateLayoutError("state truncated in its cells")
            pos, n_seq, _ = _CELL.unpack_from(view, at)
            if n_seq != 1:
                raise StateLayoutError(f"cell {i} belongs to {n_seq} sequences, not one")
            at += _CELL.size
        v_trans, n_layer = _u32(view, at), _u32(view, at + 4)
        if v_trans:
            raise StateLayoutError("V is stored transposed (flash attention off): its rows are not contiguous")
        at += 8
        rows = []
        for _ in range(2 * n_layer):
            kind, row = _I32_U64.unpack_from(view, at)
            rows.append((kind, row))
            at += 12 + row * cells
        layout = cls(bytes(view[:4]), tuple(rows[:n_layer]), tuple(rows[n_layer:]))
        if at != len(view) or layout.size(cells) != len(view):
            raise StateLayoutError(f"state of {len(view)} bytes, but its layout says {layout.size(cells)}")
        return layout

    @property
    def n_layer(self) -> int:
        return len(self.k_rows)

    def _rows_start(self, n: int) -> int:
        return PREFIX + 8 + _CELL.size * n + 8

    def size(self, n: int) -> int:
        """Bytes of the state of ``n`` cells."""
        return self._rows_start(n) + sum(12 + row * n for _, row in (*self.k_rows, *self.v_rows))

    def row_regions(self, n: int) -> list[tuple[int, str, int, int]]:
        """(offset of the first row, "k" or "v", layer, row bytes) of every layer's rows, in order."""
        out, at = [], self._rows_start(n)
        for kind, rows in (("k", self.k_rows), ("v", self.v_rows)):
            for layer, (_, row) in enumerate(rows):
                out.append((at + 12, kind, layer, row))
                at += 12 + row * n
        return out

    def skeleton_segments(self, n: int) -> list[tuple[int, int]]:
        """Where the bytes of the state of ``n`` cells that are not rows lie, as (offset, length) segments."""
        return [(0, self._rows_start(n))] + [(start - 12, 12) for start, _, _, _ in self.row_regions(n)]

    def skeleton(self, n: int, seq_id: int, into) -> list[tuple[int, int]]:
        """Write every byte of the state of ``n`` cells (positions 0..n-1) that is not a row into ``into``
        (a buffer of ``size(n)`` bytes); return where they lie (``skeleton_segments``)."""
        view = memoryview(into).cast("B")
        head = self._rows_start(n)
        view[:PREFIX] = self.magic + struct.pack("<i", seq_id)
        view[PREFIX:PREFIX + 8] = struct.pack("<II", 1, n)
        cells = bytearray(_CELL.size * n)
        for i in range(n):
            _CELL.pack_into(cells, i * _CELL.size, i, 1, seq_id)
        view[PREFIX + 8:head - 8] = cells
        view[head - 8:head] = struct.pack("<II", 0, self.n_layer)
        for (start, _, _, _), (ggml_type, row) in zip(self.row_regions(n), (*self.k_rows, *self.v_rows)):
            view[start - 12:start] = _I32_U64.pack(ggml_type, row)
        return self.skeleton_segments(n)

    def rows(self, n: int, c0: int, c1: int) -> list[list[tuple[int, int]]]:
        """Where cells ``c0..c1-1`` of a state of ``n`` cells lie: per layer, its K rows and its V rows."""
        regions = self.row_regions(n)
        half = len(regions) // 2
        return [[(k + c0 * krow, (c1 - c0) * krow), (v + c0 * vrow, (c1 - c0) * vrow)]
                for (k, _, _, krow), (v, _, _, vrow) in zip(regions[:half], regions[half:])]

    def locate(self, n: int, offset: int, length: int) -> tuple[str, int, int, int]:
        """Which rows the bytes ``offset..offset+length`` of a state of ``n`` cells are: (kind, layer, first
        cell, cells); ``StateLayoutError`` when they are not whole rows of one layer."""
        regions = self.row_regions(n)
        i = bisect.bisect_right([start for start, _, _, _ in regions], offset) - 1
        if i < 0:
            raise StateLayoutError(f"bytes at {offset} are not rows")
        start, kind, layer, row = regions[i]
        if (offset - start) % row or length % row or offset + length > start + row * n:
            raise StateLayoutError(f"bytes {offset}..{offset + length} are not whole rows of one layer")
        return kind, layer, (offset - start) // row, length // row
