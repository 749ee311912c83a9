"""Issue 34 on real servers: a class larger than the cluster's slots, a stop that frees the servers' slots,
and Ctrl-C to the real command line with its own local cluster.

The servers are real gunicorn processes with generated tiny models (tests/tiny_models.py): what the models
answer is random and not the point; the slots, the queues, the deadlines and the cancellation are.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
import requests

from disaggregated_inference import config as cluster_config
from disaggregated_inference.client import DisaggregatedClient
from disaggregated_inference.grading import GradingOptions, grade_batch, load_rubric
from disaggregated_inference.grading import cli
from disaggregated_inference.grading.classgen import generate_class
from .conftest import command_of, sigint_default
from .fakes import StreamingFakeClient

from .tiny_models import tiny_cluster_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
RUBRIC = ROOT / "examples" / "rubric.yaml"
SLOTS = 2  # per server: the classes below are larger
SHORT = 48  # tokens per answer where the answer's length is not the point
CLASS = 4  # notebooks: twice the slots


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The embedded cluster's layout on the tiny models, its client's health monitor on (every second)."""
    from disaggregated_inference.ops.cluster import LocalCluster

    config = tiny_cluster_config(parallel=SLOTS)
    config["client"]["health_check_interval"] = 1.0
    with LocalCluster(config, free_ports=True, log_dir=tmp_path_factory.mktemp("logs")) as running:
        running.wait_healthy(timeout=300)
        yield running


@pytest.fixture(scope="module")
def klass(tmp_path_factory):
    folder = tmp_path_factory.mktemp("class")
    generate_class(folder, CLASS)
    return folder


def health(cluster) -> dict:
    return {p.entry.name: requests.get(p.url + "/health", timeout=10).json() for p in cluster.processes}


def queue_waits(cluster) -> tuple[float, float]:
    """(requests, requests that waited 0.5 s or more for a slot) on the decode servers so far."""
    total = slow = 0.0
    for p in cluster.processes:
        if p.entry.role != "decode":
            continue
        text = requests.get(p.url + "/metrics", timeout=10).text
        count = float(re.search(r"^disagg_queue_seconds_count (\S+)$", text, re.M).group(1))
        quick = float(re.search(r'^disagg_queue_seconds_bucket\{le="0.5"\} (\S+)$', text, re.M).group(1))
        total, slow = total + count, slow + count - quick
    return total, slow


def test_a_class_larger_than_the_slots_ends_with_no_server_marked_down(tiny, klass, tmp_path):
    config = cluster_config.coerce(tiny.config)
    options = GradingOptions.for_cluster(config, code_max_tokens=SHORT, feedback_max_tokens=SHORT)
    before = queue_waits(tiny)
    with DisaggregatedClient(config) as client:  # its health monitor runs through the batch
        client.check_health()
        batch = grade_batch(klass, load_rubric(RUBRIC), client, tmp_path, options, jobs=CLASS)
        status = client.status()
    run = batch.summary["run"]
    assert batch.graded == [f"s0{i}" for i in range(1, CLASS + 1)]
    assert all(r["status"] in ("graded", "needs_review") for r in batch.results)  # none "error"
    assert run["servers_marked_down"] == [] and all(s["up"] for s in status)
    assert run["fallbacks"] == 0
    assert {r["method"] for res in batch.results for r in res["inference"]["requests"]} == {"kv_handoff"}
    # all the notebooks at once, but never more requests at a model than its decode slots: none waited at a server
    assert all(p["most_in_flight"] == SLOTS for p in run["pace"].values())
    after = queue_waits(tiny)
    assert after[0] - before[0] >= 2 * CLASS and after[1] - before[1] == 0
    assert all(h["slots"]["busy"] == 0 for h in health(tiny).values())


def test_a_stop_cancels_the_requests_on_the_servers(tiny, klass, tmp_path):
    config = cluster_config.coerce(tiny.config)
    options = GradingOptions.for_cluster(config)  # long answers: the requests are still running when it stops
    stop, seen = threading.Event(), []

    def progress(p):
        busy = {name: h["slots"]["busy"] for name, h in health(tiny).items() if "decode" in name}
        if sum(busy.values()) >= 2 and not stop.is_set():  # both models decoding
            seen.append(busy)
            stop.set()

    with DisaggregatedClient(config, health_check=False) as client:
        client.check_health()
        batch = grade_batch(klass, load_rubric(RUBRIC), client, tmp_path, options, jobs=2, progress=progress,
                            stop=stop)
        stopped = time.monotonic()
        assert batch.stopped and seen and batch.not_graded
        deadline, busy = time.monotonic() + 5, None
        while time.monotonic() < deadline:
            busy = {name: h["slots"]["busy"] for name, h in health(tiny).items()}
            if not any(busy.values()):
                break
            time.sleep(0.1)
        assert not any(busy.values()), busy  # every slot free again: the servers dropped the cancelled jobs
        freed = time.monotonic() - stopped
    assert freed < 5
    assert not list(tmp_path.glob("*.tmp"))


@contextmanager
def grader_process(args: list[str], log: Path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, str(ROOT / "business_analytics_grader_v2.py"), *args], cwd=ROOT,
                                env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=sigint_default)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for child in _servers_of(proc):
            child.kill()


def _servers_of(proc) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _gone(processes: list[psutil.Process], within: float = 5.0) -> bool:
    """Every process ended (or a zombie) within ``within`` seconds: a sandbox's ``bwrap`` pair, killed with
    the grader's process group, can take a moment to be reaped by its own parent."""
    def left():
        alive = []
        for p in processes:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        return alive

    deadline = time.monotonic() + within
    while left():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def interrupt(proc, times: int = 1) -> tuple[int, float]:
    """Ctrl-C ``times`` (0.2 s apart, while the process still runs: a stop with nothing to wait for can end
    before the next); the exit code, and the seconds from the last one sent to the exit."""
    for n in range(times):
        if n:
            time.sleep(0.2)
            if proc.poll() is not None:
                break
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
    code = proc.wait(30)
    return code, time.monotonic() - sent


def _wait_for(condition, timeout: float, proc, log: Path, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if proc.poll() is not None:
            pytest.fail(f"the grader exited ({proc.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    pytest.fail(f"no {what} within {timeout} s:\n{log.read_text()[-3000:]}")


def test_ctrl_c_stops_the_command_line_and_its_cluster_and_the_same_command_continues(klass, tmp_path,
                                                                                      monkeypatch, capsys):
    config_file = tmp_path / "tiny.json"
    config_file.write_text(json.dumps(tiny_cluster_config(parallel=SLOTS)))
    out, log = tmp_path / "grades", tmp_path / "grader.log"
    args = [str(klass), "--rubric", str(RUBRIC), "--local-cluster", "--config", str(config_file), "--out", str(out),
            "--jobs", "2", "--no-progress"]
    with grader_process(args, log) as proc:
        first = _wait_for(lambda: sorted(out.glob("s0*.json")), 300, proc, log, "graded notebook")
        servers = _servers_of(proc)
        assert len([s for s in servers if "gunicorn" in command_of(s)]) >= 4
        code, took = interrupt(proc)
        text = log.read_text()
    assert code == 130 and took < 10, text[-3000:]
    assert _gone(servers), [s.pid for s in servers]  # the local cluster was stopped
    line = next(line for line in text.splitlines() if line.startswith("grader: stopped:"))
    graded = sorted(p.stem for p in out.glob("s0*.json"))
    assert f"{len(graded)} notebooks graded in this run" in line and "run the same command again" in line
    assert len(graded) >= len(first) and len(graded) < CLASS
    for name in graded:  # whole reports, each a final grade
        result = json.loads((out / f"{name}.json").read_text())
        assert result["status"] in ("graded", "needs_review") and (out / f"{name}.md").read_text().startswith("# ")
    assert not list(out.glob("*.tmp"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["stopped"] and summary["run"]["graded"] == len(graded)

    # the same command again grades the rest only (the models are faked here: which notebooks is the point)
    fake = StreamingFakeClient()

    @contextmanager
    def fake_cluster(config=None, **kwargs):
        yield fake

    monkeypatch.setattr(cli, "open_client", fake_cluster)
    capsys.readouterr()
    assert cli.main(args) == 0
    rest = sorted({re.search(r"Student: ([^.\n]+)", c["prompt"]).group(1) for c in fake.calls})
    assert len(rest) == CLASS - len(graded)
    assert f"{CLASS} submissions ({CLASS - len(graded)} graded now, {len(graded)} kept" in capsys.readouterr().out


def test_a_second_ctrl_c_exits_at_once_and_kills_the_cluster(klass, tmp_path):
    config_file = tmp_path / "tiny.json"
    config_file.write_text(json.dumps(tiny_cluster_config(parallel=SLOTS)))
    log = tmp_path / "grader.log"
    args = [str(klass), "--rubric", str(RUBRIC), "--local-cluster", "--config", str(config_file),
            "--out", str(tmp_path / "grades"), "--jobs", "2"]  # progress lines (not a terminal): one per notebook
    with grader_process(args, log) as proc:
        _wait_for(lambda: "s01: grading" in log.read_text(), 300, proc, log, "grading")
        servers = _servers_of(proc)
        code, took = interrupt(proc, times=2)
        text = log.read_text()
    assert code == 130 and took < 3, text[-3000:]
    # the second Ctrl-C stops at once; where the first stop had already ended (CI, 2026-11-28), it said so
    assert "stopped at once (second interrupt)" in text or "run the same command again" in text, text[-3000:]
    assert _gone(servers)
