"""Sending a leased bundle: framed in place in the payload's file and sent with sendfile, or as frames."""
import io
import os
import socket
import threading

import pytest

from disaggregated_inference.kv import buffers
from disaggregated_inference.kv import bundle
from disaggregated_inference.kv import send as sender
from disaggregated_inference.kv.buffers import HUGE_THRESHOLD
from disaggregated_inference.testing.bundles import read_bundle

linux_only = pytest.mark.skipif(not hasattr(os, "memfd_create") or not os.path.isdir("/proc/self/fd"),
                                reason="in-memory files (memfd) are Linux's")


def exported(n: int = HUGE_THRESHOLD + 12345):
    """A payload as the llama.cpp backend leaves it: written into a sendable buffer, maybe not all of it."""
    buf = buffers.sendable(n + 4096)  # a prepared buffer a little larger than the state
    payload = memoryview(buf)[:n]
    payload[:] = (bytes(range(256)) * (n // 256 + 1))[:n]
    tokens = list(range(1, 2001))
    header = bundle.BundleHeader(bundle.KIND_LLAMA_SEQ_STATE, len(tokens), n, bundle.payload_checksum(payload),
                                 {"model_sha256": "ab" * 32}, {"stop": ["</s>"]})
    return header, tokens, payload


def receive_all(sock: socket.socket) -> bytes:
    out = bytearray()
    while chunk := sock.recv(1 << 20):
        out += chunk
    return bytes(out)


@linux_only
def test_a_payload_in_a_sendable_buffer_is_framed_in_place_into_a_whole_bundle():
    header, tokens, payload = exported()
    framed = sender.frame_in_place(header, tokens, payload)
    assert framed is not None and framed.length == sender.content_length(header, framed)
    with sender.RangeFile(framed, lambda: None) as source:
        raw = source.read()
    assert len(raw) == framed.length  # reads stop at the bundle's end, not the file's
    got_header, got_tokens, got_payload = read_bundle(io.BytesIO(raw))
    assert got_header == header and got_tokens == tokens and bytes(got_payload) == bytes(payload)


@linux_only
def test_sendfile_sends_the_bundle_and_only_a_whole_send_counts_as_sent():
    header, tokens, payload = exported()
    framed = sender.frame_in_place(header, tokens, payload)
    for count, whole in ((framed.length, True), (framed.length // 2, False)):
        a, b = socket.socketpair()
        received, calls = [], []
        reader = threading.Thread(target=lambda: received.append(receive_all(b)))
        reader.start()
        with sender.RangeFile(framed, lambda: calls.append("sent")) as source:  # what gunicorn does with it
            a.sendfile(source, framed.start, count)
        a.close()
        reader.join()
        b.close()
        assert len(received[0]) == count
        assert calls == (["sent"] if whole else [])
        if whole:
            assert bytes(read_bundle(io.BytesIO(received[0]))[2]) == bytes(payload)


@linux_only
def test_two_fetches_of_one_bundle_do_not_move_each_other():
    header, tokens, payload = exported()
    framed = sender.frame_in_place(header, tokens, payload)
    with sender.RangeFile(framed, lambda: None) as first, sender.RangeFile(framed, lambda: None) as second:
        head = first.read(1000)
        whole = second.read()
        rest = first.read()
    assert head + rest == whole and len(whole) == framed.length


@linux_only
def test_a_fetch_broken_off_halfway_does_not_count_as_sent():
    header, tokens, payload = exported()
    framed = sender.frame_in_place(header, tokens, payload)
    calls = []
    source = sender.RangeFile(framed, lambda: calls.append("sent"))
    source.read(framed.length // 2)
    source.close()
    assert calls == []
    source = sender.RangeFile(framed, lambda: calls.append("sent"))
    while source.read(1 << 20):
        pass
    source.close()
    source.close()  # closing twice reports once
    assert calls == ["sent"]


def test_payloads_outside_a_file_travel_as_frames_and_report_when_all_went_out():
    payload = bytearray(os.urandom(HUGE_THRESHOLD + 5))  # not in a sendable file
    header = bundle.BundleHeader(bundle.KIND_LLAMA_SEQ_STATE, 2, len(payload), bundle.payload_checksum(payload))
    assert sender.frame_in_place(header, [1, 2], payload) is None
    calls = []
    pieces = sender.body(header, [1, 2], payload, None, {}, lambda: calls.append("sent"))
    first = next(iter(pieces))
    assert calls == [] and isinstance(first, bytes)
    raw = first + b"".join(pieces)
    assert calls == ["sent"] and len(raw) == sender.content_length(header, None)
    assert bytes(read_bundle(io.BytesIO(raw))[2]) == bytes(payload)


@linux_only
def test_a_bundle_whose_preamble_does_not_fit_before_the_payload_falls_back_to_frames():
    buf = buffers.sendable(HUGE_THRESHOLD)
    span = buffers.span_of(buf)
    tokens = [7] * (span.offset // 4 + 1)  # more token ids than the room before the payload holds
    header = bundle.BundleHeader(bundle.KIND_LLAMA_SEQ_STATE, len(tokens), len(buf), bundle.payload_checksum(buf))
    assert sender.frame_in_place(header, tokens, buf) is None

