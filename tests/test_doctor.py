"""``disagg doctor`` on a real local cluster: a healthy pair, a mismatched pair, a dead server.

The servers run the tiny generated qwen3moe model (tests/tiny_models.py): one prefill server and
two decode servers, one of them with flash attention off, which makes its KV layout (V
transposed) incompatible with every bundle of the prefill server.
"""
from __future__ import annotations

import json
import socket

import pytest
import requests

from disaggregated_inference import config as cluster_config
from disaggregated_inference.ops import cli
from disaggregated_inference.ops.doctor import PROMPT_LENGTHS, Doctor, format_report
from disaggregated_inference.server.probe import MAX_PROBE_BYTES

from .conftest import TINY_THREADS
from .tiny_models import tiny_gguf

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster_dict(tmp_path_factory):
    from disaggregated_inference.ops.cluster import LocalCluster

    model = {"backend": "llama_cpp", "model": str(tiny_gguf("qwen3moe")), "n_ctx": 1024, "n_threads": TINY_THREADS,
             "flash_attn": True}
    config = {
        "models": {"qwen": {"aliases": ["qwen3-coder:30b"], **model}},
        "prefill_servers": [{"name": "prefill", "host": "127.0.0.1", "port": 18100, "model": "qwen"}],
        "decode_servers": [{"name": "decode", "host": "127.0.0.1", "port": 18101, "model": "qwen"},
                           {"name": "decode-no-fa", "host": "127.0.0.1", "port": 18102, "model": "qwen",
                            "flash_attn": False}],
        "client": {"health_check_interval": 0},
    }
    with LocalCluster(config, free_ports=True, log_dir=tmp_path_factory.mktemp("logs")) as running:
        running.wait_healthy(timeout=300)
        yield running.config


def subset(data: dict, decode_names: list[str]) -> dict:
    data = json.loads(json.dumps(data))
    data["decode_servers"] = [s for s in data["decode_servers"] if s["name"] in decode_names]
    return data


def test_a_healthy_pair_has_no_problems_and_a_measured_path(cluster_dict):
    report = Doctor(cluster_config.coerce(subset(cluster_dict, ["decode"])), probe_bytes=2 << 20).run()
    assert report.problems == [], format_report(report)
    (pair,) = report.pairs
    assert pair["compatible"] and pair["throughput_MB_s"] > 0
    # tiny qwen3moe: 4 layers x 2 KV heads x 32 dims x K and V x f16 = 1,024 bytes, plus 12 of cell metadata
    assert 1024 <= pair["kv_bytes_per_token"] <= 1100
    assert [float(pair["handoff_s"][str(n)]) > 0 for n in PROMPT_LENGTHS] == [True] * 3
    assert pair["handoff_s"]["2048"] < pair["handoff_s"]["32768"]
    assert all(s["state"] == "healthy" and s["flash_attn"] is not None for s in report.servers)


def test_a_mismatched_pair_and_a_dead_server_are_reported(cluster_dict):
    data = json.loads(json.dumps(cluster_dict))
    data["decode_servers"].append({"name": "decode-dead", "host": "127.0.0.1", "port": free_port(), "model": "qwen"})
    report = Doctor(cluster_config.coerce(data), probe_bytes=1 << 20, timeout=5).run()
    text = format_report(report)
    by_where = {p.where: p for p in report.problems}
    mismatch = by_where["qwen: prefill -> decode-no-fa"]
    assert "flash_attn" in mismatch.problem and "flash_attn" in mismatch.fix
    dead = next(p for where, p in by_where.items() if "decode-dead" in where)
    assert "not reachable" in dead.problem and "disagg serve" in dead.fix
    assert "qwen: prefill -> decode" not in by_where  # the good pair stays good
    assert len(report.problems) == 2, text
    assert "NO" in text and "decode-dead" in text


def test_cli_exit_status(cluster_dict, tmp_path, capsys):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(subset(cluster_dict, ["decode"])))
    bad.write_text(json.dumps(cluster_dict))
    assert cli.main(["doctor", "--config", str(good), "--probe-mb", "1"]) == 0
    assert "no problems found" in capsys.readouterr().out
    assert cli.main(["doctor", "--config", str(bad), "--probe-mb", "1", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and any("flash_attn" in p["problem"] for p in out["problems"])


def test_token_mismatch_in_the_config_is_a_problem():
    data = {"models": {"qwen": {"model": "smollm2"}},
            "prefill_servers": [{"name": "p", "host": "127.0.0.1", "port": free_port(), "model": "qwen"}],
            "decode_servers": [], "server": {"api_token": "secret"}, "client": {"api_token": "other"}}
    report = Doctor(cluster_config.coerce(data), timeout=2).run()
    assert any(p.where == "config" and "token" in p.problem for p in report.problems)


def test_probe_endpoints_check_their_input(cluster_dict):
    prefill = cluster_dict["prefill_servers"][0]
    decode = cluster_dict["decode_servers"][0]
    base = f"http://127.0.0.1:{prefill['port']}"
    ok = requests.get(f"{base}/kv/probe?bytes=12345", timeout=10)
    assert ok.status_code == 200 and len(ok.content) == 12345
    too_big = requests.get(f"{base}/kv/probe?bytes={MAX_PROBE_BYTES + 1}", timeout=10)
    assert too_big.status_code == 400 and too_big.json()["field"] == "bytes"
    pull = requests.post(f"http://127.0.0.1:{decode['port']}/kv/probe", json={"url": f"{base}/health"}, timeout=10)
    assert pull.status_code == 400 and pull.json()["field"] == "url"
    pulled = requests.post(f"http://127.0.0.1:{decode['port']}/kv/probe",
                           json={"url": f"{base}/kv/probe?bytes=100000"}, timeout=10).json()
    assert pulled["bytes"] == 100000 and pulled["bytes_per_second"] > 0


def test_check_status_runs_the_doctor(cluster_dict, tmp_path, capsys):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import check_status

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(cluster_dict))
    assert check_status.main(["--config", str(bad)]) == 0  # every server is up: the table alone passes
    assert check_status.main(["--config", str(bad), "--doctor"]) == 1
    assert "flash_attn: prefill has True, decode has False" in capsys.readouterr().out


def test_a_server_running_without_the_configured_token_is_a_problem(cluster_dict):
    data = subset(cluster_dict, ["decode"])
    data["server"]["api_token"] = data["client"]["api_token"] = "s3cret"
    report = Doctor(cluster_config.coerce(data), probe_bytes=1 << 20).run()
    assert sorted(p.where.split(" ")[1] for p in report.problems if "without an API token" in p.problem) == \
        ["decode", "prefill"]


@pytest.fixture(scope="module")
def token_cluster_dict(tmp_path_factory):
    from disaggregated_inference.ops.cluster import LocalCluster

    config = {
        "models": {"qwen": {"backend": "llama_cpp", "model": str(tiny_gguf("qwen3moe")), "n_ctx": 512,
                            "n_threads": 1}},
        "prefill_servers": [{"name": "prefill", "host": "127.0.0.1", "port": 18110, "model": "qwen"}],
        "decode_servers": [{"name": "decode", "host": "127.0.0.1", "port": 18111, "model": "qwen"}],
        "client": {"health_check_interval": 0, "api_token": "s3cret"},
        "server": {"api_token": "s3cret"},
    }
    with LocalCluster(config, free_ports=True, log_dir=tmp_path_factory.mktemp("logs")) as running:
        running.wait_healthy(timeout=300)
        yield running.config


def test_with_a_token_the_path_is_measured_and_a_wrong_token_is_reported(token_cluster_dict):
    cfg = cluster_config.coerce(token_cluster_dict)
    good = Doctor(cfg, probe_bytes=1 << 20).run()
    assert good.problems == [], format_report(good)
    assert good.pairs[0]["throughput_MB_s"] > 0  # the decode server's own token opened the prefill's probe
    prefill = f"http://127.0.0.1:{token_cluster_dict['prefill_servers'][0]['port']}"
    assert requests.get(f"{prefill}/kv/probe?bytes=10", timeout=10).status_code == 401
    wrong = Doctor(cfg, api_token="wrong", probe_bytes=1 << 20).run()
    assert any("token" in p.problem for p in wrong.problems), format_report(wrong)
