"""``disagg bench`` against real servers (the session's ``tiny_cluster``) and a real OpenAI-API peer (the project's
own gateway, a real gunicorn process): the report's figures checked against the requests it sent; bad input
refused before any load; a peer that stops answering counted as failed while the run ends on time; Ctrl-C
writes what was measured, marked incomplete. The tiny models' answers mean nothing: the figures do.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from disaggregated_inference.bench import table
from disaggregated_inference.bench.load import Sample
from disaggregated_inference.bench.machines import attribute_energy
from disaggregated_inference.bench.measure import RequestTiming
from disaggregated_inference.bench.workloads import BenchRequest
from disaggregated_inference import cli

from .conftest import sigint_default

ROOT = Path(__file__).resolve().parents[1]
NAMES = [m.name for m in table.METRICS]


def _config(tiny_cluster, tmp_path, **server_extra) -> Path:
    data = tiny_cluster.config
    data["client"] = {**data["client"], "prefill_timeout": 600.0, "decode_timeout": 900.0}
    for entry in data["decode_servers"][:1]:
        entry.update(server_extra)
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(data))
    return path


def _bench(*argv) -> int:
    return cli.main(["bench", *map(str, argv)])


def _rows(rows: list) -> dict:
    return {r["name"]: r for r in rows}


def _check_table(rows: list) -> None:
    """Every seed-004 metric: a value with the status its target gives, or not measured with a reason."""
    assert [r["name"] for r in rows] == NAMES
    for r in rows:
        if r["value"] is None:
            assert r["status"] == "not_measured" and r["reason"], r
        else:
            met = r["value"] < r["target"] if r["better"] == "lower" else r["value"] > r["target"]
            assert r["status"] == ("met" if met else "not_met"), r


@pytest.fixture(scope="module")
def peer_run(tiny_cluster, tiny_gateway, tmp_path_factory):
    """One bench run: 8 chat requests through the client, 2 at once, beside the gateway as an OpenAI-API peer and
    as an Ollama-API peer (it speaks both)."""
    tmp = tmp_path_factory.mktemp("bench")
    config = _config(tiny_cluster, tmp, power_watts=120, cost_per_hour=0.4)
    out = tmp / "out"
    rc = _bench("--config", config, "--workload", "chat", "--requests", 8, "--concurrency", 2, "--max-tokens", 8,
                "--peer", f"gw=openai:{tiny_gateway}", "--peer", f"gwo=ollama:{tiny_gateway}", "--price-kwh", 0.3,
                "--out", out,
                "--target", "e2e_latency_p95_s=60")
    assert rc == 0
    return json.loads((out / "bench.json").read_text()), out, tiny_cluster


def test_the_report_adds_up_to_the_requests_it_sent(peer_run):
    report, out, cluster = peer_run
    assert report["format"] == "disagg-bench/1" and report["complete"] is True
    load = [d for d in report["requests_detail"] if d["side"] == "ours" and d["stage"] == "load"]
    assert len(load) == report["requests"]["sent"] == 8  # --requests 8, split over two phases
    assert report["requests"]["completed"] == sum(d["ok"] for d in load)
    assert report["requests"]["completed"] + report["requests"]["failed"] == 8
    ours_phases = [p for p in report["phases"] if p["side"] == "ours"]
    assert [p["phase"] for p in ours_phases] == [1, 2]
    assert report["duration_s"] == pytest.approx(sum(p["wall_s"] for p in ours_phases), abs=1e-3)
    rows = _rows(report["success_metrics"])
    _check_table(report["success_metrics"])
    assert rows["e2e_latency_p95_s"]["target"] == 60.0  # --target
    assert rows["throughput_req_s"]["value"] == pytest.approx(
        report["requests"]["completed"] / report["duration_s"], rel=1e-4)
    assert report["serving"]["request_throughput"] == pytest.approx(rows["throughput_req_s"]["value"], rel=1e-3)
    assert rows["error_rate"]["value"] == pytest.approx(report["requests"]["failed"] / 8)
    e2el = sorted(d["e2el_s"] for d in load if d["ok"])
    assert e2el[0] <= rows["e2e_latency_p95_s"]["value"] <= e2el[-1]
    assert rows["failover_time_s"]["status"] == "not_measured" and "--chaos" in rows["failover_time_s"]["reason"]
    # parallel efficiency: the same groups sent both ways, the ratio of the sums
    eff = report["parallel_efficiency"]
    assert rows["parallel_efficiency"]["value"] == pytest.approx(eff["sequential_s"] / eff["parallel_s"], rel=1e-3)
    # energy: one machine (all four servers on loopback) counted once; estimated from power_watts unless the
    # machine has a counter, and then the reason the servers gave is in the report
    health = requests.get(cluster.processes[0].url + "/health", timeout=10).json()
    machines = report["energy"]["machines"]
    assert len(machines) == 1 and len(machines[0]["servers"]) == 4
    if health["energy"]["joules"] is None:
        assert machines[0]["energy_basis"] == "estimated"
        assert health["energy"]["reason"] in machines[0]["energy_reason"]
        assert rows["requests_per_kwh"]["basis"] == "estimated"
        kwh = machines[0]["energy_j"] / 3.6e6
        assert rows["requests_per_kwh"]["value"] == pytest.approx(report["requests"]["completed"] / kwh, rel=1e-3)
        # the energy given to requests adds up to the machine's
        assert sum(d["energy_j"] for d in load if d["energy_j"]) == pytest.approx(machines[0]["energy_j"], rel=0.01)
    cost = report["energy"]["cost"]
    assert rows["cost_per_request_usd"]["value"] == pytest.approx(
        ((cost["energy_usd"] or 0) + cost["hardware_usd"]) / report["requests"]["completed"], rel=1e-3)
    assert rows["hardware_utilization"]["value"] is not None  # this machine's CPU, from the kernel's counters
    # the handoff's parts per model, and the files a person reads
    for model in ("qwen", "gpt-oss"):
        assert report["models"][model]["handoff"]["methods"], model
    text = (out / "bench.md").read_text()
    assert "## Seed 004's success metrics" in text and "## Per model" in text
    assert "## Against gw (openai" in text and "## Against gwo (ollama" in text
    for chart in report["charts"]:
        assert (out / chart).stat().st_size > 1000


@pytest.mark.parametrize("name, protocol", [("gw", "openai"), ("gwo", "ollama")])
def test_each_peer_gets_the_same_requests_and_its_rows_and_ratios(peer_run, name, protocol):
    report, _, _ = peer_run
    peer = next(p for p in report["peers"] if p["name"] == name)
    assert peer["protocol"] == protocol
    detail = report["requests_detail"]
    for phase in (1, 2):
        ours = [d["index"] for d in detail if d["side"] == "ours" and d["stage"] == "load" and d["phase"] == phase]
        theirs = [d["index"] for d in detail if d["side"] == name and d["stage"] == "load" and d["phase"] == phase]
        assert sorted(ours) == sorted(theirs) and ours
    # phases alternate: ours, each peer, ours, each peer
    assert [p["side"] for p in report["phases"]] == ["ours", "gw", "gwo"] * 2
    assert peer["requests"] == {"sent": 8, "completed": 8, "failed": 0}, peer["failures"]
    _check_table(peer["success_metrics"])
    prow = _rows(peer["success_metrics"])
    assert prow["throughput_req_s"]["value"] == pytest.approx(peer["requests"]["completed"] / peer["duration_s"],
                                                               rel=1e-4)
    assert prow["parallel_efficiency"]["value"] is not None
    ours = _rows(report["success_metrics"])
    for c in peer["comparison"]:
        assert c["ours"] == ours[c["name"]]["value"] and c["peer"] == prow[c["name"]]["value"]
        if c["ours"] is not None and c["peer"]:
            assert c["ours_over_peer"] == pytest.approx(c["ours"] / c["peer"], rel=1e-3)
    assert prow["requests_per_kwh"]["status"] == "not_measured"
    tokens = [d["output_tokens"] for d in detail if d["side"] == name and d["ok"]]
    assert tokens and all(0 < n <= 8 for n in tokens)  # the server's own count, within --max-tokens


@pytest.mark.parametrize("argv, message", [
    (["--workload", "nonsense"], "unknown workload 'nonsense'"),
    (["--workload", "{jsonl}"], "line 2: not JSON"),
    (["--workload", "{unknown_model}"], "line 1: unknown model 'llama3'"),
    (["--duration", "5", "--requests", "3"], "--duration or --requests, not both"),
    (["--chaos"], "--chaos needs --local-cluster"),
    (["--peer", "dead=http://127.0.0.1:9"], "peer dead at http://127.0.0.1:9 does not answer"),
    (["--rate", "0"], "--rate must be > 0"),
    (["--workload", "{hot}"], "line 1: 'temperature' must be a number >= 0, got \"hot\""),
    (["--peer-model", "llama=llama3"], "'llama' is not a model of"),
])
def test_bad_input_is_named_before_any_load(tmp_path, capsys, argv, message):
    (tmp_path / "bad.jsonl").write_text('{"model": "qwen", "prompt": "hi", "max_tokens": 4}\n{"model": qwen}\n')
    (tmp_path / "unknown.jsonl").write_text('{"model": "llama3", "prompt": "hi", "max_tokens": 4}\n')
    (tmp_path / "hot.jsonl").write_text('{"model": "qwen", "prompt": "hi", "max_tokens": 4, "temperature": "hot"}\n')
    argv = [a.format(jsonl=tmp_path / "bad.jsonl", unknown_model=tmp_path / "unknown.jsonl", hot=tmp_path / "hot.jsonl")
            for a in argv]
    rc = _bench("--config", ROOT / "config_current.json", "--out", tmp_path / "out", *argv)
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing measured, nothing written


@pytest.mark.parametrize("argv, message", [
    (["--target", "speed=3"], "unknown metric 'speed'"),
    (["--peer", "nourl"], "a peer is NAME=URL"),
    (["--via", "carrier-pigeon"], "invalid choice"),
])
def test_bad_flags_are_refused_by_name(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        _bench(*argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


class _Hanging(BaseHTTPRequestHandler):
    """A peer that lists its models and then never answers a request."""

    def do_GET(self):
        body = b'{"data": []}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        time.sleep(30)

    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_a_peer_that_stops_answering_fails_its_requests_and_the_run_ends_on_time(tiny_cluster, tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hanging)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        started = time.monotonic()
        rc = _bench("--config", _config(tiny_cluster, tmp_path), "--workload", "chat", "--duration", 4,
                    "--phases", 1, "--max-tokens", 4, "--grace", 1, "--efficiency-groups", 0,
                    "--peer", f"stuck=openai:http://127.0.0.1:{server.server_address[1]}", "--out", tmp_path / "o")
        elapsed = time.monotonic() - started
    finally:
        server.shutdown()
        server.server_close()
    assert rc == 0
    report = json.loads((tmp_path / "o" / "bench.json").read_text())
    [peer] = report["peers"]
    assert peer["requests"]["sent"] >= 1 and peer["requests"]["completed"] == 0
    assert all("after the phase stopped sending" in r for r in peer["failures"]["by_reason"])
    assert report["requests"]["completed"] > 0
    assert elapsed < 4 + 1 + 4 + 30  # each side 4 s, 1 s of grace; not the peer's 30 s hang


@pytest.mark.slow
def test_ctrl_c_writes_what_was_measured_marked_incomplete(tiny_cluster, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "disaggregated_inference.cli", "bench", "--config",
                             str(_config(tiny_cluster, tmp_path)), "--workload", "chat", "--duration", "120",
                             "--max-tokens", "4", "--out", str(tmp_path / "o")],
                            cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)
    try:
        for line in proc.stderr:  # progress lines: wait until some requests are answered
            if " done," in line and not line.split(" done,")[0].endswith(" 0"):
                break
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, rest
    report = json.loads((tmp_path / "o" / "bench.json").read_text())
    assert report["complete"] is False and "Ctrl-C" in report["incomplete_reason"]
    assert report["requests"]["completed"] >= 1
    _check_table(report["success_metrics"])
    assert "Incomplete" in (tmp_path / "o" / "bench.md").read_text()


def test_table_status_and_ratios():
    rows = [table.row("e2e_latency_p95_s", 3.0, {}), table.row("throughput_req_s", 12.0, {"throughput_req_s": 20}),
            table.row("requests_per_kwh", None, {}, "not measured on box: no counter")]
    assert [r["status"] for r in rows] == ["met", "not_met", "not_measured"]
    assert rows[1]["target"] == 20
    peer = [table.row("e2e_latency_p95_s", 6.0, {}), table.row("throughput_req_s", 4.0, {}),
            table.row("requests_per_kwh", 10.0, {})]
    by = {c["name"]: c for c in table.comparison(rows, peer)}
    assert by["e2e_latency_p95_s"]["ours_over_peer"] == 0.5 and by["e2e_latency_p95_s"]["better"] == "ours"
    assert by["throughput_req_s"]["ours_over_peer"] == 3.0 and by["throughput_req_s"]["better"] == "ours"
    assert by["requests_per_kwh"]["ours_over_peer"] is None


def test_energy_is_shared_by_tokens_among_requests_in_flight():
    def sample(sent, pieces, prompt_tokens):
        t = RequestTiming(started=sent, pieces=list(pieces), ended=pieces[-1], output_tokens=len(pieces),
                          prompt_tokens=prompt_tokens)
        return Sample(BenchRequest(0, "qwen", {}), "ours", "load", 0, sent, t, pieces[-1])

    a = sample(0.0, [0.5, 0.6, 0.7], prompt_tokens=7)  # 10 tokens in [0, 1)
    b = sample(0.0, [1.5, 1.6], prompt_tokens=0)       # 2 tokens in [1, 2)
    shares = attribute_energy([a, b], [(0.0, 1.0, 100.0), (1.0, 2.0, 50.0), (5.0, 6.0, 30.0)])
    # [0, 1): a has 10 tokens, b none; [1, 2): b alone has tokens; [5, 6): nobody in flight, shared evenly
    assert shares[id(a)] == pytest.approx(100 + 15)
    assert shares[id(b)] == pytest.approx(50 + 15)


def test_each_server_reports_its_machines_energy_or_why_not(tiny_cluster):
    """Real servers: an ``energy`` block in /health (the same machine for all four) and, where the machine has a
    counter, ``disagg_energy_joules_total`` by device on /metrics; where it has none, no sample and a reason."""
    from prometheus_client.parser import text_string_to_metric_families

    blocks = [requests.get(p.url + "/health", timeout=10).json()["energy"] for p in tiny_cluster.processes]
    assert len({b["machine"] for b in blocks}) == 1
    metrics = requests.get(tiny_cluster.processes[0].url + "/metrics", timeout=10).text
    samples = [s for f in text_string_to_metric_families(metrics) if f.name == "disagg_energy_joules"
               for s in f.samples if s.name == "disagg_energy_joules_total"]
    if blocks[0]["joules"] is None:
        assert blocks[0]["reason"].startswith("no energy counter on this machine") and not samples
    else:
        assert {s.labels["device"] for s in samples} == set(blocks[0]["joules"])


def test_the_energy_counter_is_exported_by_device(monkeypatch):
    from disaggregated_inference.server import energy
    from disaggregated_inference.server.metrics import ServerMetrics

    monkeypatch.setattr(energy, "_probe", ([("gpu0", lambda: 1234.5), ("cpu0", lambda: 88.0)], []))
    text = ServerMetrics("decode").render().decode()
    assert 'disagg_energy_joules_total{device="gpu0"} 1234.5' in text
    assert 'disagg_energy_joules_total{device="cpu0"} 88.0' in text
    snap = energy.snapshot()
    assert snap["joules"] == {"gpu0": 1234.5, "cpu0": 88.0} and snap["reason"] is None


def test_the_dashboard_shows_the_last_report(peer_run, monkeypatch):
    """The web interface's dashboard (Streamlit's AppTest) reads --out's bench.json: every metric with its value,
    the peer's comparison. (tests/test_webui_browser.py sees it in a real browser.)"""
    from streamlit.testing.v1 import AppTest

    from disaggregated_inference.bench.table import fmt
    from .fakes import FakeGradingClient

    report, out, _ = peer_run
    monkeypatch.setenv("DISAGG_BENCH_OUT", str(out))
    at = AppTest.from_file(str(ROOT / "disaggregated_inference" / "webui" / "dashboard.py"), default_timeout=60)
    at.session_state["client"] = FakeGradingClient()
    at.run()
    assert not at.exception
    assert any(h.value == "Last bench report" for h in at.header)
    tables = [t.value for t in at.table]
    metrics = next(t for t in tables if "metric" in t.columns and "status" in t.columns)
    assert list(metrics["metric"]) == NAMES
    assert list(metrics["value"])[1].startswith(fmt(report["success_metrics"][1]["value"], "req/s"))
    assert any("gw" in t.columns for t in tables)  # the peer's comparison


@pytest.mark.slow
def test_chaos_on_a_local_cluster_measures_failover_and_the_errors_around_it(tmp_path):
    """``--local-cluster --chaos``: the bench starts its own servers (tiny models), kills the first prefill server a
    third into the load, starts it again; the failover time and the window's error rate are in the report."""
    from .conftest import tiny_config_dict

    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(tiny_config_dict()))
    rc = _bench("--config", config, "--local-cluster", "--workload", "chat", "--duration", 6, "--concurrency", 2,
                "--max-tokens", 4, "--chaos", "--chaos-down", 1, "--efficiency-groups", 0, "--timeout", 300,
                "--out", tmp_path / "o")
    assert rc == 0
    report = json.loads((tmp_path / "o" / "bench.json").read_text())
    failover = report["failover"]
    assert failover["server"] == "local-prefill-qwen" and failover["model"] == "qwen"
    assert failover["stopped_after_s"] < failover["restarted_after_s"] < failover["healthy_after_s"]
    row = _rows(report["success_metrics"])["failover_time_s"]
    assert row["value"] is not None and row["value"] > 0, row
    assert failover["window_requests"] > 0
    assert failover["window_error_rate"] == pytest.approx(failover["window_failed"] / failover["window_requests"])
    _check_table(report["success_metrics"])
