"""Issue 27 §2-3: a hung server is found in seconds, and a caller's own deadline blames no server.

A hung server is a frozen process (SIGSTOP: its listening socket still accepts connections, so a
request sent to it waits, as it would on a machine that hangs). The client reads every answer as a
stream of progress lines (heartbeats while a request waits or is evaluated, then its tokens), so
silence is noticed within ``client.progress_timeout`` (5 s by default), not after the caller's
whole ``prefill_timeout`` (60 s) or ``decode_timeout`` (180 s). A caller whose own deadline passes
while the server kept making progress gets its timeout, and the server stays up. A server marked down
comes back by itself once it answers, with the background health checker off.

On the session's tiny cluster; every test thaws what it froze, whatever happens.
"""
from __future__ import annotations

import contextlib
import copy
import time
import warnings

import pytest

from disaggregated_inference.client import DisaggregatedClient
from disaggregated_inference.errors import DisaggError, UpstreamTimeout

from .faults import freeze, thaw

pytestmark = pytest.mark.slow

PROMPT = "Summarise the quarter's revenue by region, with returns noted."


@contextlib.contextmanager
def frozen(cluster, name: str):
    proc = cluster.process(name)
    freeze(proc)
    try:
        yield proc
    finally:
        thaw(proc)


def client_of(cluster, server: dict | None = None, **client) -> DisaggregatedClient:
    """A client with the cluster's default timeouts (60 s prefill, 180 s decode) unless ``client`` says
    otherwise, no background health checker, and a server marked down at its first failure."""
    config = copy.deepcopy(cluster.config)
    config["client"].update(health_check_interval=0, failures_before_down=1, **client)
    config["server"].update(server or {})
    return DisaggregatedClient(config, health_check=False)


def test_a_hung_prefill_server_costs_a_request_seconds_not_the_prefill_timeout(tiny_cluster):
    with client_of(tiny_cluster) as client, frozen(tiny_cluster, "local-prefill-qwen"):
        started = time.monotonic()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            text, metrics = client.generate(model="qwen", prompt=PROMPT, max_tokens=4)
        took = time.monotonic() - started
        assert metrics["method"] == "decode_only_fallback" and text
        assert took < 10, f"a hung prefill server cost the request {took:.1f} s"
        assert client.servers["local-prefill-qwen"].up is False  # it sent nothing at all: hung
    # thawed, it is taken back by itself (no health checker runs): a probe sees it answer again
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        _, metrics = client.generate(model="qwen", prompt=PROMPT, max_tokens=4)
        if metrics["method"] == "kv_handoff":
            break
        time.sleep(0.5)
    assert metrics["method"] == "kv_handoff", metrics.get("warnings")
    assert client.servers["local-prefill-qwen"].up is True


def test_a_decode_server_that_hangs_mid_stream_is_abandoned_within_seconds_of_its_last_token(tiny_cluster):
    with client_of(tiny_cluster) as client:
        pieces = client.stream(model="qwen", prompt=PROMPT, max_tokens=3000)
        next(pieces)
        last = time.monotonic()
        with frozen(tiny_cluster, "local-decode-qwen"):
            with pytest.raises(DisaggError) as info:
                for _ in pieces:  # what the server had sent before it froze still arrives
                    last = time.monotonic()
            silent = time.monotonic() - last
        assert silent < 10, f"abandoned {silent:.1f} s after the last token: {info.value}"
        assert client.servers["local-decode-qwen"].up is False


def test_a_hung_decode_server_fails_a_request_in_seconds_and_is_served_again_once_it_answers(tiny_cluster):
    with client_of(tiny_cluster) as client:
        with frozen(tiny_cluster, "local-decode-qwen"):
            started = time.monotonic()
            with pytest.raises(DisaggError) as info:
                client.generate(model="qwen", prompt=PROMPT, max_tokens=4)
            took = time.monotonic() - started
            assert took < 10, f"a hung decode server gave no answer for {took:.1f} s: {info.value}"
        # thawed: the next request is served without any health check having run
        text, metrics = client.generate(model="qwen", prompt=PROMPT, max_tokens=4)
        assert text and metrics["method"] == "kv_handoff"
        assert client.servers["local-decode-qwen"].up is True


def test_a_callers_own_deadline_leaves_a_progressing_server_up(tiny_cluster):
    """decode_timeout of 1 s for 3,000 tokens (the tiny model takes about a millisecond a token): the caller gets its
    timeout; the decode server, which kept sending tokens, is not blamed, and serves the next request."""
    kv = {"kv_fetch_timeout": 0.5, "kv_progress_timeout": 0.5}  # the client's decode_timeout must exceed it
    with client_of(tiny_cluster, server=kv, decode_timeout=1.0) as client:
        with pytest.raises(UpstreamTimeout) as info:
            client.generate(model="qwen", prompt=PROMPT, max_tokens=3000)
        assert "decode_timeout" in str(info.value), info.value
        decode = client.servers["local-decode-qwen"]
        assert decode.up is True and decode.failures == 0, decode.as_dict()
        text, metrics = client.generate(model="qwen", prompt=PROMPT, max_tokens=4)
        assert text and metrics["method"] == "kv_handoff"
