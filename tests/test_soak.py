"""The soak (benchmarks/soak.py, disaggregated_inference/bench/soak*.py, faults.py, netns.py).

The figures' definitions are checked on recorded requests whose outcome is known (fast); a short soak on
tiny models, with a SIGKILL and a SIGSTOP, is checked against the requests it really sent, counted where
they leave the load generator (slow: a cluster of eight servers and a gateway); the link faults run on
the namespaced data path where root and iproute2 are there, and are skipped saying why where not.
"""
from __future__ import annotations

import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

from disaggregated_inference.bench import faults as soak_faults
from disaggregated_inference.bench import netns, soak, soak_figures
from disaggregated_inference.bench.load import PhaseResult, Sample, LoadShape
from disaggregated_inference.bench.measure import RequestTiming
from disaggregated_inference.bench.workloads import BenchRequest

ROOT = Path(__file__).resolve().parents[1]


# -- the definitions, on requests whose outcome is known -----------------------------------------------

def _sample(path: str, model: str, sent: float, end: float | None, *, error: str | None = None, pieces: int = 3,
            tokens: int = 3) -> Sample:
    s = Sample(BenchRequest(0, model, {"model": model}), path, model, 0, sent)
    if end is not None:
        t = RequestTiming(started=sent, error=error)
        if error is None:
            t.pieces = [sent + 0.01 * (i + 1) for i in range(pieces)]
            t.ended, t.output_tokens = end, tokens
        s.timing, s.finished = t, end
    return s


def _run(samples, faults, resources=(), recorded=None, **options) -> soak.SoakRun:
    opts = soak.SoakOptions(config=None, warmup_s=options.pop("warmup_s", 0.0), settle_s=1.0, **options)
    phase = PhaseResult("all", "all", 0, LoadShape(rate=1.0), 0.0, samples=list(samples))
    run = soak.SoakRun(opts, 0.0, 0.0, phases=[phase], faults=list(faults), samples=list(resources),
                       leases_at_end={"p1": 0, "p2": 0}, ended=100.0)
    run.outcomes_recorded = Counter(recorded or {id(s): 1 for s in samples})
    return run


def test_outcomes_windows_and_failover_as_defined():
    kill = soak_faults.Fault("kill_prefill", "p1", "qwen", start=10.0, end=12.0)
    gate = soak_faults.Fault("stop_gateway", "gateway", None, ("gateway",), start=30.0, end=33.0)
    skipped = soak_faults.Fault("link_cut", "link", "qwen", skipped="the link faults need root")
    samples = [
        _sample("client", "qwen", 1.0, 1.5),  # outside every window
        _sample("client", "qwen", 9.5, 11.0, error="UpstreamError: reset"),  # caught by the kill: inside
        _sample("client", "qwen", 10.2, 10.9),  # the first sent after the kill and answered: failover 0.9
        _sample("gateway", "qwen", 10.5, 11.4),  # the gateway path's first: 1.4
        _sample("client", "gpt-oss", 10.1, 10.3),  # another model: outside the kill's window
        _sample("client", "qwen", 12.5, 12.8),  # within settle_s after the end: inside
        _sample("client", "qwen", 20.0, 29.0, error="still running 30 s after the phase stopped sending (cut)"),
        _sample("gateway", "gpt-oss", 31.0, 34.0),  # sent during the gateway's stop: failover 4.0
        _sample("client", "gpt-oss", 31.0, 31.2),  # the client path: the gateway's fault does not touch it
        _sample("gateway", "qwen", 40.0, None),  # no outcome at all: lost
        _sample("gateway", "qwen", 11.0, 11.6, pieces=5, tokens=5),  # more pieces than the prompt's usual 3: duplicated
        _sample("client", "qwen", 60.0, 60.5, error="no piece streamed before the final line"),  # empty answer
    ]
    samples[-1].timing.ended = 60.5
    recorded = {id(s): 1 for s in samples}
    recorded[id(samples[0])] = 2  # one outcome recorded twice: duplicated
    report = soak_figures.build(_run(samples, [kill, gate, skipped], recorded=recorded))
    r = report["requests"]
    assert (r["sent"], r["answered"], r["failed"], r["lost"]) == (12, 9, 1, 2) and r["accounted"]
    assert r["duplicated"] == 2 and r["answered_empty"] == 1
    inside, outside = report["error_rate"]["inside_fault_windows"], report["error_rate"]["outside_fault_windows"]
    assert (inside["requests"], inside["failed"]) == (6, 1)  # 9.5, 10.2, 10.5, 11.0, 12.5 (qwen); 31.0 (gateway)
    assert (outside["requests"], outside["failed"]) == (6, 2) and outside["rate"] == pytest.approx(2 / 6, abs=1e-6)
    kill_row = report["faults"][0]
    assert kill_row["failover_s"] == {"qwen/client": pytest.approx(0.9), "qwen/gateway": pytest.approx(1.4)}
    assert report["failover_s"]["kill_prefill"] == {"p50": pytest.approx(1.15), "max": pytest.approx(1.4), "n": 2}
    # the only qwen request through the gateway after its stop was lost: no failover measured
    assert report["faults"][1]["failover_s"] == {"gpt-oss/gateway": pytest.approx(4.0), "qwen/gateway": None}
    assert report["faults_skipped"] == {"link_cut": "the link faults need root"}
    assert "link_cut" not in report["failover_s"]
    assert report["leases_held_at_end"] == 0
    assert len(report["outcomes"]) == 12 and sum(o["in_fault_window"] for o in report["outcomes"]) == 6
    assert [o["sent_s"] for o in report["outcomes"] if o["duplicated"]] == [1.0, 11.0]


def test_growth_is_a_slope_per_thousand_requests_over_one_process_after_warm_up():
    rows = []
    for k in range(10):  # 2 MiB and one open file more every 100 requests: 20 MiB and 10 files per 1,000
        rows.append({"t": float(k), "server": "d1", "role": "decode", "pid": 7, "requests_done": 100 * k,
                     "rss_bytes": (100 + 2 * k) << 20, "open_files": 20 + k, "threads": 8, "leases": None})
    for k in range(4):  # a restarted process: new figures, its own warm-up first (left out of the slope)
        rows.append({"t": 10.0 + k, "server": "d1", "role": "decode", "pid": 8, "requests_done": 1000 + 5 * k,
                     "rss_bytes": 50 << 20, "open_files": 3, "threads": 2, "leases": None})
    rows.append({"t": 3.0, "server": "p1", "role": "prefill", "pid": 9, "requests_done": 300, "rss_bytes": 1 << 20,
                 "open_files": 1, "threads": 1, "leases": 0})
    out = soak_figures.growth(rows, after=1.0, warmup=1.0)
    assert out["d1"]["samples"] == 9 and out["d1"]["requests"] == 800
    assert out["d1"]["rss_mib"] == pytest.approx(20.0) and out["d1"]["open_files"] == pytest.approx(10.0)
    assert out["d1"]["threads"] == pytest.approx(0.0)
    assert out["p1"]["rss_mib"] is None  # one sample: no slope


def test_schedule_takes_the_kinds_in_turn_after_the_warm_up_and_ends_before_the_load():
    opts = soak.SoakOptions(config=None, duration_s=100.0, warmup_s=10.0, fault_every_s=20.0, stop_s=3.0, link_s=2.0,
                            lease_s=5.0, settle_s=1.0, faults=("kill_prefill", "stop_decode"))
    assert soak.schedule(opts) == [(10.0, "kill_prefill"), (30.0, "stop_decode"), (50.0, "kill_prefill"),
                                   (70.0, "stop_decode")]  # 90 + 11 s of room would pass 100
    assert soak.schedule(soak.SoakOptions(config=None, faults=())) == []


def test_a_process_killed_between_poll_and_read_is_sampled_as_gone():
    """A fault may kill a server just after the sampler saw it alive: its zombie still has a /proc entry, with
    zero memory, and must read as no process rather than as one using nothing."""
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        read = soak._group_resources(alive.pid)
        assert read["rss_bytes"] > 0 and read["threads"] >= 1 and read["open_files"] >= 0
        alive.kill()
        for _ in range(100):  # not reaped: the kernel keeps a zombie
            if soak.psutil.Process(alive.pid).status() == soak.psutil.STATUS_ZOMBIE:
                break
            threading.Event().wait(0.02)
        assert soak._group_resources(alive.pid) == {}
    finally:
        alive.kill()
        alive.wait()
    assert soak._group_resources(alive.pid) == {}


def test_bad_options_are_named_before_anything_starts():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--faults", "kill_prefill,explode"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2 and "--faults" in done.stderr and "'explode'" in done.stderr
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--rate", "0"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2 and "--rate must be positive" in done.stderr
    from disaggregated_inference.errors import ConfigError

    with pytest.raises(ConfigError, match="--stop-seconds must be positive") as caught:
        soak.check_options(soak.SoakOptions(config=None, stop_s=0.0))
    assert caught.value.field == "--stop-seconds"


# -- real soaks on tiny models ---------------------------------------------------------------------------

def _options(faults, duration: float, use_link: bool, logs) -> soak.SoakOptions:
    sys.path.insert(0, str(ROOT))
    from benchmarks.soak import soak_config

    from disaggregated_inference import config as cluster_config

    return soak.SoakOptions(config=cluster_config.coerce(soak_config(None, True, 1.0)), duration_s=duration,
                            rate=1.0, max_tokens=8, faults=faults, fault_every_s=7.0, warmup_s=4.0, settle_s=3.0,
                            sample_every_s=1.0, stop_s=3.0, link_s=2.0, lease_s=4.0, grace_s=60.0,
                            fill_max=50, use_link=use_link, progress_every_s=60.0, startup_timeout_s=300.0,
                            log_dir=str(logs))


def _count_sends(monkeypatch) -> Counter:
    """Every request the soak's load really sends, counted as it leaves for the client or the gateway."""
    from disaggregated_inference.bench import endpoints

    sent, lock = Counter(), threading.Lock()
    for cls in (endpoints.ClientEndpoint, endpoints.HttpEndpoint):
        original = cls.stream

        def stream(self, request, _original=original):
            path = "client" if isinstance(self, endpoints.ClientEndpoint) else self.name  # gateway, gateway-ollama
            with lock:
                sent[(path, request.model)] += 1
            return _original(self, request)

        monkeypatch.setattr(cls, "stream", stream)
    return sent


@pytest.mark.slow
def test_soak_accounts_for_every_request_it_sent(monkeypatch, tmp_path):
    sent = _count_sends(monkeypatch)
    run = soak.run(_options(("kill_prefill", "stop_decode"), 24.0, use_link=False, logs=tmp_path), say=lambda m: None)
    report = soak_figures.build(run)
    r = report["requests"]
    assert report["complete"] and r["sent"] == sum(sent.values()) > 20
    assert {path for path, _ in sent} == {"client", "gateway", "gateway-ollama"}
    for (path, model), n in sent.items():
        assert sum(1 for o in report["outcomes"] if o["path"] == path and o["model"] == model) == n
    assert r["sent"] == r["answered"] + r["failed"] + r["lost"]
    assert r["lost"] == 0 and r["duplicated"] == 0
    kinds = {f["kind"]: f for f in report["faults"]}
    assert set(kinds) == {"kill_prefill", "stop_decode"}
    assert kinds["kill_prefill"]["detail"]["new_pid"] != kinds["kill_prefill"]["detail"]["pid"]  # restarted
    assert run.restarts == {kinds["kill_prefill"]["target"]: 1}
    for kind in kinds:
        assert 0 < report["failover_s"][kind]["p50"] <= report["failover_s"][kind]["max"] < 60
    assert report["leases_held_at_end"] == 0 and len(report["leases_at_end"]) == 4
    servers = {row["server"] for row in report["resources"]}
    assert len(servers) == 9 and all(row["rss_bytes"] for row in report["resources"] if row["pid"])
    assert report["link"]["skipped"]


@pytest.mark.slow
def test_link_faults_on_the_namespaced_data_path(monkeypatch, tmp_path):
    why = netns.unavailable()
    if why:
        pytest.skip(why)
    sent = _count_sends(monkeypatch)
    run = soak.run(_options(("link_cut", "link_slow"), 24.0, use_link=True, logs=tmp_path / "logs"), say=lambda m: None)
    report = soak_figures.build(run)
    assert report["link"] == {"used": True, "skipped": None}
    cut, slow = report["faults"]
    assert cut["kind"] == "link_cut" and slow["kind"] == "link_slow" and not report["faults_skipped"]
    assert cut["detail"]["mid_transfer"] and cut["detail"]["kv_bytes_in_flight_at_cut"] > 0
    assert slow["detail"]["rate_mbit"] == 100.0 and slow["duration_s"] >= 2.0
    for fault in (cut, slow):
        assert fault["model"] == "qwen" and all(v is not None for v in fault["failover_s"].values())
    r = report["requests"]
    assert r["sent"] == sum(sent.values()) == r["answered"] + r["failed"] + r["lost"] and r["lost"] == 0
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{netns.PREFIX}{__import__('os').getpid()}" not in listed  # the namespace went with the run
    assert soak_figures.draw(report, tmp_path / "soak.png") is None and (tmp_path / "soak.png").stat().st_size > 0


@pytest.mark.slow
def test_a_stop_signal_under_load_stops_every_server_and_reports_what_it_had():
    import json
    import os
    import signal

    import psutil

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--quick", "--duration", "120",
                             "--faults", "none", "--json", "--png", ""], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    loaded, lines = threading.Event(), []

    def read():
        for line in proc.stderr:
            lines.append(line)
            if " s: " in line and " sent, " in line:  # a progress line: the load is on
                loaded.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert loaded.wait(300), "".join(lines[-20:])
        servers = psutil.Process(proc.pid).children(recursive=True)
        assert len(servers) >= 9  # eight servers and the gateway (each a gunicorn master and its worker)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, "".join(lines[-20:])
    gone, alive = psutil.wait_procs(servers, timeout=10)
    assert not alive, [p.pid for p in alive]
    if netns.unavailable() is None:  # the namespace of the link went with it
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"{netns.PREFIX}{proc.pid}" not in listed
    report = json.loads(out)
    assert report["complete"] is False and "interrupted" in report["incomplete_reason"]
    r = report["requests"]
    assert r["sent"] > 0 and r["sent"] == r["answered"] + r["failed"] + r["lost"]
