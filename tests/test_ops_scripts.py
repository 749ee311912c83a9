"""The operations kit: scripts/*.sh, check_status.py, test_system.py, deploy/config.production.json.

Everything runs on loopback. "Remote" hosts are 127.0.0.2 with ssh pointed at a closed port,
so an unreachable machine is simulated without touching the network; real ssh, rsync,
systemctl and launchctl are never run (dry runs, or stand-ins on PATH that record calls).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests

from disaggregated_inference import config as cluster_config
from disaggregated_inference import tuning

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
PRODUCTION = ROOT / "deploy" / "config.production.json"
SHELL_SCRIPTS = ["deploy.sh", "start_prefill_servers.sh", "start_decode_servers.sh", "stop_all.sh",
                 "monitor_logs.sh"]
PY_SCRIPTS = ["check_status.py", "test_system.py"]
# The only addresses the seeds (the user's design documents) give the production machines.
SEED_ADDRESSES = {"169.254.150.101", "169.254.150.102", "169.254.150.103", "169.254.150.104",
                  "192.168.100.1", "192.168.100.2"}


def closed_port() -> int:
    """A loopback port nothing listens on (bound to port 0, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(script: str, *args, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    path = SCRIPTS / script
    cmd = [sys.executable, str(path)] if script.endswith(".py") else ["bash", str(path)]
    full_env = {**os.environ, "DISAGG_PYTHON": sys.executable, **(env or {})}
    full_env.pop("DISAGG_CONFIG", None)
    full_env.pop("TMUX", None)
    return subprocess.run(cmd + [str(a) for a in args], capture_output=True, text=True, env=full_env,
                          timeout=timeout, cwd=ROOT)


def write_config(tmp_path: Path, data: dict, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data, indent=2))
    return path


def unreachable_env(tmp_path: Path) -> dict:
    """ssh to a closed loopback port (fails at once); no ~/.ssh/config."""
    return {"DISAGG_SSH_OPTS": f"-F /dev/null -p {closed_port()}", "DISAGG_SSH_TIMEOUT": "3"}


def recording_path(tmp_path: Path, *tools: str) -> tuple[dict, Path]:
    """Stand-ins for `tools` first on PATH; each call is appended to calls.log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "calls.log"
    for tool in tools:
        exe = bin_dir / tool
        exe.write_text(f'#!/bin/sh\necho "{tool} $*" >> "{log}"\nexit 0\n')
        exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}, log


SMALL_MODEL = {"qwen": {"aliases": ["qwen3-coder:30b"], "backend": "llama_cpp", "model": "smollm2",
                        "n_ctx": 512, "n_threads": 1}}


def remote_config(role: str = "prefill") -> dict:
    server = {"name": f"far-{role}", "host": "127.0.0.2", "port": 8000, "model": "qwen"}
    return {"models": SMALL_MODEL, "prefill_servers": [server] if role == "prefill" else [],
            "decode_servers": [server] if role == "decode" else []}


# -- every script -------------------------------------------------------------------------------


@pytest.mark.parametrize("script", SHELL_SCRIPTS + PY_SCRIPTS)
def test_every_script_has_help_that_names_the_config_option(script):
    result = run(script, "--help", timeout=60)
    assert result.returncode == 0, result.stderr
    assert "usage" in result.stdout.lower()
    assert "--config" in result.stdout


@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_shell_scripts_refuse_unknown_options_and_missing_configs(script, tmp_path):
    result = run(script, "--no-such-option")
    assert result.returncode == 2
    assert "--no-such-option" in result.stderr
    result = run(script, "--config", tmp_path / "missing.json")
    assert result.returncode == 2
    assert "missing.json" in result.stderr


def test_a_bad_config_is_reported_with_its_key(tmp_path):
    bad = write_config(tmp_path, {"prefill_servers": [{"host": "127.0.0.1", "port": 70000, "model": "qwen"}],
                                  "decode_servers": []})
    for script in ("start_prefill_servers.sh", "check_status.py"):
        result = run(script, "--config", bad)
        assert result.returncode == 2, script
        assert "prefill_servers[0].port" in result.stderr, script


# -- the production config ----------------------------------------------------------------------


def test_production_config_loads_and_pairs_the_machines_as_the_seeds_do():
    cfg = cluster_config.load(PRODUCTION)
    pairs = {}
    for server in cfg.servers:
        pairs.setdefault(server.model, {})[server.role] = server
    qwen, gpt = pairs["qwen"], pairs["gpt-oss"]
    assert (qwen["prefill"].address, qwen["decode"].address) == ("169.254.150.103:8000", "169.254.150.102:8001")
    assert (gpt["prefill"].address, gpt["decode"].address) == ("169.254.150.104:8000", "169.254.150.101:8001")
    assert qwen["prefill"].data_url == "http://192.168.100.1:8000"
    assert gpt["prefill"].data_url == "http://192.168.100.2:8000"
    assert all(s.data_url is None for s in cfg.decode_servers)

    assert cfg.resolve_model("qwen3-coder:30b") == "qwen" and cfg.resolve_model("gpt-oss:120b") == "gpt-oss"
    assert qwen["decode"].settings == {"backend": "llama_cpp", "model": "ollama:qwen3-coder:30b", "n_ctx": 32768,
                                       "n_gpu_layers": -1, "flash_attn": True}
    assert gpt["decode"].settings["model"] == "ollama:gpt-oss:120b" and gpt["decode"].settings["n_ctx"] == 8192
    # both sides of a pair load the same model the same way (the fingerprint check insists)
    for pair in pairs.values():
        assert pair["prefill"].settings == pair["decode"].settings
    assert (cfg.client["prefill_timeout"], cfg.client["decode_timeout"]) == (60, 180)


def test_production_config_uses_only_the_seeds_addresses():
    from urllib.parse import urlsplit

    cfg = cluster_config.load(PRODUCTION)
    hosts = {s.host for s in cfg.servers} | {urlsplit(s.data_url).hostname for s in cfg.servers if s.data_url}
    assert hosts <= SEED_ADDRESSES


# -- deploy.sh ----------------------------------------------------------------------------------


def test_deploy_dry_run_prints_rsync_and_install_per_host_and_runs_nothing(tmp_path):
    env, calls = recording_path(tmp_path, "ssh", "rsync")
    result = run("deploy.sh", "--dry-run", "--config", PRODUCTION, "--ssh-user", "ops", env=env)
    assert result.returncode == 0, result.stderr
    assert not calls.exists(), f"a dry run ran {calls.read_text()}"
    lines = result.stdout.splitlines()
    for host, flags in [("169.254.150.103", "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90"),
                        ("169.254.150.104", "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90"),
                        ("169.254.150.101", "-DGGML_METAL=on"), ("169.254.150.102", "-DGGML_METAL=on")]:
        rsync = [line for line in lines if line.startswith("+ rsync ") and f"ops@{host}:" in line]
        assert len(rsync) == 1, result.stdout
        assert "--delete" in rsync[0] and "--exclude=.venv/" in rsync[0]
        assert rsync[0].endswith(f"ops@{host}:/opt/disaggregated-inference/")
        install = [line for line in lines if line.startswith("+ ssh ") and f"ops@{host} " in line
                   and "bash scripts/install.sh" in line]
        assert len(install) == 1, result.stdout
        assert flags in install[0]


def test_deploy_build_flags_and_remote_dir_can_be_overridden(tmp_path):
    result = run("deploy.sh", "-n", "--config", PRODUCTION, "--only", "dgx1-prefill-qwen",
                 "--prefill-cmake-args", "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=121",
                 "--remote-dir", "/srv/disagg", "--install-config")
    assert result.returncode == 0, result.stderr
    assert "CMAKE_CUDA_ARCHITECTURES=121" in result.stdout
    assert "169.254.150.103:/srv/disagg/" in result.stdout
    assert "/etc/disaggregated-inference/config.json" in result.stdout
    assert "169.254.150.101" not in result.stdout  # --only: that server's host alone


def test_deploy_skips_loopback_servers_and_says_so(tmp_path):
    cfg = write_config(tmp_path, {"models": SMALL_MODEL, "decode_servers": [],
                                  "prefill_servers": [{"name": "here", "host": "127.0.0.1", "port": 8000,
                                                       "model": "qwen"}]})
    result = run("deploy.sh", "--config", cfg)
    assert result.returncode == 0, result.stderr
    assert "skipping servers on loopback" in result.stderr and "here" in result.stderr
    assert "nothing to deploy" in result.stderr


def test_deploy_names_the_unreachable_host_and_copies_nothing(tmp_path):
    env, calls = recording_path(tmp_path, "rsync")  # rsync must exist here; it must not be called
    cfg = write_config(tmp_path, remote_config("decode"))
    result = run("deploy.sh", "--config", cfg, env={**env, **unreachable_env(tmp_path)})
    assert result.returncode == 1
    assert "cannot reach 127.0.0.2" in result.stderr and "far-decode" in result.stderr
    assert not calls.exists()


# -- start / stop scripts: dry runs and unreachable machines ------------------------------------


def test_start_and_stop_dry_runs_use_systemd_on_the_dgx_and_launchd_on_the_macs():
    prefill = run("start_prefill_servers.sh", "-n", "--config", PRODUCTION)
    assert prefill.returncode == 0, prefill.stderr
    assert "sudo -n systemctl start disagg-prefill@dgx1-prefill-qwen.service" in prefill.stdout
    assert "sudo -n systemctl start disagg-prefill@dgx2-prefill-gpt-oss.service" in prefill.stdout
    decode = run("start_decode_servers.sh", "-n", "--config", PRODUCTION)
    assert decode.returncode == 0, decode.stderr
    assert "launchctl kickstart system/com.disaggregated-inference.decode.mac2-decode-qwen" in decode.stdout
    assert "launchctl kickstart system/com.disaggregated-inference.decode.mac1-decode-gpt-oss" in decode.stdout
    stop = run("stop_all.sh", "-n", "--config", PRODUCTION)
    assert stop.returncode == 0, stop.stderr
    assert "systemctl stop disagg-prefill@dgx1-prefill-qwen.service" in stop.stdout
    assert "launchctl bootout system/com.disaggregated-inference.decode.mac1-decode-gpt-oss" in stop.stdout
    # decode servers are stopped before the prefill servers they fetch from
    assert stop.stdout.index("mac2-decode-qwen") < stop.stdout.index("dgx1-prefill-qwen")
    forced = run("start_decode_servers.sh", "-n", "--config", PRODUCTION, "--manager", "systemd")
    assert "systemctl start disagg-decode@mac2-decode-qwen.service" in forced.stdout


@pytest.mark.parametrize("script,role", [("start_prefill_servers.sh", "prefill"),
                                         ("start_decode_servers.sh", "decode"),
                                         ("stop_all.sh", "prefill"), ("monitor_logs.sh", "decode")])
def test_scripts_name_the_server_whose_machine_is_unreachable(script, role, tmp_path):
    cfg = write_config(tmp_path, remote_config(role))
    extra = ["--no-attach"] if script == "monitor_logs.sh" else ["--run-dir", tmp_path / "run"]
    result = run(script, "--config", cfg, *extra, env=unreachable_env(tmp_path))
    assert result.returncode == 1
    assert f"cannot reach 127.0.0.2 over ssh (server far-{role})" in result.stderr


def test_start_dry_run_of_a_local_server_prints_the_serve_command(tmp_path):
    cfg = write_config(tmp_path, {"models": SMALL_MODEL, "decode_servers": [],
                                  "prefill_servers": [{"name": "p1", "host": "127.0.0.1", "port": 8000,
                                                       "model": "qwen"}]})
    result = run("start_prefill_servers.sh", "-n", "--config", cfg, "--run-dir", tmp_path / "run")
    assert result.returncode == 0, result.stderr
    assert "-m disaggregated_inference serve --config" in result.stdout and "--server p1" in result.stdout
    assert str(tmp_path / "run" / "p1.pid") in result.stdout
    assert not (tmp_path / "run").exists()


def test_start_refuses_a_port_another_program_holds(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        cfg = write_config(tmp_path, {"models": SMALL_MODEL, "prefill_servers": [],
                                      "decode_servers": [{"name": "d1", "host": "127.0.0.1", "port": port,
                                                          "model": "qwen"}]})
        result = run("start_decode_servers.sh", "--config", cfg, "--run-dir", tmp_path / "run")
    assert result.returncode == 1
    assert f"127.0.0.1:{port} is not free" in result.stderr and "d1" in result.stderr
    assert not (tmp_path / "run" / "d1.pid").exists()


def test_stop_all_never_signals_a_process_it_did_not_start(tmp_path):
    """A pid file whose PID now belongs to another process is removed, the process left alone."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = write_config(tmp_path, {"models": SMALL_MODEL, "decode_servers": [],
                                  "prefill_servers": [{"name": "p1", "host": "127.0.0.1", "port": 8000,
                                                       "model": "qwen"}]})
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        created = psutil.Process(bystander.pid).create_time()
        (run_dir / "p1.pid").write_text(f"{bystander.pid} {created - 100:.3f}\n")  # same PID, other process
        (run_dir / "stray.pid").write_text(f"{bystander.pid} {created - 50:.3f}\n")
        result = run("stop_all.sh", "--config", cfg, "--run-dir", run_dir, "--all-local")
        assert result.returncode == 0, result.stderr
        assert "stale pid file removed" in result.stderr
        assert not (run_dir / "p1.pid").exists() and not (run_dir / "stray.pid").exists()
        assert bystander.poll() is None, "stop_all.sh signalled a process it did not start"
    finally:
        bystander.kill()
        bystander.wait(10)


# -- monitor_logs.sh ----------------------------------------------------------------------------


def test_monitor_logs_dry_run_follows_local_logs_and_remote_journals(tmp_path):
    local = write_config(tmp_path, {"models": SMALL_MODEL, "decode_servers": [],
                                    "prefill_servers": [{"name": "p1", "host": "127.0.0.1", "port": 8000,
                                                         "model": "qwen"}]})
    result = run("monitor_logs.sh", "-n", "--config", local, "--run-dir", tmp_path / "run")
    assert result.returncode == 0, result.stderr
    assert f"tail -n 200 -F {tmp_path / 'run' / 'p1.log'}" in result.stdout
    result = run("monitor_logs.sh", "-n", "--config", PRODUCTION)
    assert "journalctl -f -n 200 -u disagg-prefill@dgx1-prefill-qwen.service" in result.stdout
    assert "tail -n 200 -F /Library/Logs/disaggregated-inference/mac1-decode-gpt-oss.log" in result.stdout


def test_monitor_logs_says_clearly_when_tmux_is_missing(tmp_path):
    result = run("monitor_logs.sh", env={"DISAGG_TMUX": str(tmp_path / "no-tmux-here")})
    assert result.returncode == 1
    assert "tmux is not installed" in result.stderr


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux not installed")
def test_monitor_logs_opens_one_pane_per_server(tmp_path):
    socket_name = f"disagg-test-{os.getpid()}"
    servers = [{"name": f"p{i}", "host": "127.0.0.1", "port": 8000 + i, "model": "qwen"} for i in range(3)]
    cfg = write_config(tmp_path, {"models": SMALL_MODEL, "prefill_servers": servers[:2],
                                  "decode_servers": servers[2:]})
    try:
        result = run("monitor_logs.sh", "--config", cfg, "--socket", socket_name, "--session", "t", "--no-attach",
                     "--run-dir", tmp_path / "run")
        assert result.returncode == 0, result.stderr
        panes = subprocess.run(["tmux", "-L", socket_name, "list-panes", "-t", "t:logs", "-F", "#{pane_title}"],
                               capture_output=True, text=True, timeout=30)
        titles = panes.stdout.splitlines()
        assert len(titles) == 3, panes.stderr
        assert any("decode p2" in t for t in titles)
    finally:
        subprocess.run(["tmux", "-L", socket_name, "kill-server"], capture_output=True, timeout=30)


# -- check_status.py and test_system.py ---------------------------------------------------------


def test_check_status_flags_a_pair_whose_library_versions_differ():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import check_status
    finally:
        sys.path.remove(str(SCRIPTS))

    def row(name, model, version, blob, up=True):
        return {"name": name, "model": model, "up": up, "library_version": version,
                "model_file": f"/models/blobs/{blob}"}

    same = [row("p", "qwen", "0.3.36", "sha256-aa"), row("d", "qwen", "0.3.36", "sha256-aa")]
    assert check_status.pair_problems(same) == ([], [])
    errors, warnings = check_status.pair_problems(
        [row("p", "qwen", "0.3.36", "sha256-aa"), row("d", "qwen", "0.3.35", "sha256-bb"),
         row("x", "gpt-oss", "0.3.30", "sha256-cc", up=False)])
    assert len(errors) == 1 and "p: 0.3.36" in errors[0] and "d: 0.3.35" in errors[0]
    assert len(warnings) == 1 and "sha256-bb" in warnings[0]


def test_check_status_fails_naming_the_server_on_a_closed_port(tmp_path):
    cfg = write_config(tmp_path, {"models": SMALL_MODEL, "prefill_servers": [],
                                  "decode_servers": [{"name": "nobody-home", "host": "127.0.0.1",
                                                      "port": closed_port(), "model": "qwen"}]})
    result = run("check_status.py", "--config", cfg)
    assert result.returncode == 1
    assert "DOWN" in result.stdout
    assert "nobody-home" in result.stderr and "ConnectionError" in result.stderr


def test_test_system_fails_naming_the_server_on_a_closed_port(tmp_path):
    cfg = write_config(tmp_path, {"models": SMALL_MODEL, "prefill_servers": [],
                                  "decode_servers": [{"name": "nobody-home", "host": "127.0.0.1",
                                                      "port": closed_port(), "model": "qwen"}]})
    result = run("test_system.py", "--config", cfg)
    assert result.returncode == 1
    assert "FAIL" in result.stderr and "nobody-home" in result.stderr
    assert "generation not attempted" in result.stderr


@pytest.fixture
def cluster_file(tiny_cluster, tmp_path) -> Path:
    return write_config(tmp_path, tiny_cluster.config, "tiny_cluster.json")


@pytest.mark.slow
def test_check_status_reports_every_server_of_the_running_cluster(tiny_cluster, cluster_file):
    result = run("check_status.py", "--config", cluster_file)
    assert result.returncode == 0, result.stdout + result.stderr
    for proc in tiny_cluster.processes:
        assert proc.entry.name in result.stdout and proc.url in result.stdout
    rows = json.loads(run("check_status.py", "--config", cluster_file, "--json").stdout)
    assert {r["name"] for r in rows} == {p.entry.name for p in tiny_cluster.processes}
    for row in rows:
        assert row["status"] == "up" and row["loaded"] is True and row["backend"] == "llama_cpp"
        assert row["handoff"] == "llama_seq_state"
        assert row["rss_bytes"] > 0 and isinstance(row["latency_s"], float)
        assert (row["leases_held"] is not None) == (row["role"] == "prefill")


@pytest.mark.slow
def test_check_status_marks_only_the_dead_server_down(tiny_cluster, tmp_path):
    data = tiny_cluster.config
    data["decode_servers"].append({"name": "ghost-decode", "host": "127.0.0.1", "port": closed_port(),
                                   "model": "qwen"})
    result = run("check_status.py", "--config", write_config(tmp_path, data))
    assert result.returncode == 1
    assert "ghost-decode" in result.stderr
    down = [line for line in result.stdout.splitlines() if " DOWN " in line]
    assert len(down) == 1 and down[0].startswith("ghost-decode")


@pytest.mark.slow
def test_test_system_passes_on_the_running_cluster_with_a_real_kv_handoff(tiny_cluster, cluster_file):
    result = run("test_system.py", "--config", cluster_file, "--max-tokens", "8", "--json", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert all(r["up"] for r in report["health"])
    assert {r["model"] for r in report["results"]} == {"qwen", "gpt-oss"}
    for r in report["results"]:
        assert r["passed"] and r["method"] == "kv_handoff" and r["text"].strip()
        assert r["kv_bytes"] > 0
    assert "PASS" in result.stderr


# -- starting and stopping a real local server --------------------------------------------------


def _ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow
def test_start_check_and_stop_one_local_server(tmp_path):
    run_dir = tmp_path / "run"
    port = closed_port()
    cfg = write_config(tmp_path, {
        "models": SMALL_MODEL, "decode_servers": [],
        "prefill_servers": [{"name": "ops-test-prefill", "host": "127.0.0.1", "port": port, "model": "qwen"}]})
    pidfile = run_dir / "ops-test-prefill.pid"
    try:
        started = run("start_prefill_servers.sh", "--config", cfg, "--run-dir", run_dir, "--timeout", "240",
                      timeout=300)
        assert started.returncode == 0, started.stderr
        assert pidfile.exists() and (run_dir / "ops-test-prefill.log").exists()
        pid = int(pidfile.read_text().split()[0])
        family = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)

        status = run("check_status.py", "--config", cfg)
        assert status.returncode == 0, status.stdout + status.stderr
        assert "ops-test-prefill" in status.stdout and " up " in status.stdout
        # started by `disagg serve`, as the systemd unit does, with glibc's copy threshold (launch.py)
        health = requests.get(f"http://127.0.0.1:{port}/health", timeout=10).json()
        assert health["non_temporal_copy_bytes"] == (256 << 10 if tuning.glibc_on_x86() else None)

        again = run("start_prefill_servers.sh", "--config", cfg, "--run-dir", run_dir)
        assert again.returncode == 0 and f"already running (pid {pid})" in again.stderr

        stopped = run("stop_all.sh", "--config", cfg, "--run-dir", run_dir)
        assert stopped.returncode == 0, stopped.stderr
        assert f"stopped pid {pid}" in stopped.stderr
        assert not pidfile.exists()
        deadline = time.monotonic() + 10
        while not all(_ended(p.pid) for p in family) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(_ended(p.pid) for p in family)
        assert run("check_status.py", "--config", cfg).returncode == 1
    finally:
        if pidfile.exists():  # the test failed half-way: end the server it started, and only that
            run("stop_all.sh", "--config", cfg, "--run-dir", run_dir, "--timeout", "5")


@pytest.mark.slow
def test_start_reports_a_server_that_cannot_load_its_model(tmp_path):
    """A model that cannot load makes the start script fail fast with the log's last lines."""
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path, {
        "models": {"qwen": {"backend": "llama_cpp", "model": str(tmp_path / "no-such-model.gguf")}},
        "decode_servers": [],
        "prefill_servers": [{"name": "broken", "host": "127.0.0.1", "port": closed_port(), "model": "qwen"}]})
    try:
        result = run("start_prefill_servers.sh", "--config", cfg, "--run-dir", run_dir, "--timeout", "120",
                     timeout=180)
        assert result.returncode == 1
        assert "broken" in result.stderr and "no-such-model.gguf" in result.stderr
    finally:
        run("stop_all.sh", "--config", cfg, "--run-dir", run_dir, "--timeout", "5")
