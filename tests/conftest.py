"""Shared fixtures: real local clusters of gunicorn servers on free ports, one per session.

Two clusters, both shaped exactly as ``config_current.json`` (one prefill and one
decode server for each of "qwen" and "gpt-oss"), on ports the OS picks:

- ``tiny_cluster`` runs generated two-layer llama models (``tests/tiny_models.py``,
  SmolLM2's real tokenizer and chat template, random weights; a step takes about a
  millisecond). Tests of the protocol, trust, limits, failover, leases, backpressure,
  the gateway and the ops tools use it: what they check does not depend on what a
  model answers, and every handoff through it is still a real llama.cpp KV handoff.
- ``cluster`` runs the two packaged models (SmolLM2 as "qwen", Gemma 3 270M as
  "gpt-oss") for what needs their real answers: greedy-text equality of a handoff,
  the canary's thresholds, the grading calibration.
"""
from __future__ import annotations

import collections
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from disaggregated_inference.grading.classgen import CALIBRATION

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
# Greedy output depends on the thread count: tests and servers use the same. One thread each: the test
# clusters put four servers (and the test process) on a two-core machine, where two OpenMP threads per model
# either spin against each other at every barrier (measured here under load: SmolLM2 decoding at ~1 tok/s) or
# sleep at each one (22-30 tok/s), while one thread has no barrier at all (43 tok/s).
THREADS = 1
TINY_THREADS = 1  # the tiny models: a step is too small to split anyway


QUICK_TIER = "not slow"
WORKERS = 2
# the modules that start the packaged models' session cluster (``cluster``, ``calibration_run``) share one worker
# group, so that it starts once; the group goes first, as it is the longest
CLUSTER_GROUP = "cluster"


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """A run of the whole suite or of a tier (no paths given) goes on two pytest-xdist workers unless ``-n`` says
    otherwise; a run of chosen files or tests stays serial. Half of the suite's time was waits (servers starting and
    ending, timeouts, sandboxes, slow clients) or one core computing (the tests' models compute on one thread), and
    two workers overlap them: on the Intel VM of 2026-12-06 the serial suite kept the two cores 58% busy
    (docs/TESTING.md)."""
    from _pytest.config import Config

    if (config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput")
            and config.args_source != Config.ArgsSource.ARGS and config.option.numprocesses is None
            and not config.option.collectonly and not config.option.usepdb):
        config.option.numprocesses, config.option.dist = WORKERS, "loadgroup"
        # the workers inherit it: an in-process model of two threads (tests/test_determinism.py) whose threads spun
        # at every barrier while the other worker held a core took 44 s a test where it takes 2 alone; asleep
        # at once it waits for the core instead (the wait policy changes no numerics). An operator's own wins.
        from disaggregated_inference.tuning import openmp_environment, openmp_set_by_operator

        if not openmp_set_by_operator(os.environ):
            os.environ.update(openmp_environment("sleep", shared=False))


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a run with ``-p no:xdist`` does not know it
def pytest_configure_node(node):
    """pytest-xdist, on the controller: tells a worker whether tests go out by group (a worker parses the
    command line it was started with, so a ``dist`` set by ``pytest_cmdline_main`` does not reach it)."""
    node.workerinput["disagg_loadgroup"] = node.config.getvalue("dist") == "loadgroup"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """On pytest-xdist workers (``--dist loadgroup``) every test of a module runs on one worker: a module's
    fixtures start once, as in a serial run. The modules that use the packaged models' session cluster
    (``cluster``, and ``calibration_run``: minutes of grading on it) share a worker, so it starts and grades once;
    their group is handed out first, as the longest, and the others by how many slow tests they hold, the most
    first, so that no long module is left for the end while the other worker has nothing left to do."""
    if getattr(config, "workerinput", {}).get("disagg_loadgroup"):
        config.option.loadgroup = True  # read by xdist's own hook, after this one: it suffixes each id with its group
    if not getattr(config.option, "loadgroup", False):  # a serial run: nothing to group
        return
    packaged = {item.module.__name__ for item in items
                if {"cluster", "calibration_run"} & set(getattr(item, "fixturenames", ()))}
    for item in items:
        name = item.module.__name__
        item.add_marker(pytest.mark.xdist_group(CLUSTER_GROUP if name in packaged else name))
    slow = collections.Counter(item.module.__name__ for item in items if item.get_closest_marker("slow"))
    # stable: each module's own order is kept
    items.sort(key=lambda item: (item.module.__name__ not in packaged, -slow[item.module.__name__]))


def sigint_default() -> None:
    """``preexec_fn`` of a child a test interrupts with SIGINT: the signal back to its default. A suite
    launched as a shell's background job (``nohup ... &``) runs with SIGINT ignored, children inherit
    that, and Python leaves an ignored SIGINT ignored: the Ctrl-C tests then waited out their timeouts."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def command_of(proc) -> str:
    """A ``psutil.Process``'s command line, or "" once it has ended or is a zombie its parent has not reaped
    yet (a sandbox's ``bwrap`` pair, a notebook's kernel): a test that lists a launcher's children to find its
    servers skips those instead of failing on them."""
    import psutil

    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def cluster_config_dict(**server) -> dict:
    data = json.loads((ROOT / "config_current.json").read_text())
    for model in data["models"].values():
        model["n_threads"] = THREADS
        model["deterministic"] = True  # as in the cluster the grader starts (grading/connect.py): texts compared
    data["client"]["health_check_interval"] = 0  # tests drive health checks themselves
    # exactly THREADS threads: with shared cores a server's count follows the machine's load
    # (server/cores.py), and past a few hundred cells so do its numerics (kv/canary.py)
    data["server"]["share_cores"] = False
    data["server"].update(server)
    return data


def patient(config: dict) -> dict:
    """A cluster's config with room for complete answers on a slow, shared machine: the default timeouts
    (60 s prefill, 180 s decode) are for production hardware, and a test that fell back or timed out
    because the test machine was busy would test the machine, not the code."""
    return {**config, "client": {**config.get("client", {}), "prefill_timeout": 600.0, "decode_timeout": 900.0}}


def tiny_model_settings(other: bool = False) -> dict:
    """Model settings of a generated tiny llama; ``other`` gives another model (another fingerprint, and a
    third layer, so that its KV does not fit the first one's layout either: as with the two real models)."""
    from dataclasses import replace

    from .tiny_models import LLAMA, tiny_gguf

    shape = replace(LLAMA, n_layer=3, seed=1) if other else LLAMA
    return {"backend": "llama_cpp", "model": str(tiny_gguf(shape)), "n_threads": TINY_THREADS, "n_ctx": 4096,
            "flash_attn": True, "deterministic": True}


def tiny_config_dict(**server) -> dict:
    """``cluster_config_dict`` with both models generated tiny llamas ("qwen" the first, "gpt-oss" the other)."""
    data = cluster_config_dict(**server)
    data["models"]["qwen"].update(tiny_model_settings())
    data["models"]["gpt-oss"].update(tiny_model_settings(other=True))
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
def tiny_cluster(tmp_path_factory, bytes_server):
    from disaggregated_inference.ops.cluster import LocalCluster

    config = tiny_config_dict(kv_sources=[bytes_server.address])
    with LocalCluster(config, free_ports=True, log_dir=tmp_path_factory.mktemp("tiny-server-logs")) as running:
        running.wait_healthy(timeout=120)
        yield running


@pytest.fixture(scope="session")
def tiny_urls(tiny_cluster) -> dict:
    return {p.entry.name: p.url for p in tiny_cluster.processes}


@pytest.fixture(scope="session")
def tiny_prefill(tiny_urls):
    return tiny_urls["local-prefill-qwen"]


@pytest.fixture(scope="session")
def tiny_decode(tiny_urls):
    return tiny_urls["local-decode-qwen"]


@pytest.fixture(scope="session")
def tiny_gateway(tiny_cluster) -> str:
    """The OpenAI/Ollama gateway (a real gunicorn process) in front of ``tiny_cluster``: its base URL."""
    proc = tiny_cluster.gateway or tiny_cluster.start_gateway()
    tiny_cluster.wait_healthy(timeout=60, names=["gateway"])
    return proc.url


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


@pytest.fixture(scope="session")
def calibration_run(cluster, tmp_path_factory):
    """The calibration notebooks (excellent to wrong) graded once on the packaged models, all four at once
    as the grader's CLI grades a class: every test that needs real grades reads these.

    Returns ``(rubric, options, results)``, ``results`` by notebook name."""
    from disaggregated_inference import config as cluster_config
    from disaggregated_inference.client import DisaggregatedClient
    from disaggregated_inference.grading import GradingOptions, grade_batch, load_rubric

    rubric = load_rubric(EXAMPLES / "rubric.yaml")
    options = GradingOptions.for_cluster(cluster_config.coerce(cluster.config))
    notebooks = sorted(CALIBRATION.glob("*.ipynb"))
    with DisaggregatedClient(patient(cluster.config), health_check=False) as client:
        run = grade_batch(CALIBRATION, rubric, client, tmp_path_factory.mktemp("calibration"), options, force=True,
                          jobs=len(notebooks))
    return rubric, options, {r["submission"]["name"]: r for r in run.results}
