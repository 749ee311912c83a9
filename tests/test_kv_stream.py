"""The streamed KV bundle (the overlapped handoff): its wire format, the sender, the receiver, the layout.

No servers here: byte buffers, a socket pair, and the generated tiny models in this process. The
servers' side of it (real gunicorn processes, failures half-way) is tests/test_streamed_handoff.py.
"""
from __future__ import annotations

import io
import os
import socket
import struct
import threading
import time

import pytest

from disaggregated_inference.errors import BundleError, UpstreamError
from disaggregated_inference.kv import bundle, llama_state, stream
from disaggregated_inference.kv.receive import Incoming, KVRef, _Deadline
from disaggregated_inference.testing.bundles import read_bundle, read_streamed, write_streamed


def header(size: int, tokens=(1, 2, 3)) -> bundle.BundleHeader:
    return bundle.BundleHeader(kind=bundle.KIND_LLAMA_SEQ_STATE, n_tokens=len(tokens), payload_bytes=size,
                               payload_crc32c=0, fingerprint={"model_sha256": "ab" * 32}, meta={"stop": ["</s>"]})


# -- the format -------------------------------------------------------------------------------------

def test_pieces_arrive_in_any_order_and_assemble_the_payload():
    payload = os.urandom(10_000)
    pieces = [[(6000, 4000)], [(0, 1000), (3000, 3000)], [(1000, 2000)]]  # out of order, one with two segments
    out = io.BytesIO()
    write_streamed(out, header(len(payload)), [1, 2, 3], payload, pieces, {"meta": {"canary": {"k": 1}}})
    got_header, tokens, got, trailer = read_streamed(io.BytesIO(out.getvalue()))
    assert bytes(got) == payload and tokens == [1, 2, 3] and got_header.fingerprint == header(1).fingerprint
    assert trailer == {"meta": {"canary": {"k": 1}}}


def test_a_reader_of_whole_bundles_refuses_a_streamed_one_by_its_version():
    out = io.BytesIO()
    write_streamed(out, header(4), [1, 2, 3], b"abcd", [[(0, 4)]])
    with pytest.raises(bundle.BundleFormatError, match="version 2 is not supported"):
        read_bundle(io.BytesIO(out.getvalue()))


def streamed_bytes(payload: bytes, pieces, trailer=None) -> bytes:
    out = io.BytesIO()
    write_streamed(out, header(len(payload)), [1, 2, 3], payload, pieces, trailer)
    return out.getvalue()


def test_a_piece_with_a_bad_checksum_is_refused_where_it_lands():
    payload = os.urandom(4096)
    raw = bytearray(streamed_bytes(payload, [[(0, 2048)], [(2048, 2048)]]))
    raw[-200] ^= 0x01  # inside the second piece's bytes
    with pytest.raises(bundle.BundleFormatError, match="piece checksum mismatch"):
        read_streamed(io.BytesIO(bytes(raw)))


def test_overlapping_or_outside_or_missing_bytes_are_refused():
    payload = os.urandom(100)
    with pytest.raises(bundle.BundleFormatError, match="overlaps"):
        read_streamed(io.BytesIO(streamed_bytes(payload, [[(0, 60)], [(50, 50)]])))
    coverage = bundle.Coverage(100)
    with pytest.raises(bundle.BundleFormatError, match="outside the payload"):
        coverage.add(90, 20)
    # the end marker comes before every byte has: incomplete
    view = memoryview(bytearray(payload))
    raw = (bundle.encode_preamble(header(100), [1, 2, 3], bundle.STREAMED_VERSION)
           + b"".join(bytes(p) if isinstance(p, memoryview) else p
                      for part in [bundle.encode_piece(view, [(0, 60)])] for p in (part[0], *part[1]))
           + bundle.encode_trailer({}) + bundle.encode_stream_end(1, 60))
    with pytest.raises(bundle.BundleFormatError, match="incomplete: 60 of 100"):
        read_streamed(io.BytesIO(raw))


def test_coverage_merges_neighbours_and_knows_when_it_is_complete():
    coverage = bundle.Coverage(30)
    for offset in (10, 0, 20):
        coverage.add(offset, 10)
    assert coverage.complete and coverage._starts == [0] and coverage._ends == [30]


def test_an_error_frame_mid_stream_is_the_senders_error():
    view = memoryview(bytearray(8))
    head, parts = bundle.encode_piece(view, [(0, 4)])
    raw = (bundle.encode_preamble(header(8), [1, 2, 3], bundle.STREAMED_VERSION) + head + bytes(parts[0])
           + bundle.encode_error(500, "prefill failed"))
    with pytest.raises(bundle.BundleRemoteError) as err:
        read_streamed(io.BytesIO(raw))
    assert err.value.code == 500


# -- the sender ---------------------------------------------------------------------------------------

def test_the_sender_sends_each_piece_once_it_is_ready_and_the_trailer_last():
    sb = stream.StreamingBundle()
    payload = bytearray(300)
    sb.open(bundle.KIND_LLAMA_SEQ_STATE, [1, 2, 3], payload, {"model_sha256": "x"}, {"stop": []})
    frames = sb.frames(on_sent=lambda: sent.append(True), heartbeat=0.05)
    sent: list = []
    assert next(frames).startswith(bundle.MAGIC)  # the preamble goes at once, before any byte is final
    assert next(frames).startswith(bundle.TAG_PROGRESS)  # nothing ready yet: a progress frame keeps the pull alive
    payload[:100] = b"a" * 100
    sb.ready([(0, 100)])
    piece = next(frames)
    assert piece.startswith(bundle.TAG_PIECE) and piece.endswith(b"a" * 100)
    payload[100:] = b"b" * 200
    sb.ready([(100, 200)])
    sb.ended()
    sb.finish({"meta": {"canary": {"top": [1]}}})
    rest = list(frames)
    assert sent == [True]  # after the end marker was taken
    _, _, got, trailer = read_streamed(io.BytesIO(b"".join([bundle.encode_preamble(
        sb.header, [1, 2, 3], bundle.STREAMED_VERSION), piece, *rest])))
    assert bytes(got) == bytes(payload) and trailer["meta"] == {"canary": {"top": [1]}}
    assert trailer["send_tail_s"] >= 0 and trailer["prefill_ended_at"] <= time.time()


def test_a_prefill_that_fails_half_way_ends_the_stream_with_an_error_frame():
    sb = stream.StreamingBundle()
    sb.open(bundle.KIND_LLAMA_SEQ_STATE, [1, 2, 3], bytearray(10), {}, {})
    settled: list = []
    sb.on_settled(settled.append)
    frames = sb.frames(on_sent=lambda: None, heartbeat=0.05)
    next(frames)
    sb.fail(500, "llama_decode failed")
    assert settled == [stream.FAILED]
    last = list(frames)[-1]
    assert last.startswith(bundle.TAG_ERROR) and b"llama_decode failed" in last
    sb.on_settled(settled.append)  # after the fact: called at once
    assert settled == [stream.FAILED, stream.FAILED]


def test_a_pull_that_breaks_off_abandons_the_bundle_even_after_the_prefill_ended():
    for finished in (False, True):
        sb = stream.StreamingBundle()
        abandoned: list = []
        sb.on_abandoned = lambda: abandoned.append(True)
        sb.open(bundle.KIND_LLAMA_SEQ_STATE, [1, 2, 3], bytearray(10), {}, {})
        sb.ready([(0, 10)])
        if finished:
            sb.finish({})
        frames = sb.frames(on_sent=lambda: pytest.fail("not sent whole"), heartbeat=0.05)
        next(frames)
        frames.close()  # what a WSGI server does when the socket broke
        assert abandoned == [True] and sb.state == stream.ABANDONED


def test_one_pull_per_streamed_bundle():
    sb = stream.StreamingBundle()
    assert sb.claim() and not sb.claim()


# -- the receiver -------------------------------------------------------------------------------------

class Closing:
    def __init__(self, sock):
        self.sock = sock

    def close(self):
        self.sock.close()


def incoming_over_a_socket(raw_pieces, size: int, pause: float = 0.0):
    """An Incoming reading what a thread writes into a socket pair, as a decode server reads a pull."""
    a, b = socket.socketpair()

    def send():
        try:
            for part in raw_pieces:
                a.sendall(part)
                time.sleep(pause)
        except OSError:  # the reader hung up (abandoned): what a prefill server sees then
            pass
        finally:
            a.close()

    threading.Thread(target=send, daemon=True).start()
    src = _Deadline(b.makefile("rb"), time.perf_counter() + 30)
    version, h, tokens = bundle.read_any_preamble(src)
    assert version == bundle.STREAMED_VERSION
    return Incoming(KVRef("http://127.0.0.1:1/kv/h", "h", streamed=True), Closing(b), src, h, tokens,
                    bytearray(h.payload_bytes), dict(h.meta), 30.0, 5.0, time.perf_counter())


def test_the_receiver_hands_over_pieces_as_they_land_and_the_trailer_meta_at_the_end():
    payload = os.urandom(3000)
    raw = streamed_bytes(payload, [[(0, 1000)], [(1000, 1000)], [(2000, 1000)]], {"meta": {"canary": {"k": 2}}})
    incoming = incoming_over_a_socket([raw], len(payload))
    seen = []
    incoming.on_change = lambda: seen.append(len(incoming.pieces))
    incoming.pump()
    assert bytes(incoming.payload) == payload and incoming.finished and incoming.complete
    assert seen[:3] == [1, 2, 3]  # told after each piece
    assert incoming.meta == {"stop": ["</s>"], "canary": {"k": 2}}
    incoming.verify()
    stats = incoming.stats()
    assert stats["handoff_mode"] == "streamed" and stats["kv_pieces"] == 3 and stats["kv_bytes"] == 3000


def test_a_stream_cut_half_way_is_a_clear_error_and_never_verifies():
    payload = os.urandom(3000)
    raw = streamed_bytes(payload, [[(0, 1000)], [(1000, 2000)]])
    incoming = incoming_over_a_socket([raw[:len(raw) - 1500]], len(payload))  # the sender died mid-piece
    with pytest.raises(BundleError, match="truncated"):
        incoming.pump()
    assert len(incoming.pieces) == 1 and not incoming.finished and incoming.closed
    with pytest.raises(BundleError):
        incoming.verify()


def test_an_error_frame_becomes_an_upstream_error_without_the_senders_words():
    view = memoryview(bytearray(8))
    head, parts = bundle.encode_piece(view, [(0, 8)])
    raw = (bundle.encode_preamble(header(16), [1, 2, 3], bundle.STREAMED_VERSION) + head + bytes(parts[0])
           + bundle.encode_error(500, "secret path /srv/model"))
    incoming = incoming_over_a_socket([raw], 16)
    with pytest.raises(UpstreamError) as err:
        incoming.pump()
    assert "secret" not in err.value.message and err.value.details["upstream_code"] == 500


def test_abandoning_stops_the_pump_at_the_next_frame():
    payload = os.urandom(4000)
    raw = streamed_bytes(payload, [[(i, 1000)] for i in range(0, 4000, 1000)])
    cut = len(bundle.encode_preamble(header(4000), [1, 2, 3], bundle.STREAMED_VERSION))
    step = (len(raw) - cut) // 8
    parts = [raw[cut + i:cut + i + step] for i in range(0, len(raw) - cut, step)]
    incoming = incoming_over_a_socket([raw[:cut], *parts], 4000, pause=0.05)
    incoming.on_change = incoming.abandon  # the decode side gives up after the first piece
    incoming.pump()
    assert len(incoming.pieces) == 1 and incoming.abandoned and incoming.closed and not incoming.finished


# -- where the rows of a llama.cpp state lie ------------------------------------------------------------

def fake_state(n: int, rows=((1, 8), (1, 8)), seq: int = 3, v_trans: bool = False) -> bytes:
    """A single-stream, one-cache state of ``n`` cells and two layers, rows filled with recognisable bytes
    (``v_trans``: V written transposed, as llama.cpp does without flash attention)."""
    out = bytearray(b"GGSQ" + struct.pack("<i", seq) + struct.pack("<II", 1, n))
    for i in range(n):
        out += struct.pack("<iIi", i, 1, seq)
    out += struct.pack("<II", int(v_trans), len(rows))
    for kind in (0, 1):
        for layer, (t, row) in enumerate(rows):
            if kind and v_trans:  # type, element size, n_embd, then n_embd x n elements
                out += struct.pack("<iII", t, 2, row // 2)
            else:
                out += struct.pack("<iQ", t, row)
            out += bytes([16 * kind + layer]) * (row * n)
    return bytes(out)


def test_the_layout_of_a_state_places_every_row_before_it_exists():
    state = fake_state(5)
    layout = llama_state.SeqLayout.of_state(state)
    assert layout.size(5) == len(state) and layout.size(7) == len(fake_state(7))
    rebuilt = bytearray(len(state))
    assert layout.skeleton(5, 3, rebuilt) == layout.skeleton_segments(5)
    for per_layer in layout.rows(5, 0, 5):
        for offset, length in per_layer:
            rebuilt[offset:offset + length] = state[offset:offset + length]
    assert bytes(rebuilt) == state  # skeleton + every row = the export
    (k, kn), (v, vn) = layout.rows(5, 2, 4)[1]
    assert state[k:k + kn] == bytes([1]) * 16 and state[v:v + vn] == bytes([17]) * 16
    assert layout.locate(5, v, vn) == ("v", 1, 2, 2)
    with pytest.raises(llama_state.StateLayoutError, match="not whole rows"):
        layout.locate(5, v + 3, vn)


def test_states_without_that_layout_are_refused_naming_why():
    two_caches = fake_state(2) + fake_state(2)[8:]  # a sliding-window model's: a second cache follows
    with pytest.raises(llama_state.StateLayoutError, match="sliding-window"):
        llama_state.SeqLayout.of_state(two_caches)
    with pytest.raises(llama_state.StateLayoutError, match="transposed"):
        llama_state.SeqLayout.of_state(fake_state(2, v_trans=True))


# -- the llama.cpp backend, in this process, on the generated tiny models ---------------------------------

PROMPT = "Revenue by region rose four percent in the north; returns fell in the south. " * 14


@pytest.fixture(scope="module")
def tiny_pair():
    """Two llama.cpp backends of the tiny qwen3moe (a prefill side and a decode side), small chunks."""
    from disaggregated_inference.backends import ModelSettings, create

    from .tiny_models import tiny_gguf

    settings = ModelSettings(model=str(tiny_gguf("qwen3moe")), n_threads=1, parallel=2, n_ctx=1024, n_batch=64)
    pair = create(settings), create(settings)
    for backend in pair:
        backend.load()
    yield pair
    for backend in pair:
        backend.close()


def streamed_prefill(backend, prompt):
    from disaggregated_inference.backends.base import Prompt

    sink = stream.StreamingBundle()
    _, result = backend.run(backend.prefill(Prompt(text=prompt, raw=True), kv_stream=sink))
    sink.finish({"meta": {"canary": result.meta["canary"]}})
    return sink, result


def test_a_streamed_prefill_hands_over_the_exported_state_byte_for_byte(tiny_pair):
    from disaggregated_inference.backends.base import Prompt

    prefill, _ = tiny_pair
    _, whole = prefill.run(prefill.prefill(Prompt(text=PROMPT, raw=True)))
    sink, streamed = streamed_prefill(prefill, PROMPT)  # the same start: 128 tokens come from the prefix cache
    assert streamed.metrics["handoff_mode"] == "streamed" and streamed.metrics["prompt_tokens_cached"] == 128
    assert bytes(streamed.payload) == bytes(whole.payload)
    n = len(streamed.tokens) - 1
    layers = prefill._cells.layout.n_layer
    chunks = -(-(n - 128) // 64)
    assert len(sink.pieces) == 1 + layers * (1 + chunks)  # the skeleton, the cached rows, then each chunk's
    _, _, got, _ = read_streamed(io.BytesIO(b"".join(sink.frames(lambda: None))))
    assert bytes(got) == bytes(whole.payload)


def test_a_streamed_state_imported_as_it_arrives_continues_exactly_as_the_whole_one(tiny_pair):
    from disaggregated_inference.backends.base import Prompt, Received, Sampling

    prefill, decode = tiny_pair
    prompt = "A different start, so that nothing is cached. " + PROMPT
    _, whole = prefill.run(prefill.prefill(Prompt(text=prompt, raw=True)))
    sampling = Sampling(max_new_tokens=12)
    events, _ = decode.run(decode.decode(Received(whole.kind, whole.tokens, bytes(whole.payload), whole.fingerprint,
                                                  whole.meta), sampling, lambda: False))
    expected = "".join(e.piece for e in events if not e.done)

    sink = stream.StreamingBundle()
    a, b = socket.socketpair()

    def produce_and_send():  # the prefill server: the backend produces, a request thread sends as pieces come
        worker = threading.Thread(target=lambda: (lambda r: sink.finish({"meta": {"canary": r[1].meta["canary"]}}))(
            prefill.run(prefill.prefill(Prompt(text=prompt, raw=True), kv_stream=sink))))
        worker.start()
        sink.wait_open(30)
        for frame in sink.frames(lambda: None, heartbeat=0.05):
            a.sendall(frame)
            time.sleep(0.002)  # a link slower than memory: pieces keep arriving while the decode side imports
        a.close()
        worker.join()

    threading.Thread(target=produce_and_send, daemon=True).start()
    src = _Deadline(b.makefile("rb"), time.perf_counter() + 60)
    _, h, tokens = bundle.read_any_preamble(src)
    incoming = Incoming(KVRef("http://x/kv/h", "h", streamed=True), Closing(b), src, h, tokens,
                        bytearray(h.payload_bytes), dict(h.meta), 60.0, 5.0, time.perf_counter())
    pump = threading.Thread(target=incoming.pump)
    pump.start()
    events, _ = decode.run(decode.decode(Received(h.kind, tokens, incoming.payload, h.fingerprint, incoming.meta,
                                                  verify=incoming.verify, incoming=incoming), sampling, lambda: False))
    pump.join()
    m = events[-1].metrics
    assert m["kv_import"] == "progressive" and m["canary"] == "passed" and m["canary_divergence"] == 0.0
    assert "".join(e.piece for e in events if not e.done) == expected


def test_a_sliding_window_model_says_it_hands_over_the_whole_state():
    from disaggregated_inference.backends import ModelSettings, create

    from .tiny_models import tiny_gguf

    backend = create(ModelSettings(model=str(tiny_gguf("gpt-oss")), n_threads=1, parallel=1, n_ctx=512))
    backend.load()
    try:
        assert backend.kv_streaming == {"enabled": None, "reason": "checked at the first streamed handoff"}
        state = backend.probe_kv_streaming()
        assert state["enabled"] is False and "sliding-window" in state["reason"]
    finally:
        backend.close()
