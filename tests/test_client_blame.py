"""Issue 12 §1: the client blames the right server. A busy server (503 overloaded) is skipped but
stays up (and a cluster whose servers are all busy is tried again after their Retry-After); a decode server that reports its KV pull failed (its upstream's fault) is not marked down."""
from __future__ import annotations

import warnings

import pytest

from disaggregated_inference.client import DisaggregatedClient
from disaggregated_inference.errors import NoServerAvailable, Overloaded, UpstreamTimeout

from .conftest import cluster_config_dict


def two_decode_config() -> dict:
    data = cluster_config_dict()
    data["models"] = {"qwen": data["models"]["qwen"]}
    data["prefill_servers"] = [{"name": "p", "host": "127.0.0.1", "port": 9001, "model": "qwen"}]
    data["decode_servers"] = [{"name": "d1", "host": "127.0.0.1", "port": 9002, "model": "qwen"},
                              {"name": "d2", "host": "127.0.0.1", "port": 9003, "model": "qwen"}]
    data["client"].update(failures_before_down=1, decode_timeout=2.5)  # how long a busy cluster is waited for
    data["server"].update(kv_fetch_timeout=2, kv_progress_timeout=1)
    return data


DECODED = {"generated_text": "ok", "finish_reason": "stop", "metrics": {"method": "kv_handoff"}}
PREFILLED = {"kv": {"url": "http://127.0.0.1:9001/kv/h", "handle": "h"}, "metrics": {}, "prompt_tokens": 3}


def scripted(client, answers: dict):
    """Replace the HTTP call: ``answers[(server, path)]`` is a dict to return or an error to raise."""
    calls = []

    def post(server, path, body, timeout):
        calls.append((server.entry.name, path))
        answer = answers[(server.entry.name, path)]
        if isinstance(answer, Exception):
            raise answer
        return answer

    client._post = post
    return calls


def test_an_overloaded_server_is_skipped_but_stays_up():
    with DisaggregatedClient(two_decode_config(), health_check=False) as client:
        busy = Overloaded("all 7 work slots of this server are taken", retry_after=1)
        calls = scripted(client, {("p", "/prefill"): PREFILLED, ("d1", "/decode"): busy, ("d2", "/decode"): busy})
        client.servers["d2"].outstanding = 1  # d1 is tried first
        with pytest.raises(NoServerAvailable):
            client.generate("qwen", "hi")
        # both tried, then again after the Retry-After (1 s), until the decode timeout (2.5 s) would pass
        assert calls.count(("d1", "/decode")) >= 2 and calls.count(("d2", "/decode")) >= 2, calls
        assert client.servers["d1"].up and client.servers["d2"].up  # busy, not dead
        client.servers["d2"].outstanding = 0
        answers = {("p", "/prefill"): PREFILLED, ("d1", "/decode"): busy, ("d2", "/decode"): DECODED}
        scripted(client, answers)
        client.servers["d2"].outstanding = 1
        text, metrics = client.generate("qwen", "hi")
        assert text == "ok" and metrics["decode_server"] == "127.0.0.1:9003" and client.servers["d1"].up


def test_a_decode_server_reporting_its_kv_pull_failed_is_not_marked_down():
    with DisaggregatedClient(two_decode_config(), health_check=False) as client:
        upstream = UpstreamTimeout("KV transfer from http://127.0.0.1:9001 abandoned: no KV bytes arrived for 5s",
                                   field="kv")  # what the decode server answered (504), not our own timeout
        scripted(client, {("p", "/prefill"): PREFILLED, ("d1", "/decode"): upstream, ("d2", "/decode"): upstream,
                          ("d1", "/generate"): DECODED, ("d2", "/generate"): DECODED})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            text, metrics = client.generate("qwen", "hi")
        assert text == "ok" and metrics["method"] == "decode_only_fallback"
        assert client.servers["d1"].up and client.servers["d2"].up


def test_the_recompute_avoids_a_prefill_server_its_kv_could_not_be_pulled_from():
    """A decode server that answers its KV pull timed out (a hung prefill server: no KV bytes came) gets
    the recompute's KV from the other prefill server; the first one is marked (softly), not the decode."""
    data = two_decode_config()
    data["prefill_servers"] = [{"name": "p1", "host": "127.0.0.1", "port": 9001, "model": "qwen"},
                               {"name": "p2", "host": "127.0.0.1", "port": 9004, "model": "qwen"}]
    data["decode_servers"] = data["decode_servers"][:1]
    data["client"]["failures_before_down"] = 2
    with DisaggregatedClient(data, health_check=False) as client:
        stalled = UpstreamTimeout("KV transfer from http://127.0.0.1:9001 abandoned: no KV bytes arrived for 5s",
                                  field="kv")
        pulls = []

        def post(server, path, body, timeout):
            if path == "/prefill":
                return {**PREFILLED, "server": server.entry.name}
            pulls.append(body["kv"])
            if len(pulls) == 1:
                raise stalled
            return DECODED

        calls = []
        client._post = lambda server, path, body, timeout: calls.append((server.entry.name, path)) or post(
            server, path, body, timeout)
        client.servers["p2"].outstanding = 1  # p1 is tried first
        text, metrics = client.generate("qwen", "hi")
        client.servers["p2"].outstanding = 0
    prefills = [name for name, path in calls if path == "/prefill"]
    assert text == "ok" and prefills == ["p1", "p2"], calls
    assert metrics["prefill_server"] == "127.0.0.1:9004" and any("recomputing" in w for w in metrics["warnings"])
    assert client.servers["p1"].failures == 1 and client.servers["p1"].up  # suspect, not yet down
    assert client.servers["d1"].up and client.servers["d1"].failures == 0
