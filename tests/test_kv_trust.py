"""Issue 12 §1: a decode server pulls KV only from hosts it trusts, never passes its token or an
upstream's words on, checks what the prefill answer declared before the payload, and gives up on a
silent prefill server after the progress timeout rather than the whole fetch timeout."""
from __future__ import annotations

import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from disaggregated_inference.errors import BundleError, Forbidden, UpstreamError, UpstreamTimeout
from disaggregated_inference.kv import bundle, trust
from disaggregated_inference.kv import receive as handoff
from disaggregated_inference.kv.receive import KVRef
from disaggregated_inference.testing.bundles import to_bytes



def make_bundle(payload: bytes, tokens=(5, 6, 7)):
    header = bundle.BundleHeader(kind=bundle.KIND_LLAMA_SEQ_STATE, n_tokens=len(tokens), payload_bytes=len(payload),
                                 payload_crc32c=bundle.payload_checksum(payload), fingerprint={"model_sha256": "cd"})
    return header, to_bytes(header, list(tokens), payload)


@pytest.mark.parametrize("url,sources,ok", [
    ("http://10.0.0.5:8100/kv/h", ["10.0.0.5:8100"], True),
    ("http://10.0.0.5:8101/kv/h", ["10.0.0.5:8100"], False),
    ("http://10.0.0.5:9/kv/h", ["10.0.0.5"], True),                         # a bare host: any port
    ("http://169.254.169.254/latest/meta-data", ["10.0.0.5:8100"], False),  # the classic SSRF target
    ("http://192.168.100.1:8100/kv/h", ["http://192.168.100.1:8100"], True),  # a data_url
    ("https://192.168.100.1:8100/kv/h", ["http://192.168.100.1:8100"], False),  # the scheme is fixed by a URL
    ("http://10.0.0.5:8100/kv/h", ["http://10.0.0.5:8100/data"], False),   # and the path prefix
    ("http://10.0.0.5:8100/data/kv/h", ["http://10.0.0.5:8100/data"], True),
    ("http://localhost:8100/kv/h", ["127.0.0.1:8100"], False),             # names compared as written
    ("http://10.0.0.5:8100/kv/h", [], False),
])
def test_check_source(url, sources, ok):
    if ok:
        trust.check_source(url, sources)
    else:
        with pytest.raises(Forbidden) as err:
            trust.check_source(url, sources)
        assert err.value.status == 403 and err.value.field == "kv.url"


class Recorder(BaseHTTPRequestHandler):
    """Answers what ``self.server.answer`` says, records the headers it got."""

    def do_GET(self):
        self.server.seen.append(dict(self.headers))
        status, body, stall = self.server.answer
        self.send_response(status)
        self.send_header("Content-Length", str(len(body) + (1000 if stall else 0)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()
        if stall:  # the rest never comes
            time.sleep(stall)

    def log_message(self, *args):
        pass


@pytest.fixture
def recorder():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    server.daemon_threads = True
    server.seen, server.answer = [], (200, b"", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def test_an_untrusted_url_is_never_contacted_and_gets_no_token(recorder):
    port = recorder.server_address[1]
    with pytest.raises(Forbidden):
        handoff.fetch(KVRef(url=f"http://127.0.0.1:{port}/kv/h", handle="h"), timeout=5, api_token="s3cret",
                      sources=[f"127.0.0.1:{port + 1}"])
    assert recorder.seen == []


def test_upstream_bodies_are_not_repeated(recorder):
    recorder.answer = (500, b'{"error": "internal detail: /etc/shadow is 0600"}', 0)
    port = recorder.server_address[1]
    with pytest.raises(UpstreamError) as err:
        handoff.fetch(KVRef(url=f"http://127.0.0.1:{port}/kv/h", handle="h"), timeout=5,
                      sources=[f"127.0.0.1:{port}"])
    assert "shadow" not in err.value.message and "internal detail" not in str(err.value.to_dict())
    assert err.value.details["upstream_status"] == 500


def test_a_sender_error_frame_is_not_repeated(recorder):
    header, raw = make_bundle(os.urandom(100))
    recorder.answer = (200, bundle.encode_preamble(header, [5, 6, 7]) + bundle.encode_error(7, "secret path /srv/x"), 0)
    port = recorder.server_address[1]
    with pytest.raises(UpstreamError) as err:
        handoff.fetch(KVRef(url=f"http://127.0.0.1:{port}/kv/h", handle="h"), timeout=5,
                      sources=[f"127.0.0.1:{port}"])
    assert "secret" not in str(err.value.to_dict()) and err.value.details["upstream_code"] == 7


def test_declared_size_is_checked_before_the_payload_is_read():
    header, raw = make_bundle(os.urandom(100_000))
    preamble_len = len(bundle.encode_preamble(header, [5, 6, 7]))

    class Counting:
        def __init__(self):
            import io
            self.f, self.read_bytes = io.BytesIO(raw), 0

        def readinto(self, view):
            n = self.f.readinto(view)
            self.read_bytes += n
            return n

        def read(self, n=-1):
            data = self.f.read(n)
            self.read_bytes += len(data)
            return data

    src = Counting()
    ref = KVRef(url="http://x/kv/h", handle="h", bytes=header.payload_bytes + 1)
    with pytest.raises(BundleError) as err:
        bundle.receive_bundle(src, check_header=lambda h: handoff._check_declared(ref, h))
    assert err.value.field == "kv.bytes"
    assert src.read_bytes <= preamble_len  # not one payload byte


def test_a_silent_prefill_server_costs_the_progress_timeout_not_the_fetch_timeout(recorder):
    header, raw = make_bundle(os.urandom(10_000))
    recorder.answer = (200, raw[:200], 30)  # the preamble, then silence
    port = recorder.server_address[1]
    started = time.monotonic()
    with pytest.raises(UpstreamTimeout, match="no KV bytes arrived for 0.5s"):
        handoff.fetch(KVRef(url=f"http://127.0.0.1:{port}/kv/h", handle="h"), timeout=20, progress_timeout=0.5,
                      sources=[f"127.0.0.1:{port}"])
    assert time.monotonic() - started < 5


def test_a_trickling_prefill_server_is_cut_off_at_the_fetch_timeout():
    header, raw = make_bundle(os.urandom(10_000))
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def trickle():
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(raw))
        try:
            for i in range(len(raw)):  # one byte every 0.1 s: never silent for the progress timeout
                conn.sendall(raw[i:i + 1])
                time.sleep(0.1)
        except OSError:
            pass
        conn.close()

    threading.Thread(target=trickle, daemon=True).start()
    started = time.monotonic()
    with pytest.raises(UpstreamTimeout, match="took over 1s"):
        handoff.fetch(KVRef(url=f"http://127.0.0.1:{port}/kv/h", handle="h"), timeout=1, progress_timeout=0.5,
                      sources=[f"127.0.0.1:{port}"])
    assert time.monotonic() - started < 5
    listener.close()
