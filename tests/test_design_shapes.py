"""The design documents' shapes work: their request bodies, their config, their paths (issue 12, section 4).

Seed 004 posts ``{"context", "prompt", "max_new_tokens", "temperature"}`` to /decode, where
``context`` is what /prefill answered; seed 001 posts ``{"kv_cache": ..., "max_new_tokens"}``;
its config has only ``prefill_servers``/``decode_servers`` of ``{host, port, model, name}`` and
its client opens ``disaggregated_inference/config_current.json``; seed 003 retries a decode
server that does not answer once.
"""
from __future__ import annotations

import contextlib
import copy
import io
import json
import socket
import threading
import time
from pathlib import Path

import pytest

from disaggregated_inference import config
from disaggregated_inference.client import DisaggregatedClient
from disaggregated_inference.errors import BadRequest, ConfigError
from disaggregated_inference.server import prefill
from disaggregated_inference.server.parse import parse_decode
from disaggregated_inference.testing.bundles import read_bundle

from .test_ollama_backend import StubOllama, wait_loaded

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "List three columns a sales table usually has."

# Seed 004, "Step 5: Configure Orchestrator", as written there.
DOCUMENTS_CONFIG = {
    "prefill_servers": [
        {"host": "169.254.150.103", "port": 8000, "model": "qwen", "name": "DGX Spark 1"},
        {"host": "169.254.150.104", "port": 8000, "model": "gpt-oss", "name": "DGX Spark 2"},
    ],
    "decode_servers": [
        {"host": "169.254.150.102", "port": 8001, "model": "qwen", "name": "Mac Studio 2"},
        {"host": "169.254.150.101", "port": 8001, "model": "gpt-oss", "name": "Mac Studio 1"},
    ],
}


# -- the request shapes, parsed ----------------------------------------------------------------------

def test_seed_004_decode_body_parses_to_token_ids():
    req = parse_decode({"context": [1, 2, 3], "prompt": "original prompt", "max_new_tokens": 7, "temperature": 0.2})
    assert req.tokens == (1, 2, 3) and req.kv is None
    assert req.sampling.max_new_tokens == 7 and req.sampling.temperature == 0.2


def test_seed_001_kv_cache_is_the_prefill_kv_reference():
    kv = {"url": "http://127.0.0.1:8000/kv/abc", "handle": "abc", "bytes": 10, "crc32c": 5}
    req = parse_decode({"kv_cache": kv, "max_new_tokens": 100})
    assert req.kv is not None and (req.kv.url, req.kv.handle, req.kv.bytes) == (kv["url"], "abc", 10)
    assert req.tokens is None


@pytest.mark.parametrize("body, field, says", [
    ({"context": "processed_prompt"}, "context", "the 'context' a /prefill answer gave"),
    ({"context": []}, "context", "non-empty list"),
    ({"kv_cache": "bGFyZ2UgYmxvYg=="}, "kv_cache", "not accepted inside JSON"),
    ({"kv_cache": {"url": "ftp://x/kv/a", "handle": "a"}}, "kv_cache.url", "'kv_cache.url'"),
    ({"kv": {"url": "http://x/kv/a", "handle": "a"}, "context": [1]}, "kv", "exactly one"),
    ({"tokens": [1], "context": [1]}, "tokens", "also spelled 'context'"),
    ({"kv_cache": {"url": "http://x/kv/a", "handle": "a"}, "prompt": "hi"}, "prompt", "POST /generate"),
    ({"context": [1, 2], "prompt": 5}, "prompt", "must be a string"),
    ({}, "kv", "exactly one"),
])
def test_the_documents_shapes_refuse_what_they_cannot_mean(body, field, says):
    with pytest.raises(BadRequest) as info:
        parse_decode(body)
    assert info.value.field == field and says in info.value.message


# -- the config ---------------------------------------------------------------------------------------

def test_the_documents_config_asks_ollama_for_the_production_models():
    cfg = config.from_dict(DOCUMENTS_CONFIG)
    served = {s.name: (s.settings["backend"], s.settings["model"]) for s in cfg.servers}
    assert served == {"DGX Spark 1": ("ollama", "qwen3-coder:30b"), "DGX Spark 2": ("ollama", "gpt-oss:120b"),
                      "Mac Studio 2": ("ollama", "qwen3-coder:30b"), "Mac Studio 1": ("ollama", "gpt-oss:120b")}


def test_a_server_of_the_documents_config_loads_the_production_model_and_health_names_it(tmp_path, monkeypatch):
    """A real prefill app from the documents' config, against the payload-exact Ollama stand-in,
    which has pulled only "qwen3-coder:30b" (asking for "qwen" would find nothing)."""
    stub = StubOllama()
    path = tmp_path / "config_current.json"
    path.write_text(json.dumps(DOCUMENTS_CONFIG))
    monkeypatch.delenv("DISAGG_SERVER_SETTINGS", raising=False)
    monkeypatch.setenv("DISAGG_CONFIG", str(path))
    monkeypatch.setenv("DISAGG_SERVER", "DGX Spark 1")
    monkeypatch.setenv("OLLAMA_HOST", stub.url)
    app = prefill.create_app()
    try:
        client = app.test_client()
        health = wait_loaded(client)
        assert health["loaded"], health
        assert health["model"] == "qwen3-coder:30b" and health["model_key"] == "qwen"
        assert health["backend"] == "ollama" and health["name"] == "DGX Spark 1"
        assert {body["model"] for body in stub.generate_bodies()} == {"qwen3-coder:30b"}
        pre = client.post("/prefill", json={"prompt": "hello"}).get_json()
        assert pre["context"] and len(pre["context"]) == pre["prompt_tokens"]
        assert pre["model"] == "qwen3-coder:30b" and pre["model_key"] == "qwen"
    finally:
        app.extensions["disagg"].owner.close()
        stub.close()


def test_the_client_opens_the_documents_config_path_from_the_repository_root(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert not (ROOT / "disaggregated_inference" / "config_current.json").exists()  # one copy: the root's
    with DisaggregatedClient("disaggregated_inference/config_current.json", health_check=False) as client:
        assert client.config.source == "config_current.json"
        assert client.config.resolve_model("qwen3-coder:30b") == "qwen"


def test_the_documents_path_is_used_as_given_when_it_exists(tmp_path, monkeypatch):
    (tmp_path / "disaggregated_inference").mkdir()
    (tmp_path / "disaggregated_inference" / "config_current.json").write_text(json.dumps(DOCUMENTS_CONFIG))
    (tmp_path / "config_current.json").write_text("not json")
    monkeypatch.chdir(tmp_path)
    cfg = config.load("disaggregated_inference/config_current.json")
    assert cfg.source == "disaggregated_inference/config_current.json"
    assert cfg.find_server("DGX Spark 1").port == 8000


def test_a_missing_config_is_still_an_error_naming_the_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="disaggregated_inference/config_current.json"):
        config.load("disaggregated_inference/config_current.json")


def test_the_client_without_a_path_reads_disagg_config(tmp_path, monkeypatch):
    """docs/DEPLOYMENT.md: DisaggregatedClient() and `disagg generate` read $DISAGG_CONFIG."""
    path = tmp_path / "elsewhere.json"
    path.write_text(json.dumps(DOCUMENTS_CONFIG))
    monkeypatch.setenv("DISAGG_CONFIG", str(path))
    with DisaggregatedClient(health_check=False) as client:
        assert client.config.source == str(path)


# -- on a real cluster (of the generated tiny llamas: the shapes of the requests are tested, not answers) ---

@pytest.mark.slow
def test_prefill_context_is_the_prompt_ids_and_seed_004_decode_recomputes_from_it(http, tiny_prefill, tiny_decode):
    pre = http.post(f"{tiny_prefill}/prefill", json={"prompt": PROMPT}).json()
    assert len(pre["context"]) == pre["prompt_tokens"]
    # the same ids as the KV bundle carries (read from the bundle itself)
    _, bundle_ids, _ = read_bundle(io.BytesIO(http.get(pre["kv"]["url"]).content))
    assert list(bundle_ids) == pre["context"]

    body = {"context": pre["context"], "prompt": PROMPT, "max_new_tokens": 12, "temperature": 0}
    resp = http.post(f"{tiny_decode}/decode", json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    m = out["metrics"]
    # honest: only ids moved, the decode server evaluated the whole prompt, and nothing checked the tokenizer
    assert m["handoff"] == "token_ids" and m["method"] == "token_ids_recompute"
    assert m["prompt_tokens_recomputed"] == len(pre["context"]) and m["kv_bytes"] == 0
    assert m["fingerprint_checked"] is False
    alone = http.post(f"{tiny_decode}/generate", json={"prompt": PROMPT, "max_new_tokens": 12}).json()
    assert out["generated_text"] == alone["generated_text"]


@pytest.mark.slow
def test_seed_001_kv_cache_body_gets_the_real_handoff(http, tiny_prefill, tiny_decode):
    pre = http.post(f"{tiny_prefill}/prefill", json={"prompt": PROMPT}).json()
    resp = http.post(f"{tiny_decode}/decode", json={"kv_cache": pre["kv"], "max_new_tokens": 12})
    assert resp.status_code == 200, resp.text
    m = resp.json()["metrics"]
    assert m["method"] == "kv_handoff" and m["kv_bytes"] == pre["kv"]["bytes"] and m["fingerprint_checked"] is True


class LateListener:
    """A loopback port that refuses connections (bound, not listening) until ``open_to`` makes it
    accept and forward each connection to a real server."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()

    def open_to(self, host: str, port: int) -> None:
        self.sock.listen(8)
        self.sock.settimeout(0.1)
        threading.Thread(target=self._serve, args=(host, port), daemon=True).start()

    def _serve(self, host, port):
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (socket.timeout, OSError):
                continue
            conn.settimeout(None)
            self.accepted += 1
            upstream = socket.create_connection((host, port))
            for src, dst in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src, dst):
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self):
        self._stop.set()
        self.sock.close()


@pytest.mark.slow
def test_a_decode_server_that_refuses_the_first_connection_is_retried_once(tiny_cluster):
    data = copy.deepcopy(tiny_cluster.config)
    decode_entry = next(s for s in data["decode_servers"] if s["model"] == "qwen")
    real_host, real_port = decode_entry["host"], decode_entry["port"]
    late = LateListener()
    decode_entry["port"] = late.port
    try:
        with DisaggregatedClient(data, health_check=False) as client:
            retried = []

            def open_then_pause():
                retried.append(time.monotonic())
                late.open_to(real_host, real_port)

            client._pause_before_retry = open_then_pause
            text, m = client.generate(model="qwen", prompt=PROMPT, max_tokens=6)
        assert text and m["method"] == "kv_handoff"
        assert len(retried) == 1 and late.accepted >= 1
        assert m["decode_connect_retries"] == 1 and "retried once" in m["warnings"][0]
        assert m["decode_server"] == f"{real_host}:{late.port}"
    finally:
        late.close()


@pytest.mark.slow
def test_end_to_end_ttft_counts_the_prefill_the_server_ttft_does_not(tiny_cluster):
    with DisaggregatedClient(tiny_cluster.config, health_check=False) as client:
        _, m = client.generate(model="qwen", prompt=PROMPT, max_tokens=6)
    assert m["ttft"] > 0 and m["decode_connect_retries"] == 0
    # the client's clock to the /decode it sent covers the prefill's round trip; then the server's ttft
    assert m["ttft_end_to_end"] >= m["ttft"] + m["prefill_time"]
    assert m["ttft_end_to_end"] <= m["total_time"]


@pytest.mark.slow
def test_a_streams_end_to_end_ttft_is_its_first_piece_on_the_clients_clock(tiny_cluster):
    with DisaggregatedClient(tiny_cluster.config, health_check=False) as client:
        started = time.perf_counter()
        events = client.stream(model="qwen", prompt=PROMPT, max_tokens=6)
        first = next(events)
        first_seen = time.perf_counter() - started
        *rest, m = list(events)
    assert isinstance(first, str) and all(isinstance(piece, str) for piece in rest)
    assert m["method"] == "kv_handoff" and m["decode_connect_retries"] == 0
    assert m["ttft"] + m["prefill_time"] <= m["ttft_end_to_end"] <= first_seen <= m["total_time"]
