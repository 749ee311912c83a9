"""Shared fixtures: a real local cluster of gunicorn servers on free ports.

The cluster runs the two packaged models (SmolLM2 as "qwen", Gemma 3 270M as
"gpt-oss"), one prefill and one decode server each, exactly as
``config_current.json`` does, but on ports the OS picks.
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

ROOT = Path(__file__).resolve().parents[1]
THREADS = 2  # greedy output depends on the thread count: tests and servers use the same


def cluster_config_dict(**server) -> dict:
    data = json.loads((ROOT / "config_current.json").read_text())
    for model in data["models"].values():
        model["n_threads"] = THREADS
    data["client"]["health_check_interval"] = 0  # tests drive health checks themselves
    # exactly THREADS threads: with shared cores a server's count follows the machine's load
    # (server/cores.py), and past a few hundred cells so do its numerics (kv/canary.py)
    data["server"]["share_cores"] = False
    data["server"].update(server)
    return data


@pytest.fixture(scope="session")
def cluster(tmp_path_factory, bytes_server):
    from disaggregated_inference.ops.cluster import LocalCluster

    logs = tmp_path_factory.mktemp("server-logs")
    # the decode servers trust their prefill servers and, explicitly, the stand-in that serves bad bundles
    config = cluster_config_dict(kv_sources=[bytes_server.address])
    with LocalCluster(config, free_ports=True, log_dir=logs) as running:
        running.wait_healthy(timeout=600)
        yield running


@pytest.fixture(scope="session")
def urls(cluster) -> dict:
    return {p.entry.name: p.url for p in cluster.processes}


@pytest.fixture(scope="session")
def qwen_prefill(urls):
    return urls["local-prefill-qwen"]


@pytest.fixture(scope="session")
def qwen_decode(urls):
    return urls["local-decode-qwen"]


@pytest.fixture(scope="session")
def http():
    with requests.Session() as session:
        yield session


@pytest.fixture(scope="session")
def bytes_server():
    """A stand-in prefill server on a free loopback port that serves whatever bytes a test sets.

    ``serve(path, data, status=200)`` makes GET ``path`` answer ``data`` with ``status`` and
    returns its URL; any other path answers 404 with no body. ``serve.address`` is its host:port
    (the session's cluster trusts it as a KV source).
    """
    served = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            status, body = served.get(self.path, (404, b""))
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"

    def serve(path: str, data: bytes, status: int = 200) -> str:
        served[path] = (status, data)
        return base + path

    serve.address = f"127.0.0.1:{server.server_address[1]}"
    yield serve
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="session")
def gateway(cluster) -> str:
    """The OpenAI/Ollama gateway (a real gunicorn process) in front of ``cluster``: its base URL."""
    proc = cluster.gateway or cluster.start_gateway()
    cluster.wait_healthy(timeout=60, names=["gateway"])
    return proc.url
