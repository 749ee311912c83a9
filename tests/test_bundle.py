"""The KV bundle wire format, round-tripped through byte buffers."""
import io
import os
import struct
import time

import pytest

from disaggregated_inference.kv import bundle
from disaggregated_inference.testing.bundles import read_bundle, to_bytes, write_bundle


def make(payload: bytes = None, tokens=(1, 2, 3, 40000), kind=bundle.KIND_LLAMA_SEQ_STATE):
    payload = os.urandom(3 * 1024 * 1024 + 17) if payload is None else payload
    header = bundle.BundleHeader(kind=kind, n_tokens=len(tokens), payload_bytes=len(payload),
                                 payload_crc32c=bundle.payload_checksum(payload),
                                 fingerprint={"model_sha256": "ab" * 32, "flash_attn": True},
                                 meta={"stop": ["<|im_end|>"]})
    return header, list(tokens), payload


def test_round_trip_preserves_header_tokens_and_payload():
    header, tokens, payload = make()
    raw = to_bytes(header, tokens, payload)
    got_header, got_tokens, got_payload = read_bundle(io.BytesIO(raw))
    assert got_header == header
    assert got_tokens == tokens
    assert bytes(got_payload) == payload
    assert len(raw) == bundle.encoded_length(header)


def test_payload_is_framed_in_chunks_without_copying_the_source():
    header, tokens, payload = make(payload=bytes(range(256)) * 1000)
    pieces = list(bundle.iter_encoded(header, tokens, bytearray(payload), chunk_size=4096))
    data_pieces = [p for p in pieces if isinstance(p, memoryview)]
    assert len(data_pieces) == -(-len(payload) // 4096)
    assert all(len(p) <= 4096 for p in data_pieces)
    out = io.BytesIO()
    write_bundle(out, header, tokens, payload, chunk_size=4096)
    assert b"".join(bytes(p) for p in pieces) == out.getvalue()
    assert bundle.encoded_length(header, chunk_size=4096) == len(out.getvalue())


def test_empty_payload_token_id_bundle_round_trips():
    header, tokens, payload = make(payload=b"", kind=bundle.KIND_TOKEN_IDS)
    got_header, got_tokens, got_payload = read_bundle(io.BytesIO(to_bytes(header, tokens, payload)))
    assert got_header.kind == bundle.KIND_TOKEN_IDS and got_tokens == tokens and got_payload == bytearray()


@pytest.mark.parametrize("cut", [3, 20, 200, 5000, 1])
def test_truncated_bundle_is_rejected_with_where_it_stopped(cut):
    header, tokens, payload = make(payload=os.urandom(10000))
    raw = to_bytes(header, tokens, payload)
    with pytest.raises(bundle.BundleFormatError, match="truncated"):
        read_bundle(io.BytesIO(raw[: len(raw) - cut] if cut != 3 else raw[:3]))


def test_corrupted_payload_byte_fails_the_checksum():
    header, tokens, payload = make(payload=os.urandom(10000))
    raw = bytearray(to_bytes(header, tokens, payload))
    raw[len(raw) - 100] ^= 0xFF  # inside the last data frame
    with pytest.raises(bundle.BundleFormatError, match="checksum mismatch"):
        read_bundle(io.BytesIO(bytes(raw)))


def test_foreign_bytes_and_other_versions_are_refused():
    with pytest.raises(bundle.BundleFormatError, match="bad magic"):
        read_bundle(io.BytesIO(b"GGUF" + b"\0" * 100))
    header, tokens, payload = make(payload=b"xyz")
    raw = bytearray(to_bytes(header, tokens, payload))
    struct.pack_into("<H", raw, 8, 99)
    with pytest.raises(bundle.BundleFormatError, match="version 99"):
        read_bundle(io.BytesIO(bytes(raw)))


def test_payload_longer_than_declared_is_refused():
    header, tokens, payload = make(payload=b"abcdef")
    raw = bundle.encode_preamble(header, tokens) + b"D" + struct.pack("<I", 7) + b"abcdefg"
    with pytest.raises(bundle.BundleFormatError, match="longer than its header"):
        read_bundle(io.BytesIO(raw))


def test_error_frame_from_the_sender_is_raised_with_its_code():
    header, tokens, payload = make(payload=b"abcdef")
    raw = bundle.encode_preamble(header, tokens) + bundle.encode_error(7, "model unloaded")
    with pytest.raises(bundle.BundleRemoteError) as info:
        read_bundle(io.BytesIO(raw))
    assert info.value.code == 7 and "model unloaded" in str(info.value)


def test_payload_limit_is_enforced_before_allocating():
    header, tokens, payload = make(payload=b"x" * 1000)
    with pytest.raises(bundle.BundleFormatError, match="exceeds the limit"):
        read_bundle(io.BytesIO(to_bytes(header, tokens, payload)), max_payload_bytes=999)


def test_header_rejects_unknown_kind_and_bad_token_counts():
    with pytest.raises(bundle.BundleFormatError, match="unknown bundle kind"):
        bundle.BundleHeader.from_json(b'{"kind":"pickle","n_tokens":1,"payload_bytes":0,"payload_crc32c":0}')
    with pytest.raises(bundle.BundleFormatError, match="not valid"):
        bundle.BundleHeader.from_json(b'{"kind":"token_ids","n_tokens":1,"surprise":1,'
                                      b'"payload_bytes":0,"payload_crc32c":0}')
    with pytest.raises(ValueError, match="header says 2 tokens"):
        bundle.encode_preamble(make(payload=b"", tokens=(1, 2))[0], [1])


def test_one_large_frame_reads_like_many_and_a_damaged_byte_in_it_is_caught():
    header, tokens, payload = make(payload=os.urandom(9 * 1024 * 1024 + 5))  # over two reading pieces
    prefix, suffix = bundle.encode_single_frame(header, tokens)
    raw = prefix + payload + suffix
    assert len(raw) == len(to_bytes(header, tokens, payload)) - 2 * 5  # two frame headers fewer
    got_header, got_tokens, got_payload = read_bundle(io.BytesIO(raw))
    assert got_header == header and got_tokens == tokens and bytes(got_payload) == payload
    damaged = bytearray(raw)
    damaged[len(prefix) + 8 * 1024 * 1024 + 1] ^= 0x01  # in the last piece of the frame
    with pytest.raises(bundle.BundleFormatError, match="checksum mismatch"):
        read_bundle(io.BytesIO(bytes(damaged)))


def test_a_payload_over_four_gib_does_not_pretend_to_fit_one_frame():
    header = bundle.BundleHeader(bundle.KIND_LLAMA_SEQ_STATE, 0, bundle.MAX_FRAME + 1, 0)
    with pytest.raises(ValueError, match="does not fit in one frame"):
        bundle.encode_single_frame(header, [])


@pytest.mark.parametrize("len_a,len_b", [(0, 0), (0, 5), (5, 0), (1, 1), (1000, 3), (4096, 65537)])
def test_checksums_of_parts_combine_into_the_checksum_of_the_whole(len_a, len_b):
    a, b = os.urandom(len_a), os.urandom(len_b)
    whole = bundle.payload_checksum(a + b)
    assert bundle.crc32c_combine(bundle.payload_checksum(a), bundle.payload_checksum(b), len_b) == whole
    assert bundle.payload_checksum(b, bundle.payload_checksum(a)) == whole


def test_a_large_payload_checksummed_on_threads_matches_the_plain_checksum():
    import crc32c

    payload = os.urandom(1 << 20) * (4 * bundle.PARALLEL_PART // (1 << 20)) + b"tail"
    assert bundle.payload_checksum(payload) == crc32c.crc32c(payload)
    assert bundle.payload_checksum(payload, 12345) == crc32c.crc32c(payload, 12345)
    assert bundle.payload_checksum(bytearray(payload)) == crc32c.crc32c(payload)


def test_a_large_bundle_arrives_before_its_checksum_is_done_and_the_check_still_catches_damage():
    header, tokens, payload = make(payload=os.urandom(bundle._RunningChecksum.THREADED_FROM + 12345))
    raw = to_bytes(header, tokens, payload)
    arrived = bundle.receive_bundle(io.BytesIO(raw))
    arrived.check()
    arrived.check()  # again: the same answer, at once
    assert arrived.header == header and arrived.tokens == tokens and bytes(arrived.payload) == payload
    damaged = bytearray(raw)
    damaged[len(raw) - 100] ^= 0x01  # in the payload's last frame
    arrived = bundle.receive_bundle(io.BytesIO(bytes(damaged)))  # framing and sizes are fine: no error yet
    with pytest.raises(bundle.BundleFormatError, match="checksum mismatch"):
        arrived.check()


class SlowWire(io.BytesIO):
    """Bytes that arrive in pieces with pauses between them, as from a socket."""

    def readinto(self, buffer):
        time.sleep(0.005)
        return super().readinto(memoryview(buffer)[:1 << 20])


@pytest.mark.parametrize("alongside", [True, False])
def test_a_large_payload_is_checked_as_it_arrives_or_only_once_all_of_it_has(monkeypatch, alongside):
    raw = to_bytes(*make(payload=os.urandom(bundle._RunningChecksum.THREADED_FROM + 1)))
    src = SlowWire(raw)
    seen_at = []
    plain = bundle.payload_checksum

    def watched(piece, value=0):
        seen_at.append(src.tell())
        return plain(piece, value)

    monkeypatch.setattr(bundle, "payload_checksum", watched)
    bundle.receive_bundle(src, checksum_alongside=alongside).check()
    assert len(seen_at) >= 3
    assert (min(seen_at) < len(raw)) is alongside  # held back: every piece checked after the last byte was read
