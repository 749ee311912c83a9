"""Issue 42 §3 on real servers: an answer survives its decode server.

A cluster of its own: one prefill server and two decode servers of the generated tiny llama, with
deterministic steps (as every test cluster), and the gateway. A long answer is streamed; once its
first pieces have arrived, the decode server that serves it is killed (or frozen: a hung server).
The answer goes on on the other decode server: the caller gets one answer, each piece once, its text
that of an uninterrupted run, and metrics and a warning that say where it moved. With no other decode
server, the error comes as it did, at once.
"""
from __future__ import annotations

import json
import time
import warnings

import pytest
import requests

from disaggregated_inference.client import DisaggregatedClient
from disaggregated_inference.errors import DisaggError
from disaggregated_inference.resume import ResumeWarning

from .conftest import tiny_config_dict
from .faults import freeze, thaw

pytestmark = pytest.mark.slow

LONG = 1500  # tokens: seconds of generation on the tiny model, so that the break comes mid-answer
PROMPT = "Write the quarterly revenue report, region by region:"
BREAK_AFTER = 20  # pieces the caller has when its decode server fails


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from disaggregated_inference.ops.cluster import LocalCluster

    data = tiny_config_dict()
    data["models"] = {"qwen": data["models"]["qwen"]}
    data["prefill_servers"] = [{"name": "prefill-a", "host": "127.0.0.1", "port": 1, "model": "qwen"}]
    data["decode_servers"] = [{"name": "decode-a", "host": "127.0.0.1", "port": 1, "model": "qwen"},
                              {"name": "decode-b", "host": "127.0.0.1", "port": 1, "model": "qwen"}]
    data["server"]["kv_fetch_timeout"] = 20
    data["client"].update(decode_timeout=120, prefill_timeout=60, connect_timeout=1, failures_before_down=1,
                          progress_timeout=2.0, health_check_interval=0.5)
    with LocalCluster(data, free_ports=True, log_dir=tmp_path_factory.mktemp("resume-logs"), gateway=True) as running:
        running.wait_healthy(timeout=300)
        yield running


def _decode(cluster) -> list:
    return [p for p in cluster.processes if p.entry.role == "decode"]


@pytest.fixture()
def client(cluster):
    for proc in cluster.processes:
        thaw(proc)
        if proc.proc.poll() is not None:
            proc.restart()
    cluster.wait_healthy(timeout=120)
    deadline = time.monotonic() + 60  # and the gateway's client has seen them up again (its checks: every 0.5 s)
    while time.monotonic() < deadline and not all(
            s["up"] for s in requests.get(cluster.gateway.url + "/health", timeout=5).json()["servers"]):
        time.sleep(0.2)
    with DisaggregatedClient(cluster.config, health_check=False) as c:
        c.check_health()
        yield c


def _by_address(cluster, address: str):
    return next(p for p in cluster.processes if p.entry.address == address)


def _kill(proc) -> None:
    freeze(proc)  # stopped first, so that it surely has more to send when it dies
    proc.kill()


@pytest.fixture(scope="module")
def reference(cluster):
    """The answer of an uninterrupted run (streamed, as the moved one is)."""
    with DisaggregatedClient(cluster.config, health_check=False) as c:
        c.check_health()
        *pieces, metrics = c.stream(model="qwen", prompt=PROMPT, max_tokens=LONG, ignore_eos=True, seed=0)
    assert metrics["completion_tokens"] == LONG and "resumed" not in metrics
    return "".join(pieces)


def _stream_with_a_failure(client, cluster, fault) -> tuple[list, dict, object]:
    route: dict = {}
    pieces, metrics, failed = [], None, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for item in client.stream(model="qwen", prompt=PROMPT, max_tokens=LONG, ignore_eos=True, seed=0,
                                  on_route=route.update):
            if isinstance(item, dict):
                metrics = item
                break
            pieces.append(item)
            if len(pieces) == BREAK_AFTER:
                failed = _by_address(cluster, route["decode_server"])
                fault(failed)
    assert any(issubclass(w.category, ResumeWarning) for w in caught), [str(w.message) for w in caught]
    return pieces, metrics, failed


@pytest.mark.parametrize("fault", [_kill, freeze], ids=["killed", "hung"])
def test_a_stream_continues_on_the_other_decode_server_with_the_same_text(client, cluster, reference, fault):
    pieces, metrics, failed = _stream_with_a_failure(client, cluster, fault)
    text = "".join(pieces)
    assert text == reference  # one answer, nothing repeated, nothing missing
    (move,) = metrics["resumed"]
    assert move["from_decode_server"] == failed.entry.address
    assert move["to_decode_server"] == metrics["decode_server"] != failed.entry.address
    assert BREAK_AFTER <= move["after_pieces"] < LONG  # it broke mid-answer
    assert move["pieces_replayed"] == move["after_pieces"]
    assert move["tokens_recomputed"] == metrics["prompt_tokens"] + move["pieces_replayed"]
    assert move["to_prefill_server"] is not None  # a fresh prefill, the prefill server being up
    assert metrics["completion_tokens"] == LONG
    assert any("failed mid-answer" in w for w in metrics["warnings"])
    thaw(failed)


def test_with_no_prefill_server_left_the_answer_goes_on_decode_only(client, cluster, reference):
    prefill = next(p for p in cluster.processes if p.entry.role == "prefill")

    def kill_both(decode):
        _kill(prefill)
        _kill(decode)

    pieces, metrics, failed = _stream_with_a_failure(client, cluster, kill_both)
    assert "".join(pieces) == reference
    (move,) = metrics["resumed"]
    assert move["to_prefill_server"] is None and move["method"] == "decode_only_fallback"
    assert metrics["method"] == "decode_only_fallback" and metrics["decode_server"] != failed.entry.address


def test_with_no_other_decode_server_the_error_comes_at_once(client, cluster):
    route: dict = {}
    other = None
    started = None
    with pytest.raises(DisaggError) as info:
        for item in client.stream(model="qwen", prompt=PROMPT, max_tokens=LONG, ignore_eos=True, seed=0,
                                  on_route=route.update):
            if other is None:
                serving = _by_address(cluster, route["decode_server"])
                other = next(p for p in _decode(cluster) if p is not serving)
                _kill(other)  # the only other decode server is gone first
                _kill(serving)
                started = time.monotonic()
    assert time.monotonic() - started < 5
    assert "resum" not in info.value.message and serving.entry.name in info.value.message


def _gateway_pieces(cluster, api: str) -> tuple[list[str], dict]:
    """Stream through the gateway (OpenAI SSE or Ollama NDJSON); kill the decode server after a few pieces."""
    url = cluster.gateway.url
    if api == "openai":
        body = {"model": "qwen", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": LONG,
                "temperature": 0, "seed": 0, "stream": True, "ignore_eos": True}
        path = "/v1/chat/completions"
    else:
        body = {"model": "qwen", "prompt": PROMPT, "stream": True,
                "options": {"num_predict": LONG, "temperature": 0, "seed": 0}}
        path = "/api/generate"
    pieces, last = [], None
    with requests.post(url + path, json=body, stream=True, timeout=180) as resp:
        assert resp.status_code == 200, resp.text
        serving = _by_address(cluster, resp.headers["X-Disagg-Decode-Server"])
        for raw in resp.iter_lines():
            if not raw:
                continue
            if api == "openai":
                data = raw.decode()
                assert data.startswith("data: "), data
                if data == "data: [DONE]":
                    break
                chunk = json.loads(data[len("data: "):])
                assert "error" not in chunk, chunk
                delta = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
                if delta:
                    pieces.append(delta)
                last = chunk
            else:
                line = json.loads(raw)
                assert "error" not in line, line
                if line.get("response"):
                    pieces.append(line["response"])
                last = line
            if len(pieces) == BREAK_AFTER:
                _kill(serving)
    return pieces, last


@pytest.mark.parametrize("api", ["openai", "ollama"])
def test_a_gateway_stream_goes_on_with_no_piece_repeated_or_missing(client, cluster, api):
    uninterrupted, _ = _reference_through_gateway(cluster, api)
    pieces, last = _gateway_pieces(cluster, api)
    assert "".join(pieces) == uninterrupted
    if api == "ollama":
        assert last["done"] is True and last["eval_count"] == LONG


def _reference_through_gateway(cluster, api: str) -> tuple[str, dict]:
    url = cluster.gateway.url
    if api == "openai":
        resp = requests.post(url + "/v1/chat/completions", json={
            "model": "qwen", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": LONG, "temperature": 0,
            "seed": 0, "ignore_eos": True}, timeout=180)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["message"]["content"], resp.json()
    resp = requests.post(url + "/api/generate", json={"model": "qwen", "prompt": PROMPT, "stream": False,
                                                      "options": {"num_predict": LONG, "temperature": 0, "seed": 0}},
                         timeout=180)
    assert resp.status_code == 200, resp.text
    return resp.json()["response"], resp.json()


def test_a_whole_answer_moves_too_and_says_so(client, cluster, reference):
    """``generate`` reads its answer as a stream too: broken off, it is served again on the other decode server
    (the client's failover), and its metrics say it moved, as a stream's do."""
    import threading

    killed = []

    def kill_the_busy_decode_server():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            busy = [s for s in client.servers.values() if s.entry.role == "decode" and s.outstanding]
            if busy:
                time.sleep(0.5)  # its answer under way
                killed.append(cluster.process(busy[0].entry.name))
                _kill(killed[0])
                return
            time.sleep(0.005)

    thread = threading.Thread(target=kill_the_busy_decode_server)
    thread.start()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text, metrics = client.generate(model="qwen", prompt=PROMPT, max_tokens=LONG, ignore_eos=True, seed=0)
    thread.join()
    assert text == reference
    (move,) = metrics["resumed"]
    assert move["from_decode_server"] == killed[0].entry.address != metrics["decode_server"]
    assert 0 < move["after_pieces"] < LONG and move["tokens_recomputed"] > move["after_pieces"]
    assert any(issubclass(w.category, ResumeWarning) for w in caught)
