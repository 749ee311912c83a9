"""Issue 12 §1: under ``disagg up`` a server that dies is restarted (with backoff, said on stderr),
not the end of the cluster. A real one-server LocalCluster (the generated tiny llama); its gunicorn is killed."""
from __future__ import annotations

import threading
import time

import pytest
import requests

from disaggregated_inference.ops.supervise import Supervisor

from .conftest import tiny_config_dict

pytestmark = pytest.mark.slow


def test_a_killed_server_is_restarted_with_backoff(tmp_path):
    from disaggregated_inference.ops.cluster import LocalCluster

    data = tiny_config_dict()
    data["models"] = {"qwen": data["models"]["qwen"]}
    data["prefill_servers"] = []
    data["decode_servers"] = [{"name": "decode-only", "host": "127.0.0.1", "port": 1, "model": "qwen"}]
    said: list[str] = []
    with LocalCluster(data, free_ports=True, log_dir=tmp_path) as cluster:
        cluster.wait_healthy(timeout=300)
        proc = cluster.processes[0]
        stop = threading.Event()
        supervisor = Supervisor(cluster, said.append, first_delay=0.5)
        thread = threading.Thread(target=supervisor.run, args=(stop, 0.1), daemon=True)
        thread.start()
        try:
            for round_ in (1, 2):
                first_pid = proc.proc.pid
                proc.kill()
                deadline = time.monotonic() + 30
                while supervisor.restarts.get("decode-only", 0) < round_ and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert proc.proc.pid != first_pid
                cluster.wait_healthy(timeout=300)
                assert requests.get(proc.url + "/health", timeout=5).json()["loaded"] is True
        finally:
            stop.set()
            thread.join(5)
    assert any("decode-only exited" in s and "restarting it in 0.5s" in s for s in said), said
    assert any("restarting it in 1s" in s for s in said), said  # a second quick death waits twice as long
    assert any("decode-only restarted (restart 2)" in s for s in said), said
