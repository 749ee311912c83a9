"""Issue 27 §1: slow clients hold no request thread. Connections that trickle their request headers a
byte at a time (the classic slowloris) wait in the worker's poller, not on one of its 32 request
threads: ``/health`` and a real ``/generate`` keep answering beside 200 of them, and each is closed
with a 408 once its header deadline has passed. On the session's tiny cluster (real gunicorn servers)."""
from __future__ import annotations

import socket
import time

import pytest
import requests

from .faults import SlowClients

pytestmark = pytest.mark.slow

SLOW_CONNECTIONS = 200
HEADER_TIMEOUT = 10.0  # the servers' default server.header_timeout


def _address(url: str) -> tuple:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def test_200_slow_connections_leave_health_and_generate_answering(tiny_decode):
    health_times, generate_times = [], []
    with SlowClients(_address(tiny_decode), SLOW_CONNECTIONS, gap=0.5) as slow:
        time.sleep(1.0)  # every connection has started its headers
        for _ in range(6):
            started = time.monotonic()
            assert requests.get(tiny_decode + "/health", timeout=30).status_code == 200
            health_times.append(time.monotonic() - started)
            started = time.monotonic()
            resp = requests.post(tiny_decode + "/generate", json={"prompt": "Hi", "max_new_tokens": 2}, timeout=60)
            assert resp.status_code == 200, resp.text
            generate_times.append(time.monotonic() - started)
            time.sleep(0.5)
        # the header deadline closes every slow connection, with a 408 that says why
        deadline = time.monotonic() + HEADER_TIMEOUT + 5
        while len(slow.closed) < SLOW_CONNECTIONS and time.monotonic() < deadline:
            time.sleep(0.2)
        closed = dict(slow.closed)
    assert max(health_times) < 1.0, health_times
    assert max(generate_times) < 5.0, generate_times
    assert len(closed) == SLOW_CONNECTIONS, f"{len(closed)} of {SLOW_CONNECTIONS} closed by the server"
    waited = [at for at, _ in closed.values()]
    assert HEADER_TIMEOUT - 1 <= min(waited) and max(waited) <= HEADER_TIMEOUT + 5, (min(waited), max(waited))
    said = next(iter(closed.values()))[1]
    assert said.startswith(b"HTTP/1.1 408") and b'"field": "headers"' in said, said[:300]


def test_a_trickled_body_is_cut_off_by_its_deadline_without_holding_a_thread(tiny_decode):
    """A request whose headers arrived but whose body trickles waits in the poller too (until
    ``body_timeout``), and gets the 408 naming ``body`` the servers already answered."""
    body = b'{"prompt": "Hi", "max_new_tokens": 2}'
    socks = []
    for _ in range(40):
        s = socket.create_connection(_address(tiny_decode), timeout=5)
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body[:5])
        socks.append(s)
    try:
        started = time.monotonic()
        assert requests.get(tiny_decode + "/health", timeout=30).status_code == 200
        assert time.monotonic() - started < 1.0
        resp = requests.post(tiny_decode + "/generate", json={"prompt": "Hi", "max_new_tokens": 2}, timeout=60)
        assert resp.status_code == 200
        socks[0].settimeout(HEADER_TIMEOUT + 10)
        answer = socks[0].recv(4096)
        assert answer.startswith(b"HTTP/1.1 408") and b'"field": "body"' in answer, answer[:300]
    finally:
        for s in socks:
            s.close()
