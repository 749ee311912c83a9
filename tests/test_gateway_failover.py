"""The gateway survives a prefill server killed mid-request: the answer arrives by failover or
fallback, and its method header says which. A cluster of its own (two prefill servers, one
decode server of the generated tiny llama, the gateway in front), as tests/test_failover.py does;
the prefill servers are frozen while the request is sent, so that one surely holds it when it dies."""
from __future__ import annotations

import threading
import time

import openai
import pytest
import requests

from .conftest import tiny_config_dict
from .faults import freeze, thaw

pytestmark = pytest.mark.slow

LONG_PROMPT = "Revenue by region and month, with returns and discounts noted. " * 60 + "Summarise."


@pytest.fixture(scope="module")
def gw_cluster(tmp_path_factory):
    from disaggregated_inference.ops.cluster import LocalCluster

    data = tiny_config_dict()
    data["models"] = {"qwen": data["models"]["qwen"]}
    data["prefill_servers"] = [
        {"name": "prefill-a", "host": "127.0.0.1", "port": 1, "model": "qwen"},
        {"name": "prefill-b", "host": "127.0.0.1", "port": 1, "model": "qwen"},
    ]
    data["decode_servers"] = [{"name": "decode-a", "host": "127.0.0.1", "port": 1, "model": "qwen"}]
    # the gateway's client checks health often, so that it sees restarted servers up again
    data["server"]["kv_fetch_timeout"] = 20  # within the client's decode timeout (checked on load)
    data["client"].update(decode_timeout=30, prefill_timeout=30, connect_timeout=1, failures_before_down=1,
                          health_check_interval=0.5)
    with LocalCluster(data, free_ports=True, log_dir=tmp_path_factory.mktemp("gw-failover-logs"),
                      gateway=True) as cluster:
        cluster.wait_healthy(timeout=300)
        yield cluster


def _prefill_servers(cluster) -> list:
    return [p for p in cluster.processes if p.entry.role == "prefill"]


def _kill_the_busy_prefill_server(cluster, killed: list, also_the_other: bool = False):
    """Ask the gateway which (frozen) prefill server holds the request; kill it (and the other one), and
    thaw whatever is left."""
    deadline = time.monotonic() + 10
    try:
        while time.monotonic() < deadline and not killed:
            servers = requests.get(cluster.gateway.url + "/health", timeout=5).json()["servers"]
            busy = [s["name"] for s in servers if s["role"] == "prefill" and s["outstanding"]]
            if busy:
                cluster.process(busy[0]).kill()
                killed.append(cluster.process(busy[0]).entry.address)
                if also_the_other:
                    for proc in _prefill_servers(cluster):
                        proc.kill()
                return
            time.sleep(0.05)
    finally:
        for proc in _prefill_servers(cluster):
            thaw(proc)


def _openai(cluster):
    return openai.OpenAI(base_url=cluster.gateway.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _all_running(cluster):
    for proc in cluster.processes:  # a previous test killed some (or failed with one frozen)
        thaw(proc)
        if proc.proc.poll() is not None:
            proc.restart()
    cluster.wait_healthy(timeout=120)
    deadline = time.monotonic() + 30
    while not all(s["up"] for s in requests.get(cluster.gateway.url + "/health", timeout=5).json()["servers"]):
        assert time.monotonic() < deadline, "the gateway should see every server up again"
        time.sleep(0.2)


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_server_killed_mid_request_fails_over(gw_cluster, stream):
    _all_running(gw_cluster)
    killed: list = []
    killer = threading.Thread(target=_kill_the_busy_prefill_server, args=(gw_cluster, killed))
    for proc in _prefill_servers(gw_cluster):
        freeze(proc)
    killer.start()
    raw = _openai(gw_cluster).chat.completions.with_raw_response.create(
        model="qwen", messages=[{"role": "user", "content": LONG_PROMPT}], max_tokens=4, temperature=0,
        stream=stream)
    killer.join()
    assert killed, "the request should have been seen in prefill"
    if stream:
        assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    else:
        assert raw.parse().choices[0].message.content
    assert raw.headers["X-Disagg-Method"] == "kv_handoff"
    assert raw.headers["X-Disagg-Prefill-Server"] not in ("none", killed[0])  # the other one served it


def test_every_prefill_server_killed_mid_stream_falls_back(gw_cluster):
    _all_running(gw_cluster)
    killed: list = []
    killer = threading.Thread(target=_kill_the_busy_prefill_server, args=(gw_cluster, killed, True))
    for proc in _prefill_servers(gw_cluster):
        freeze(proc)
    killer.start()
    with requests.post(gw_cluster.gateway.url + "/api/generate", stream=True, timeout=120, json={
            "model": "qwen", "prompt": LONG_PROMPT, "options": {"temperature": 0, "num_predict": 4}}) as resp:
        killer.join()
        assert resp.status_code == 200, resp.text
        assert killed
        assert resp.headers["X-Disagg-Method"] == "decode_only_fallback"
        assert resp.headers["X-Disagg-Prefill-Server"] == "none"
        lines = [line for line in resp.iter_lines() if line]
    assert b'"done": true' in lines[-1] and b'"decode_only_fallback"' in lines[-1]
    metrics = requests.get(gw_cluster.gateway.url + "/metrics", timeout=10).text
    assert 'disagg_gateway_fallbacks_total{model="qwen"} 1.0' in metrics
