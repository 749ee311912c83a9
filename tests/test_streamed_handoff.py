"""The overlapped handoff through real gunicorn servers: streamed KV, and what happens when it breaks.

One module-scoped cluster of generated tiny models (one compute thread each): "qwen" a qwen3moe
(full attention: its KV streams, 4 KB per token) and "gpt-oss" a gpt-oss (sliding-window layers:
handed over whole, saying why). A stand-in KV source on loopback, trusted by the decode servers,
serves a damaged bundle, or relays a real prefill server's stream and kills that server half-way.
"""
from __future__ import annotations

import io
import json
import socket
import struct
import threading
import time
import warnings
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest
import requests

from disaggregated_inference.client import DisaggregatedClient, FallbackWarning
from disaggregated_inference.kv import bundle

from .conftest import cluster_config_dict
from .tiny_models import GPT_OSS, QWEN3MOE, tiny_gguf

pytestmark = pytest.mark.slow

WIDE = replace(QWEN3MOE, n_head_kv=4, head_dim=64)  # 4 KB of KV per token: a 1.5k-token stream outgrows socket buffers
PROMPT = "Revenue by region rose four percent in the north; returns fell in the south. " * 12 + "Summarise."
LONG = "Each of the forty stores reported weekly sales, returns and staffing. " * 140  # ~2k tokens


class StandIn:
    """A KV source on loopback: ``serve(path, data)`` answers GET path with data; ``relay(path, upstream,
    cut, on_cut)`` relays upstream's answer and, after ``cut`` bytes, calls ``on_cut`` and hangs up."""

    def __init__(self):
        self.routes: dict = {}
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                route = stand_in.routes.get(self.path)
                if route is None:
                    self.send_response(404)
                    self.end_headers()
                elif isinstance(route, bytes):
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(route)))
                    self.end_headers()
                    self.wfile.write(route)
                else:
                    route(self)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def serve(self, path: str, data: bytes) -> str:
        self.routes[path] = data
        return f"http://{self.address}{path}"

    def relay(self, path: str, upstream: str, cut: int, on_cut) -> str:
        def handle(handler):  # HTTP/1.0: the body ends when the connection does
            with requests.get(upstream, stream=True, timeout=60) as resp:
                handler.send_response(resp.status_code)
                handler.end_headers()
                sent = 0
                for piece in resp.iter_content(1 << 14):
                    handler.wfile.write(piece[:cut - sent])
                    sent += len(piece)
                    if sent >= cut:
                        break
                handler.wfile.flush()
                on_cut()
        self.routes[path] = handle
        return f"http://{self.address}{path}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def stand_in():
    server = StandIn()
    yield server
    server.close()


@pytest.fixture(scope="module")
def streaming_cluster(tmp_path_factory, stand_in):
    from disaggregated_inference.ops.cluster import LocalCluster

    config = cluster_config_dict(kv_sources=[stand_in.address])
    config["models"]["qwen"].update(model=str(tiny_gguf(WIDE)), n_threads=1, n_batch=64, parallel=2)
    config["models"]["gpt-oss"].update(model=str(tiny_gguf(GPT_OSS)), n_threads=1, parallel=2, flash_attn=True)
    with LocalCluster(config, free_ports=True, log_dir=tmp_path_factory.mktemp("stream-logs")) as running:
        running.wait_healthy(timeout=300)
        yield running


@pytest.fixture(scope="module")
def at(streaming_cluster):
    return {p.entry.name: p.url for p in streaming_cluster.processes}


def prefill(http, url: str, prompt: str, mode: str = "streamed") -> dict:
    resp = http.post(f"{url}/prefill", json={"prompt": prompt, "handoff_mode": mode})
    assert resp.status_code == 200, resp.text
    return resp.json()


def decode(http, url: str, kv: dict, tokens: int = 12):
    return http.post(f"{url}/decode", json={"kv": kv, "max_new_tokens": tokens, "temperature": 0})


def slots_settle(http, url: str, timeout: float = 20.0) -> dict:
    """The server's /health once it holds no request (its cleanups ran)."""
    deadline = time.monotonic() + timeout
    while True:
        health = http.get(f"{url}/health").json()
        if health["slots"]["busy"] == 0 or time.monotonic() > deadline:
            return health
        time.sleep(0.1)


def test_a_streamed_handoff_continues_exactly_as_the_whole_state_one(http, at):
    prompt = "First copy. " + PROMPT
    whole = prefill(http, at["local-prefill-qwen"], prompt, "whole")
    assert whole["handoff_mode"] == "whole" and whole["kv"]["mode"] == "whole"
    by_whole = decode(http, at["local-decode-qwen"], whole["kv"])
    assert by_whole.status_code == 200, by_whole.text

    streamed = prefill(http, at["local-prefill-qwen"], prompt)  # its start now comes from the prefix cache
    assert streamed["handoff_mode"] == "streamed" and streamed["kv"]["mode"] == "streamed"
    assert streamed["kv"]["crc32c"] is None and streamed["kv"]["bytes"] == whole["kv"]["bytes"]  # known up front
    assert "prefill_time" not in streamed["metrics"]  # answered before the prompt was evaluated
    by_stream = decode(http, at["local-decode-qwen"], streamed["kv"])
    assert by_stream.status_code == 200, by_stream.text
    m = by_stream.json()["metrics"]
    assert m["handoff_mode"] == "streamed" and m["kv_import"] == "progressive" and m["method"] == "kv_handoff"
    assert m["prompt_tokens_recomputed"] == 1 and m["kv_bytes"] == streamed["kv"]["bytes"]
    assert m["canary"] == "passed" and m["canary_divergence"] == 0.0  # bit-exact, as the whole state is
    assert m["kv_pieces"] > 1 and m["prefill_metrics"]["prefill_time"] > 0  # the prefill's figures, from the trailer
    assert m["prefill_metrics"]["prompt_tokens_cached"] > 0  # the cached cells went at once
    assert by_stream.json()["generated_text"] == by_whole.json()["generated_text"]
    alone = http.post(f"{at['local-decode-qwen']}/generate",
                      json={"prompt": prompt, "max_new_tokens": 12, "temperature": 0}).json()
    assert alone["generated_text"] == by_stream.json()["generated_text"]
    assert http.get(f"{at['local-prefill-qwen']}/health").json()["leases"]["held"] == 0


def test_the_client_streams_by_default_and_a_sliding_window_model_goes_whole_saying_why(streaming_cluster):
    with DisaggregatedClient(streaming_cluster.config, health_check=False) as client:
        client.check_health()
        text, m = client.generate(model="qwen", prompt="Client copy. " + PROMPT, max_tokens=8)
        assert m["method"] == "kv_handoff" and m["handoff_mode"] == "streamed" and m["kv_import"] == "progressive"
        assert m["prefill_time"] > 0 and m["prompt_tokens_recomputed"] == 1  # the trailer's figures reached it
        text, m = client.generate(model="gpt-oss", prompt="Client copy. " + PROMPT, max_tokens=8)
        assert m["method"] == "kv_handoff" and m["handoff_mode"] == "whole"
        assert "sliding-window" in m["handoff_mode_reason"] and m["canary"] == "passed"
        client.handoff_mode = "whole"  # client.handoff_mode: the old path, on request
        _, m = client.generate(model="qwen", prompt="Whole copy. " + PROMPT, max_tokens=8)
        assert m["handoff_mode"] == "whole" and "handoff_mode_reason" not in m


def stream_bytes(http, url: str, kv: dict) -> bytes:
    with http.get(kv["url"], stream=True) as resp:
        assert resp.status_code == 200 and resp.headers["X-KV-Mode"] == "streamed"
        return resp.content


def piece_spans(raw: bytes) -> list[tuple[int, int]]:
    """Where each piece's bytes lie in a streamed bundle's bytes."""
    src = io.BytesIO(raw)
    bundle.read_any_preamble(src)
    spans = []
    while True:
        tag = src.read(1)
        if tag == bundle.TAG_PIECE:
            (n,) = struct.unpack("<I", src.read(4))
            table = src.read(12 * n + 4)
            length = sum(struct.unpack_from("<QI", table, 12 * i)[1] for i in range(n))
            spans.append((src.tell(), length))
            src.seek(length, io.SEEK_CUR)
        elif tag == bundle.TAG_PROGRESS:
            src.read(4)
        else:
            return spans


def test_a_piece_with_a_bad_checksum_is_refused_and_nothing_is_imported(http, at, stand_in):
    prompt = "Damaged copy. " + PROMPT
    pre = prefill(http, at["local-prefill-qwen"], prompt)
    raw = bytearray(stream_bytes(http, at["local-prefill-qwen"], pre["kv"]))
    start, length = piece_spans(bytes(raw))[-1]
    raw[start + length // 2] ^= 0x40
    url = stand_in.serve("/kv/damaged", bytes(raw))
    out = decode(http, at["local-decode-qwen"], {**pre["kv"], "url": url, "handle": "damaged"})
    assert out.status_code == 422, out.text
    assert out.json()["code"] == "bad_bundle" and "piece checksum mismatch" in out.json()["error"]
    health = slots_settle(http, at["local-decode-qwen"])
    assert health["slots"]["busy"] == 0 and health["status"] == "healthy"
    # nothing of it stayed in a slot: computing the prompt there finds no cached start
    alone = http.post(f"{at['local-decode-qwen']}/generate", json={"prompt": prompt, "max_new_tokens": 2}).json()
    assert alone["metrics"]["prompt_tokens_cached"] == 0


def with_trailer(raw: bytes, change) -> bytes:
    """A streamed bundle's bytes with its trailer (JSON) passed through ``change``."""
    at = raw.rindex(bundle.TAG_TRAILER, 0, len(raw) - 13)
    (length,) = struct.unpack_from("<I", raw, at + 1)
    if at + 5 + length + 13 != len(raw):
        raise AssertionError("the trailer is not the frame before the end marker")
    trailer = change(json.loads(raw[at + 5:at + 5 + length]))
    return raw[:at] + bundle.encode_trailer(trailer) + raw[at + 5 + length:]


def test_a_streamed_state_whose_canary_disagrees_is_refused_before_anything_is_generated(http, at, stand_in):
    prompt = "Canary copy. " + PROMPT
    pre = prefill(http, at["local-prefill-qwen"], prompt)

    def lie(trailer):  # the state is intact; the prefill's next-token distribution is not what it says
        trailer["meta"]["canary"]["logprobs"] = [x - 3.0 for x in trailer["meta"]["canary"]["logprobs"]]
        return trailer

    url = stand_in.serve("/kv/lying", with_trailer(stream_bytes(http, at["local-prefill-qwen"], pre["kv"]), lie))
    out = decode(http, at["local-decode-qwen"], {**pre["kv"], "url": url, "handle": "lying"})
    assert out.status_code == 422, out.text
    assert out.json()["code"] == "canary_mismatch"
    assert slots_settle(http, at["local-decode-qwen"])["slots"]["busy"] == 0


def test_a_prefill_server_killed_mid_stream_leaves_a_clear_error_and_the_client_falls_back(
        http, at, stand_in, streaming_cluster):
    server = streaming_cluster.process("local-prefill-qwen")
    prompt = "Killed copy. " + PROMPT
    pre = prefill(http, at["local-prefill-qwen"], prompt)
    cut = pre["kv"]["bytes"] // 2  # the decode server gets the first half of the stream, then the server dies
    url = stand_in.relay("/kv/killed", pre["kv"]["url"], cut, server.kill)
    try:
        out = decode(http, at["local-decode-qwen"], {**pre["kv"], "url": url, "handle": "killed"})
        assert out.status_code in (422, 502), out.text
        body = out.json()
        assert body["code"] in ("bad_bundle", "upstream_error") and body["field"] == "kv"
        assert server.proc.poll() is not None  # it was killed mid-stream, not after
        health = slots_settle(http, at["local-decode-qwen"])
        assert health["slots"]["busy"] == 0 and health["status"] == "healthy"
        alone = http.post(f"{at['local-decode-qwen']}/generate", json={"prompt": prompt, "max_new_tokens": 2}).json()
        assert alone["metrics"]["prompt_tokens_cached"] == 0  # nothing imported stayed behind
        # the client, with the prefill server gone: decode-only, saying so
        with DisaggregatedClient(streaming_cluster.config, health_check=False) as client:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                _, m = client.generate(model="qwen", prompt=prompt, max_tokens=4)
        assert m["method"] == "decode_only_fallback" and any(w.category is FallbackWarning for w in caught)
    finally:
        if server.proc.poll() is not None:
            server.restart()
            streaming_cluster.wait_healthy(timeout=120, names=[server.entry.name])


def test_a_decode_side_that_goes_away_mid_stream_frees_the_lease_and_stops_the_prefill(http, at):
    prefill_url = at["local-prefill-qwen"]
    pre = prefill(http, prefill_url, LONG)
    assert pre["kv"]["bytes"] > 6 << 20  # more than a socket's buffers hold: the sender cannot finish unread
    where = urlsplit(pre["kv"]["url"])
    puller = socket.socket()
    puller.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # reads little, like a decode server that died
    puller.connect((where.hostname, where.port))
    puller.sendall(f"GET {where.path} HTTP/1.1\r\nHost: {where.netloc}\r\n\r\n".encode())
    got = b""
    while len(got) < 4096:
        got += puller.recv(4096)
    assert b" 200 " in got.split(b"\r\n", 1)[0]
    puller.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset, as a dead process's
    puller.close()
    deadline = time.monotonic() + 30
    while http.get(f"{prefill_url}/health").json()["leases"]["held"] and time.monotonic() < deadline:
        time.sleep(0.1)
    health = slots_settle(http, prefill_url)
    assert health["leases"]["held"] == 0 and health["leases"]["bytes"] == 0
    assert health["slots"]["busy"] == 0
    gone = http.get(pre["kv"]["url"])
    assert gone.status_code == 404 and "abandoned" in gone.json()["error"]
    # and the server goes on serving
    again = prefill(http, prefill_url, "After the abandoned one. " + PROMPT)
    assert decode(http, at["local-decode-qwen"], again["kv"]).status_code == 200
