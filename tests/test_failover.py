"""The client survives failures of real server processes: failover, fallback, recompute, clear errors.

A cluster of its own (two prefill servers and one decode server of the generated tiny llama: what is
tested is the client's handling of dead servers, not a model's answer) so that servers can be killed
and restarted without disturbing other tests.
"""
from __future__ import annotations

import threading
import time

import pytest

from disaggregated_inference.client import DisaggregatedClient, FallbackWarning
from disaggregated_inference.errors import NoServerAvailable

from .conftest import tiny_config_dict
from .faults import freeze, thaw

pytestmark = pytest.mark.slow

LONG_PROMPT = "Revenue by region and month, with returns and discounts noted. " * 60 + "Summarise."


@pytest.fixture(scope="module")
def small_cluster(tmp_path_factory):
    from disaggregated_inference.ops.cluster import LocalCluster

    data = tiny_config_dict()
    data["models"] = {"qwen": data["models"]["qwen"]}
    data["prefill_servers"] = [
        {"name": "prefill-a", "host": "127.0.0.1", "port": 1, "model": "qwen"},
        {"name": "prefill-b", "host": "127.0.0.1", "port": 1, "model": "qwen"},
    ]
    data["decode_servers"] = [{"name": "decode-a", "host": "127.0.0.1", "port": 1, "model": "qwen"}]
    with LocalCluster(data, free_ports=True, log_dir=tmp_path_factory.mktemp("failover-logs")) as cluster:
        cluster.wait_healthy(timeout=300)
        yield cluster


@pytest.fixture()
def client(small_cluster):
    """A client with fast timeouts; every server running before the test starts."""
    for proc in small_cluster.processes:
        thaw(proc)  # a test that failed half-way may have left one frozen
        if proc.proc.poll() is not None:
            proc.restart()
    small_cluster.wait_healthy(timeout=120)
    config = small_cluster.config
    config["client"].update(decode_timeout=20, prefill_timeout=20, connect_timeout=1, failures_before_down=1)
    config["server"]["kv_fetch_timeout"] = 15  # a decode_timeout must exceed it (the client's copy of the config)
    with DisaggregatedClient(config, health_check=False) as c:
        yield c


def test_both_prefill_servers_share_the_load(client):
    methods, servers = set(), set()
    for i in range(4):
        _, m = client.generate(model="qwen3-coder:30b", prompt=f"Say the number {i}.", max_tokens=3)
        methods.add(m["method"])
        servers.add(m["prefill_server"])
    assert methods == {"kv_handoff"}
    assert len(servers) == 2  # round-robin among equally idle servers


def test_prefill_server_killed_between_requests_fails_over(client, small_cluster):
    small_cluster.process("prefill-a").kill()
    for i in range(3):
        text, m = client.generate(model="qwen", prompt=f"Count to {i + 2}.", max_tokens=4)
        assert text and m["method"] == "kv_handoff"
        assert m["prefill_server"] == small_cluster.process("prefill-b").entry.address
    states = {s["name"]: s["up"] for s in client.status()}
    assert states["prefill-a"] is False and states["prefill-b"] is True


def test_prefill_server_killed_during_a_request_fails_over(client, small_cluster):
    """Both prefill servers are frozen, so that the request is surely still held by one of them when it is
    killed (the tiny model would finish a prefill in milliseconds); the other one thaws at that moment."""
    prefills = [small_cluster.process(name) for name in ("prefill-a", "prefill-b")]
    killed = []

    def kill_the_busy_prefill_server():
        busy = [s for s in client.servers.values() if s.entry.role == "prefill" and s.outstanding]
        if busy:
            small_cluster.process(busy[0].entry.name).kill()
            killed.append(busy[0].entry.address)
        for proc in prefills:
            thaw(proc)

    for proc in prefills:
        freeze(proc)
    threading.Timer(0.8, kill_the_busy_prefill_server).start()
    started = time.monotonic()
    text, m = client.generate(model="qwen", prompt=LONG_PROMPT, max_tokens=4)
    assert killed, "the request should still have been in prefill after 0.8 s"
    assert text and m["method"] == "kv_handoff"
    assert m["prefill_server"] != killed[0]
    assert time.monotonic() - started < 60


def test_no_prefill_server_left_falls_back_to_decode_only_with_a_warning(client, small_cluster):
    small_cluster.process("prefill-a").kill()
    small_cluster.process("prefill-b").kill()
    with pytest.warns(FallbackWarning, match="decode-only"):
        text, m = client.generate(model="qwen", prompt="Name a colour.", max_tokens=4)
    assert text
    assert m["method"] == "decode_only_fallback"
    assert m["prefill_server"] is None and m["kv_bytes"] == 0
    assert m["prompt_tokens_recomputed"] == m["prompt_tokens"]
    assert m["warnings"]


def test_restarted_server_is_marked_up_again(client, small_cluster):
    proc = small_cluster.process("prefill-a")
    proc.kill()
    client.check_health()
    assert client.servers["prefill-a"].up is False
    assert "health check failed" in client.servers["prefill-a"].last_error
    proc.restart()
    small_cluster.wait_healthy(timeout=60, names=["prefill-a"])
    client.check_health()
    assert client.servers["prefill-a"].up is True and client.servers["prefill-a"].last_error is None


def test_decode_server_down_is_a_clear_error_within_the_timeout(client, small_cluster):
    small_cluster.process("decode-a").kill()
    started = time.monotonic()
    with pytest.raises(NoServerAvailable, match="decode server") as info:
        client.generate(model="qwen", prompt="Hello?", max_tokens=4)
    assert time.monotonic() - started < 10
    assert "decode-a" in str(info.value) or "none healthy" in str(info.value)


def test_expired_lease_is_recomputed_once(client, small_cluster, monkeypatch):
    """The first decode reaches the prefill server after the KV's lease ran out: the client
    prefills again, and the answer arrives through a real handoff."""
    real_post = client._post
    delayed = []

    def slow_first_decode(server, path, body, timeout):
        if path == "/prefill":
            body = {**body, "lease_seconds": 0.5}
        if path == "/decode" and not delayed:
            delayed.append(True)
            time.sleep(1.6)  # the sweeper drops the lease meanwhile
        return real_post(server, path, body, timeout)

    monkeypatch.setattr(client, "_post", slow_first_decode)
    text, m = client.generate(model="qwen", prompt="Name two fruits.", max_tokens=4)
    assert text and delayed == [True]
    assert m["method"] == "kv_handoff"
    assert any("lease" in w and "recomputing" in w for w in m["warnings"])
