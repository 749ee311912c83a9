"""The KV bundle: the framed binary format a prompt's state travels in.

This module stands alone: it imports nothing of the project, only the standard
library and ``crc32c`` (hardware CRC-32C), so that either end of a transfer, or
a tool inspecting a capture, can read it.

Layout (all integers little-endian)::

    magic      8 bytes   b"DISAGGKV"
    version    u16       FORMAT_VERSION
    header_len u32       length of the JSON header that follows
    header     JSON, UTF-8 (see BundleHeader)
    tokens     n_tokens x u32   the prompt's token ids, in order
    frames...  each starts with one tag byte:
        b"D"  u32 length, then that many payload bytes (senders stream 4 MiB
              frames, or the whole payload as one frame when it is sent
              from a file; readers check it in 4 MiB pieces either way)
        b"E"  u32 CRC-32C of the whole payload    (end marker: last frame)
        b"X"  u16 code, u32 length, UTF-8 message (error: the sender gave up)

The payload is opaque to this module. For the llama.cpp backend it is the
per-sequence state written by ``llama_state_seq_get_data`` (all K layers, then
all V layers, raw ggml-typed bytes); for ``neutral_kv`` it is dense K and V
arrays, layer after layer (see ``kv/neutral.py``); for token-id handoffs it is empty. What the
payload is and what produced it is written down in the header (``kind``,
``fingerprint``), never implied.

The CRC-32C (Castagnoli, computed by the CPU's crc32 instruction at several
GB/s, on a thread beside the receive or beside the import that follows it)
guards the transfer against truncation and corruption; the fingerprint guards
identity (model file digest, library version, cache types). The header carries
the size and checksum of the payload up front so a reader can allocate once and
check as it goes.

**Streamed bundles** (version ``STREAMED_VERSION``) leave while the prompt is
still being evaluated: the payload's parts go out as they become final, each in
a piece with its own checksum, and what only the end of the prefill knows (the
canary) comes last. The preamble is the same (its header's ``payload_bytes`` is
the final size, ``payload_crc32c`` is 0: the pieces carry the checksums), so the
fingerprint is checked before the first piece is used. Then::

    b"P"  u32 n segments, n x (u64 payload offset, u32 length), u32 CRC-32C of
          the piece's bytes in segment order, then those bytes: they belong at
          those offsets of the payload. No byte of the payload is sent twice.
    b"K"  u32 progress (prompt tokens evaluated so far): sent while nothing else
          is, so that a reader can tell a long prefill from a dead sender
    b"T"  u32 length, JSON object: the trailer (meta the header could not carry
          yet, such as the canary, and the prefill's own measurements)
    b"E"  u32 pieces, u64 bytes: the end; the reader checks that the pieces
          covered every payload byte exactly once
    b"X"  as above: the sender gave up (the prefill failed half-way)
"""
from __future__ import annotations

import bisect
import json
import os
import queue
import struct
import threading
from dataclasses import asdict, dataclass, field
from typing import BinaryIO, Callable, Iterator

import crc32c as _crc32c

MAGIC = b"DISAGGKV"
FORMAT_VERSION = 1
STREAMED_VERSION = 2  # pieces as they become final, the trailer last (see above)
CONTENT_TYPE = "application/octet-stream"

KIND_LLAMA_SEQ_STATE = "llama_seq_state"
KIND_TOKEN_IDS = "token_ids"
# Engine-neutral KV (layout in kv/neutral.py): per layer, K then V as dense
# (n_kv_heads, n_kv_tokens, head_dim) arrays, layer after layer; the header's
# ``meta["neutral"]`` gives dtype, shapes, positions, RoPE and head-dim order.
KIND_NEUTRAL_KV = "neutral_kv"
KINDS = (KIND_LLAMA_SEQ_STATE, KIND_TOKEN_IDS, KIND_NEUTRAL_KV)

TAG_DATA, TAG_END, TAG_ERROR = b"D", b"E", b"X"
TAG_PIECE, TAG_PROGRESS, TAG_TRAILER = b"P", b"K", b"T"  # streamed bundles only
DEFAULT_CHUNK = 4 << 20  # 4 MiB frames
MAX_FRAME = 0xFFFFFFFF  # a data frame's length is a u32
MAX_HEADER_BYTES = 1 << 20
MAX_TOKENS = 1 << 22

_PREAMBLE = struct.Struct("<8sHI")
_U32 = struct.Struct("<I")
_ERROR = struct.Struct("<HI")
_SEGMENT = struct.Struct("<QI")  # payload offset, length
_STREAM_END = struct.Struct("<IQ")  # pieces, bytes
MAX_SEGMENTS = 1 << 16
MAX_TRAILER_BYTES = 1 << 20


class BundleFormatError(ValueError):
    """The bytes are not a well-formed bundle (truncated, corrupted, foreign)."""


class BundleRemoteError(Exception):
    """The sender wrote an error frame instead of finishing the payload."""

    def __init__(self, code: int, message: str):
        super().__init__(f"sender aborted the bundle (code {code}): {message}")
        self.code = code
        self.message = message


@dataclass
class BundleHeader:
    kind: str
    n_tokens: int
    payload_bytes: int
    payload_crc32c: int
    fingerprint: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    token_dtype: str = "<u4"

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "BundleHeader":
        try:
            data = json.loads(raw.decode("utf-8"))
            header = cls(**data)
        except (UnicodeDecodeError, ValueError, TypeError) as exc:
            raise BundleFormatError(f"bundle header is not valid: {exc}") from None
        if header.kind not in KINDS:
            raise BundleFormatError(f"unknown bundle kind {header.kind!r}")
        if header.token_dtype != "<u4":
            raise BundleFormatError(f"unsupported token dtype {header.token_dtype!r}")
        if not 0 <= header.n_tokens <= MAX_TOKENS:
            raise BundleFormatError(f"implausible token count {header.n_tokens}")
        if header.payload_bytes < 0:
            raise BundleFormatError("negative payload size")
        return header


PARALLEL_PART = 8 << 20  # checksum a buffer on several threads when each gets at least this much
MAX_CHECKSUM_THREADS = 4  # memory bandwidth, not cores, is the limit beyond a few


def payload_checksum(payload, value: int = 0) -> int:
    """CRC-32C of a buffer (``value``: the checksum of the bytes before it).

    A large buffer is split in parts checksummed on threads at once (the
    checksum releases the GIL) and the parts' checksums are combined.
    """
    view = memoryview(payload).cast("B")
    parts = min(MAX_CHECKSUM_THREADS, os.cpu_count() or 1, len(view) // PARALLEL_PART)
    if parts < 2:
        return _crc32c.crc32c(view, value) & 0xFFFFFFFF
    step = -(-len(view) // parts)
    pieces = [view[i:i + step] for i in range(0, len(view), step)]
    crcs = [0] * len(pieces)

    def run(i: int) -> None:
        crcs[i] = _crc32c.crc32c(pieces[i]) & 0xFFFFFFFF

    workers = [threading.Thread(target=run, args=(i,), name="bundle-checksum") for i in range(1, len(pieces))]
    for worker in workers:
        worker.start()
    crc = _crc32c.crc32c(pieces[0], value) & 0xFFFFFFFF
    for worker in workers:
        worker.join()
    for piece, part in zip(pieces[1:], crcs[1:]):
        crc = crc32c_combine(crc, part, len(piece))
    return crc


# Combining checksums: CRC(A + B) from CRC(A), CRC(B) and len(B), by multiplying
# CRC(A) by x^(8 len(B)) modulo the (bit-reflected) Castagnoli polynomial.
_POLY = 0x82F63B78


def _multiply(a: int, b: int) -> int:
    """a * b modulo the polynomial, both bit-reflected (bit 31 is x^0)."""
    product, bit = 0, 1 << 31
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


_X_POW_2K = [1 << 30]  # x^(2^k) for k = 0, 1, ...: x^1, x^2, x^4, ...
for _ in range(31):
    _X_POW_2K.append(_multiply(_X_POW_2K[-1], _X_POW_2K[-1]))


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """The CRC-32C of A followed by B, given both CRCs and B's length in bytes."""
    power, k, n = 1 << 31, 3, len_b  # x^0, and x^(8 n) = x^(n 2^3)
    while n:
        if n & 1:
            power = _multiply(_X_POW_2K[k % 32], power)
        n >>= 1
        k += 1
    return _multiply(power, crc_a) ^ crc_b


def encode_tokens(tokens) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def decode_tokens(raw: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(raw) // 4}I", raw))


def encode_preamble(header: BundleHeader, tokens, version: int = FORMAT_VERSION) -> bytes:
    """Magic, version, header and token ids: everything before the frames."""
    if len(tokens) != header.n_tokens:
        raise ValueError(f"header says {header.n_tokens} tokens, got {len(tokens)}")
    raw = header.to_json()
    return _PREAMBLE.pack(MAGIC, version, len(raw)) + raw + encode_tokens(tokens)


def encode_frame_head(length: int) -> bytes:
    """What precedes ``length`` payload bytes in a data frame."""
    return TAG_DATA + _U32.pack(length)


def encode_end(header: BundleHeader) -> bytes:
    """The end marker: the last frame, carrying the whole payload's checksum."""
    return TAG_END + _U32.pack(header.payload_crc32c)


def encode_error(code: int, message: str) -> bytes:
    raw = message.encode("utf-8")
    return TAG_ERROR + _ERROR.pack(code, len(raw)) + raw


def iter_encoded(header: BundleHeader, tokens, payload, chunk_size: int = DEFAULT_CHUNK) -> Iterator[bytes]:
    """Yield the whole bundle as pieces ready for a socket.

    ``payload`` is any buffer (bytes, bytearray, ctypes array, memoryview); it is
    sliced through a memoryview, so no full copy of it is ever made here.
    """
    view = memoryview(payload).cast("B")
    if len(view) != header.payload_bytes:
        raise ValueError(f"header says {header.payload_bytes} payload bytes, got {len(view)}")
    yield encode_preamble(header, tokens)
    for start in range(0, len(view), chunk_size):
        piece = view[start:start + chunk_size]
        yield encode_frame_head(len(piece))
        yield piece
    yield encode_end(header)


def encode_single_frame(header: BundleHeader, tokens) -> tuple[bytes, bytes]:
    """The bytes that go before and after the payload when it travels as one data frame.

    ``prefix + payload + suffix`` is a whole bundle: a sender that holds the
    payload in a file can write these around it and send the file as it is.
    """
    if header.payload_bytes > MAX_FRAME:
        raise ValueError(f"a payload of {header.payload_bytes} bytes does not fit in one frame")
    return encode_preamble(header, tokens) + encode_frame_head(header.payload_bytes), encode_end(header)


def encoded_length(header: BundleHeader, chunk_size: int = DEFAULT_CHUNK) -> int:
    """Exact byte length of ``iter_encoded`` for this header (for Content-Length)."""
    frames = -(-header.payload_bytes // chunk_size)
    return (_PREAMBLE.size + len(header.to_json()) + 4 * header.n_tokens
            + frames * (1 + _U32.size) + header.payload_bytes + 1 + _U32.size)


class _RunningChecksum:
    """CRC-32C of a payload's pieces, in order, as they arrive.

    Small payloads are checked on the receiving thread. Large ones on a thread of
    their own, which either runs ``alongside`` the receive (checking piece i while
    piece i+1 arrives: free when the wire sets the pace, as from another machine)
    or is started once the last byte is in (``start``) and overlaps whatever the
    receiver does next: when sender and receiver share a machine, the transfer
    is a memory-bound copy using every core, and a checksum beside it slows it.
    """

    THREADED_FROM = 8 << 20

    def __init__(self, total: int, alongside: bool = True):
        self.value = 0
        self._queue = queue.SimpleQueue() if total >= self.THREADED_FROM else None
        self._worker = None
        if alongside:
            self.start()

    def _run(self) -> None:
        while (piece := self._queue.get()) is not None:
            self.value = payload_checksum(piece, self.value)

    def feed(self, piece: memoryview) -> None:
        if self._queue is None:
            self.value = payload_checksum(piece, self.value)
        else:
            self._queue.put(piece)

    def start(self) -> None:
        """Start the checksum thread of a large payload, if it is not running yet."""
        if self._queue is not None and self._worker is None:
            self._worker = threading.Thread(target=self._run, name="bundle-checksum", daemon=True)
            self._worker.start()

    def result(self) -> int:
        """The checksum of everything fed, once it is computed (the thread is done with the buffer then)."""
        if self._queue is not None:
            self.start()
            self._queue.put(None)
            self._worker.join()
            self._queue = None
        return self.value


@dataclass
class Arrived:
    """A bundle whose bytes have all arrived and whose payload checksum may still be running.

    ``check()`` waits for it and raises ``BundleFormatError`` on a mismatch; use
    nothing computed from the payload before it returns. Call it from one thread.
    """

    header: BundleHeader
    tokens: list
    payload: object
    _checksum: _RunningChecksum = field(repr=False)
    _declared: int = field(repr=False)

    def check(self) -> None:
        crc = self._checksum.result()
        if crc != self.header.payload_crc32c or crc != self._declared:
            raise BundleFormatError(
                f"bundle payload checksum mismatch: computed CRC-32C {crc:08x}, "
                f"header {self.header.payload_crc32c:08x}, end marker {self._declared:08x}"
            )


def _read_exact(src: BinaryIO, n: int, what: str) -> bytes:
    data = src.read(n)
    while data is not None and len(data) < n:
        more = src.read(n - len(data))
        if not more:
            break
        data += more
    if data is None or len(data) != n:
        got = 0 if data is None else len(data)
        raise BundleFormatError(f"bundle truncated in {what}: expected {n} bytes, got {got}")
    return data


def _readinto_exact(src: BinaryIO, view: memoryview, what: str) -> None:
    filled = 0
    while filled < len(view):
        n = src.readinto(view[filled:])
        if not n:
            raise BundleFormatError(f"bundle truncated in {what}: {len(view) - filled} bytes missing")
        filled += n


def read_preamble(src: BinaryIO, versions: tuple = (FORMAT_VERSION,)) -> tuple[BundleHeader, list[int]]:
    """The header and token ids of a bundle of one of ``versions`` (``read_any_preamble`` says which)."""
    _, header, tokens = read_any_preamble(src, versions)
    return header, tokens


def read_any_preamble(src: BinaryIO, versions: tuple = (FORMAT_VERSION, STREAMED_VERSION)
                      ) -> tuple[int, BundleHeader, list[int]]:
    """The version, header and token ids of a bundle whose version is one of ``versions``."""
    magic, version, header_len = _PREAMBLE.unpack(_read_exact(src, _PREAMBLE.size, "preamble"))
    if magic != MAGIC:
        raise BundleFormatError("not a KV bundle (bad magic bytes)")
    if version not in versions:
        expected = " or ".join(str(v) for v in versions)
        raise BundleFormatError(f"bundle format version {version} is not supported (expected {expected})")
    if header_len > MAX_HEADER_BYTES:
        raise BundleFormatError(f"bundle header of {header_len} bytes is too large")
    header = BundleHeader.from_json(_read_exact(src, header_len, "header"))
    tokens = decode_tokens(_read_exact(src, 4 * header.n_tokens, "token ids"))
    return version, header, tokens


def receive_bundle(src: BinaryIO, max_payload_bytes: int | None = None,
                   allocate: Callable[[int], object] = bytearray, checksum_alongside: bool = True,
                   check_header: Callable[[BundleHeader], None] | None = None,
                   preamble: tuple[BundleHeader, list] | None = None) -> Arrived:
    """Read one bundle; return it as soon as its last byte is in, its checksum perhaps still running.

    The payload is read straight into one buffer from ``allocate(size)`` (the
    only full copy made on the receiving side). Its CRC-32C is computed as the
    pieces arrive, or from ``checksum_alongside=False`` only once all have (see
    ``_RunningChecksum``), and ``Arrived.check`` compares it with both the
    header and the end marker. Everything else (framing, sizes, truncation) is
    checked here. ``check_header`` sees the header before any payload byte is
    read, and may raise to stop there. ``preamble``: the header and token ids,
    when the caller has read them already (``read_any_preamble``).
    """
    header, tokens = preamble if preamble is not None else read_preamble(src)
    if check_header is not None:
        check_header(header)
    if max_payload_bytes is not None and header.payload_bytes > max_payload_bytes:
        raise BundleFormatError(
            f"bundle payload of {header.payload_bytes} bytes exceeds the limit of {max_payload_bytes}"
        )
    payload = allocate(header.payload_bytes)
    checksum = _RunningChecksum(header.payload_bytes, alongside=checksum_alongside)
    try:
        declared = _read_frames(src, memoryview(payload), checksum)
    except BaseException:
        checksum.result()  # the thread lets go of the buffer before the caller sees the error
        raise
    checksum.start()  # a checksum held back until the last byte begins now
    return Arrived(header, tokens, payload, checksum, declared)


def _read_frames(src: BinaryIO, view: memoryview, checksum: _RunningChecksum) -> int:
    """Fill ``view`` from data frames; return the checksum the end marker declares."""
    filled = 0
    while True:
        tag = _read_exact(src, 1, "frame tag")
        if tag == TAG_DATA:
            (length,) = _U32.unpack(_read_exact(src, 4, "frame length"))
            if filled + length > len(view):
                raise BundleFormatError("bundle payload is longer than its header says")
            # however large the frame, check it in pieces as they arrive
            for start in range(filled, filled + length, DEFAULT_CHUNK):
                piece = view[start:min(start + DEFAULT_CHUNK, filled + length)]
                _readinto_exact(src, piece, "payload")
                checksum.feed(piece)
            filled += length
        elif tag == TAG_END:
            (declared,) = _U32.unpack(_read_exact(src, 4, "end marker"))
            if filled != len(view):
                raise BundleFormatError(f"bundle payload truncated: {filled} of {len(view)} bytes")
            return declared
        elif tag == TAG_ERROR:
            code, length = _ERROR.unpack(_read_exact(src, _ERROR.size, "error frame"))
            raise BundleRemoteError(code, _read_exact(src, length, "error message").decode("utf-8", "replace"))
        else:
            raise BundleFormatError(f"unknown frame tag {tag!r}")


# -- streamed bundles ------------------------------------------------------------------------------

def encode_piece(view: memoryview, segments) -> tuple[bytes, list[memoryview]]:
    """A piece frame for ``segments`` ((offset, length) pairs) of the payload ``view``: its head (tag,
    segment table, CRC-32C of the bytes in segment order) and the bytes themselves, as views."""
    if not 0 < len(segments) <= MAX_SEGMENTS:
        raise ValueError(f"a piece has 1 to {MAX_SEGMENTS} segments, got {len(segments)}")
    parts, crc = [], 0
    for offset, length in segments:
        if offset < 0 or length <= 0 or offset + length > len(view):
            raise ValueError(f"segment ({offset}, {length}) is outside a payload of {len(view)} bytes")
        parts.append(view[offset:offset + length])
        crc = payload_checksum(parts[-1], crc)
    head = (TAG_PIECE + _U32.pack(len(segments)) + b"".join(_SEGMENT.pack(o, n) for o, n in segments)
            + _U32.pack(crc))
    return head, parts


def encode_progress(done: int) -> bytes:
    return TAG_PROGRESS + _U32.pack(max(0, min(done, 0xFFFFFFFF)))


def encode_trailer(trailer: dict) -> bytes:
    raw = json.dumps(trailer, separators=(",", ":"), sort_keys=True).encode()
    if len(raw) > MAX_TRAILER_BYTES:
        raise ValueError(f"a trailer of {len(raw)} bytes is too large")
    return TAG_TRAILER + _U32.pack(len(raw)) + raw


def encode_stream_end(pieces: int, nbytes: int) -> bytes:
    return TAG_END + _STREAM_END.pack(pieces, nbytes)


class Coverage:
    """Which bytes of a payload of ``size`` bytes pieces have filled: each byte at most once."""

    def __init__(self, size: int):
        self.size, self.filled = size, 0
        self._starts: list[int] = []  # disjoint filled ranges [start, end), sorted, adjacent ones merged
        self._ends: list[int] = []

    @property
    def complete(self) -> bool:
        return self.filled == self.size

    def add(self, offset: int, length: int) -> None:
        end = offset + length
        if length <= 0 or offset < 0 or end > self.size:
            raise BundleFormatError(f"piece segment ({offset}, {length}) is outside the payload of {self.size} bytes")
        i = bisect.bisect_right(self._starts, offset)
        if (i and self._ends[i - 1] > offset) or (i < len(self._starts) and self._starts[i] < end):
            raise BundleFormatError(f"piece segment ({offset}, {length}) overlaps bytes already received")
        joins_left = bool(i) and self._ends[i - 1] == offset
        joins_right = i < len(self._starts) and self._starts[i] == end
        if joins_left and joins_right:
            self._ends[i - 1] = self._ends.pop(i)
            self._starts.pop(i)
        elif joins_left:
            self._ends[i - 1] = end
        elif joins_right:
            self._starts[i] = offset
        else:
            self._starts.insert(i, offset)
            self._ends.insert(i, end)
        self.filled += length


@dataclass(frozen=True)
class Piece:
    """A piece as received: its segments ((payload offset, length) pairs) are in the payload, checked."""

    segments: tuple
    nbytes: int


def read_stream_frame(src: BinaryIO, view: memoryview, coverage: Coverage) -> tuple[str, object]:
    """Read the next frame of a streamed bundle whose payload is ``view``.

    Returns ``("piece", Piece)`` once the piece's bytes are in place and their
    checksum matched, ``("progress", tokens)``, ``("trailer", dict)`` or
    ``("end", (pieces, bytes))`` (after checking that every byte arrived);
    raises ``BundleFormatError`` for anything malformed (a bad checksum, an
    overlap, a truncated frame) and ``BundleRemoteError`` for an error frame.
    """
    tag = _read_exact(src, 1, "frame tag")
    if tag == TAG_PIECE:
        (n,) = _U32.unpack(_read_exact(src, 4, "piece head"))
        if not 0 < n <= MAX_SEGMENTS:
            raise BundleFormatError(f"implausible segment count {n} in a piece")
        table = _read_exact(src, n * _SEGMENT.size + 4, "piece head")
        segments = tuple(_SEGMENT.unpack_from(table, i * _SEGMENT.size) for i in range(n))
        (declared,) = _U32.unpack_from(table, n * _SEGMENT.size)
        crc = 0
        for offset, length in segments:
            coverage.add(offset, length)
            part = view[offset:offset + length]
            _readinto_exact(src, part, "piece")
            crc = payload_checksum(part, crc)
        if crc != declared:
            raise BundleFormatError(f"piece checksum mismatch: computed CRC-32C {crc:08x}, declared {declared:08x}")
        return "piece", Piece(segments, sum(length for _, length in segments))
    if tag == TAG_PROGRESS:
        return "progress", _U32.unpack(_read_exact(src, 4, "progress"))[0]
    if tag == TAG_TRAILER:
        (length,) = _U32.unpack(_read_exact(src, 4, "trailer length"))
        if length > MAX_TRAILER_BYTES:
            raise BundleFormatError(f"trailer of {length} bytes is too large")
        try:
            trailer = json.loads(_read_exact(src, length, "trailer").decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise BundleFormatError(f"bundle trailer is not valid JSON: {exc}") from None
        if not isinstance(trailer, dict):
            raise BundleFormatError("bundle trailer is not a JSON object")
        return "trailer", trailer
    if tag == TAG_END:
        pieces, nbytes = _STREAM_END.unpack(_read_exact(src, _STREAM_END.size, "end marker"))
        if nbytes != coverage.filled or not coverage.complete:
            raise BundleFormatError(f"streamed bundle incomplete: {coverage.filled} of {coverage.size} payload bytes "
                                    f"arrived, the sender says it sent {nbytes}")
        return "end", (pieces, nbytes)
    if tag == TAG_ERROR:
        code, length = _ERROR.unpack(_read_exact(src, _ERROR.size, "error frame"))
        raise BundleRemoteError(code, _read_exact(src, length, "error message").decode("utf-8", "replace"))
    raise BundleFormatError(f"unknown frame tag {tag!r} in a streamed bundle")
