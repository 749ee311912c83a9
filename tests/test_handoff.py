"""The decode side's pull of a bundle (``handoff.fetch``) against a plain local HTTP server."""
import os
import socket
import sys

import pytest

from disaggregated_inference.kv import bundle
from disaggregated_inference.kv import receive as handoff
from disaggregated_inference.kv.receive import KVRef
from disaggregated_inference.errors import BundleError, NotFound
from disaggregated_inference.testing.bundles import to_bytes

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sizes the buffer on Linux only")


def make_bundle(payload: bytes, tokens=(5, 6, 7)):
    header = bundle.BundleHeader(kind=bundle.KIND_LLAMA_SEQ_STATE, n_tokens=len(tokens), payload_bytes=len(payload),
                                 payload_crc32c=bundle.payload_checksum(payload), fingerprint={"model_sha256": "cd"})
    return header, to_bytes(header, list(tokens), payload)


def receive_buffer(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)


@linux_only
def test_a_receive_buffer_within_the_system_limit_is_set(monkeypatch):
    monkeypatch.setattr(handoff, "receive_buffer_limit", lambda: 1 << 30)
    with socket.socket() as sock:
        before = receive_buffer(sock)
        assert handoff.size_receive_buffer(sock, 96 << 10)  # under any kernel's default limit
        assert receive_buffer(sock) != before
        assert receive_buffer(sock) >= 96 << 10  # Linux reports twice what was asked (its bookkeeping)


@linux_only
def test_a_receive_buffer_above_the_system_limit_is_not_asked_for(monkeypatch):
    monkeypatch.setattr(handoff, "receive_buffer_limit", lambda: 32 << 10)
    with socket.socket() as sock:
        before = receive_buffer(sock)
        assert not handoff.size_receive_buffer(sock, 64 << 10)  # the kernel would cut it and stop autotuning
        assert not handoff.size_receive_buffer(sock, 0)
        assert receive_buffer(sock) == before


def test_the_buffer_in_effect_is_the_asked_size_only_within_the_limit(monkeypatch):
    monkeypatch.setattr(handoff, "receive_buffer_limit", lambda: 4 << 20)
    assert handoff.socket_buffer_in_effect(4 << 20) == 4 << 20
    assert handoff.socket_buffer_in_effect((4 << 20) + 1) is None
    assert handoff.socket_buffer_in_effect(0) is None


def test_no_limit_known_means_the_kernel_keeps_sizing_the_buffer(monkeypatch):
    monkeypatch.setattr(handoff, "receive_buffer_limit", lambda: None)
    with socket.socket() as sock:
        before = receive_buffer(sock)
        assert not handoff.size_receive_buffer(sock, 64 << 10)
        assert receive_buffer(sock) == before


def test_the_limit_is_read_from_the_kernel_on_linux_and_not_guessed_elsewhere(monkeypatch):
    handoff.receive_buffer_limit.cache_clear()
    try:
        if sys.platform.startswith("linux"):
            with open("/proc/sys/net/core/rmem_max") as f:
                assert handoff.receive_buffer_limit() == int(f.read())
        monkeypatch.setattr(sys, "platform", "darwin")
        handoff.receive_buffer_limit.cache_clear()
        assert handoff.receive_buffer_limit() is None
    finally:
        monkeypatch.undo()
        handoff.receive_buffer_limit.cache_clear()


def test_fetch_sizes_its_socket_and_returns_the_verified_bundle(bytes_server, monkeypatch):
    payload = os.urandom(300_000)
    header, raw = make_bundle(payload)
    url = bytes_server("/kv/abc", raw)
    asked = []
    real = handoff.size_receive_buffer
    monkeypatch.setattr(handoff, "size_receive_buffer", lambda sock, size: asked.append(size) or real(sock, size))
    ref = KVRef(url=url, handle="abc", bytes=len(payload), crc32c=header.payload_crc32c)
    received, stats = handoff.fetch(ref, timeout=10, socket_buffer=1 << 20)
    assert asked == [1 << 20]
    assert bytes(received.payload) == payload and received.tokens == [5, 6, 7]
    assert stats["kv_bytes"] == len(payload)


def test_fetch_names_what_differs_from_the_prefill_answer(bytes_server):
    header, raw = make_bundle(os.urandom(1000))
    url = bytes_server("/kv/abc", raw)
    with pytest.raises(BundleError, match="checksum differs") as err:
        handoff.fetch(KVRef(url=url, handle="abc", crc32c=header.payload_crc32c ^ 1), timeout=10)
    assert err.value.field == "kv.crc32c"
    gone = bytes_server("/kv/gone", b'{"error": "unknown KV handle"}', status=404)
    with pytest.raises(NotFound, match="has no KV bundle 'gone'") as err:
        handoff.fetch(KVRef(url=gone, handle="gone"), timeout=10)
    assert err.value.field == "kv.handle"


def test_a_large_bundle_from_this_machine_is_checked_after_it_arrived_and_verify_catches_damage(
        bytes_server, monkeypatch):
    payload = os.urandom(bundle._RunningChecksum.THREADED_FROM + 1000)
    header, raw = make_bundle(payload)
    damaged = bytearray(raw)
    damaged[len(raw) // 2] ^= 0x01
    url = bytes_server("/kv/damaged", bytes(damaged))
    alongside = []
    real = bundle.receive_bundle
    monkeypatch.setattr(bundle, "receive_bundle",
                        lambda *a, **k: alongside.append(k["checksum_alongside"]) or real(*a, **k))
    received, _ = handoff.fetch(KVRef(url=url, handle="damaged", bytes=len(payload)), timeout=10)
    assert alongside == [False]  # loopback: the checksum waits for the last byte
    with pytest.raises(BundleError, match="checksum mismatch") as err:
        received.verify()
    assert err.value.field == "kv"


class Connected:
    def __init__(self, peer, own):
        self.peer, self.own = peer, own

    def getpeername(self):
        return (self.peer, 8101)

    def getsockname(self):
        return (self.own, 50000)


def test_a_loopback_connection_is_the_same_host():
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    try:
        assert handoff.same_host(client)
    finally:
        client.close()
        server.close()


def test_own_address_and_loopback_are_the_same_host_and_another_machine_is_not():
    assert handoff.same_host(Connected("192.168.1.20", "192.168.1.20"))  # this machine through its LAN address
    assert handoff.same_host(Connected("::1", "::1"))
    assert handoff.same_host(Connected("127.0.0.2", "127.0.0.1"))
    assert not handoff.same_host(Connected("192.168.1.30", "192.168.1.20"))
    assert not handoff.same_host(Connected("fe80::1%eth0", "fe80::2%eth0"))
    with socket.socket() as unconnected:
        assert not handoff.same_host(unconnected)
