"""How server processes are started (``launch.py``): the command, its environment, glibc's copy tunable."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from disaggregated_inference import config as cluster_config
from disaggregated_inference import tuning
from disaggregated_inference.ops import launch
from disaggregated_inference.errors import ConfigError
from disaggregated_inference.server.settings import ServerSettings, from_cluster

SETTING = f"{tuning.NON_TEMPORAL}=262144"


@pytest.fixture
def glibc_x86(monkeypatch):
    monkeypatch.setattr(tuning, "glibc_on_x86", lambda: True)


def test_the_copy_tunable_is_added_to_the_environment(glibc_x86):
    env = tuning.with_copy_tunable({"PATH": "/bin"}, 256 << 10)
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": SETTING}


def test_other_tunables_are_kept(glibc_x86):
    env = tuning.with_copy_tunable({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, 256 << 10)
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.hugetlb=1:{SETTING}"


def test_the_operators_own_threshold_wins(glibc_x86):
    mine = {"GLIBC_TUNABLES": f"{tuning.NON_TEMPORAL}=0x100000"}
    assert tuning.with_copy_tunable(mine, 256 << 10) == mine


def test_nothing_is_set_for_zero_or_off_glibc_x86(monkeypatch):
    monkeypatch.setattr(tuning, "glibc_on_x86", lambda: True)
    assert tuning.with_copy_tunable({}, 0) == {}
    monkeypatch.setattr(tuning, "glibc_on_x86", lambda: False)  # macOS, ARM, musl
    assert tuning.with_copy_tunable({}, 256 << 10) == {}


def test_the_threshold_in_effect_is_read_back():
    assert tuning.copy_tunable_in_effect({"GLIBC_TUNABLES": f"glibc.malloc.hugetlb=1:{SETTING}"}) == 256 << 10
    assert tuning.copy_tunable_in_effect({"GLIBC_TUNABLES": f"{tuning.NON_TEMPORAL}=0x40000"}) == 256 << 10
    assert tuning.copy_tunable_in_effect({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}) is None
    assert tuning.copy_tunable_in_effect({}) is None


def _dynamic_loader() -> str | None:
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "/ld-linux-x86-64.so" in path:
                return path
    return None


@pytest.mark.skipif(not tuning.glibc_on_x86(), reason="the tunable exists in glibc on x86-64 only")
def test_glibc_takes_the_threshold_from_the_environment_we_build():
    """The dynamic loader itself reports the tunable's value for a process started with our environment."""
    loader = _dynamic_loader()
    assert loader, "a glibc x86-64 Python maps ld-linux-x86-64.so"
    env = tuning.with_copy_tunable({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, 256 << 10)
    out = subprocess.run([loader, "--list-tunables"], env=env, capture_output=True, text=True, check=True).stdout
    line = next(item for item in out.splitlines() if item.startswith(tuning.NON_TEMPORAL + ":"))
    assert line.split()[1] == hex(256 << 10)
    default = subprocess.run([loader, "--list-tunables"], env={}, capture_output=True, text=True, check=True).stdout
    assert f"{tuning.NON_TEMPORAL}: {hex(256 << 10)} " not in default  # glibc's own is sized from the L3 cache


def test_the_server_command_runs_gunicorn_with_the_settings(glibc_x86):
    settings = ServerSettings(role="decode", name="decode-a", non_temporal_copy_bytes=1 << 20)
    cmd, env = launch.server_command(settings, "127.0.0.1:9001", {"HOME": "/home/x"})
    assert cmd == [sys.executable, "-m", "gunicorn", "-c", "python:disaggregated_inference.server.gunicorn_conf"]
    assert env["HOME"] == "/home/x" and env["DISAGG_BIND"] == "127.0.0.1:9001"
    assert env["DISAGG_PROC_NAME"] == "disagg-decode-a"
    assert json.loads(env["DISAGG_SERVER_SETTINGS"])["role"] == "decode"
    assert env["GLIBC_TUNABLES"] == f"{tuning.NON_TEMPORAL}={1 << 20}"


def _config(**server):
    return {"server": server, "prefill_servers": [{"host": "127.0.0.1", "port": 8000, "model": "smollm2"}],
            "decode_servers": [{"host": "127.0.0.1", "port": 8001, "model": "smollm2"}],
            "models": {"smollm2": {}}}


def test_the_config_sets_the_threshold_and_checks_it():
    cfg = cluster_config.from_dict(_config())
    assert from_cluster(cfg, cfg.prefill_servers[0].name).non_temporal_copy_bytes == 256 << 10
    cfg = cluster_config.from_dict(_config(non_temporal_copy_bytes=0))
    assert from_cluster(cfg, cfg.decode_servers[0].name).non_temporal_copy_bytes == 0
    for wrong in (4096, -1):
        with pytest.raises(ConfigError) as err:
            cluster_config.from_dict(_config(non_temporal_copy_bytes=wrong))
        assert err.value.field == "server.non_temporal_copy_bytes" and "16448" in str(err.value)


@pytest.mark.parametrize("from_environment", [None, "env-token"])
def test_disagg_serve_takes_the_api_token_from_the_environment_over_the_config(
        tmp_path, monkeypatch, from_environment):
    from disaggregated_inference.ops import cli

    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(_config(api_token="config-token")))
    name = cluster_config.from_dict(_config()).prefill_servers[0].name
    monkeypatch.delenv("DISAGG_API_TOKEN", raising=False)
    if from_environment:
        monkeypatch.setenv("DISAGG_API_TOKEN", from_environment)
    started = []

    def execvpe(file, argv, env):  # the real one would replace this process with gunicorn
        started.append(env)
        raise SystemExit(0)

    monkeypatch.setattr(cli.os, "execvpe", execvpe)
    with pytest.raises(SystemExit):
        cli.main(["serve", "--server", name, "--config", str(path)])
    settings = json.loads(started[0]["DISAGG_SERVER_SETTINGS"])
    assert settings["api_token"] == (from_environment or "config-token")


def _cohosted(hosts, n_threads, backend="llama_cpp", **server):
    model = {"backend": backend, **({"n_threads": n_threads} if n_threads else {})}
    return cluster_config.from_dict({
        "prefill_servers": [{"host": hosts[0], "port": 8000, "model": "m"}],
        "decode_servers": [{"host": hosts[1], "port": 8001, "model": "m"}],
        "models": {"m": model}, "server": server})


@pytest.mark.parametrize("hosts, n_threads, backend, expected", [
    (("127.0.0.1", "localhost"), 2, "llama_cpp", "spin"),     # 4 threads on 4 cores
    (("127.0.0.1", "localhost"), 3, "llama_cpp", "sleep"),    # 6 threads on 4 cores: loopback names are one machine
    (("10.0.0.1", "10.0.0.2"), 3, "llama_cpp", "spin"),       # 3 on each of two machines
    (("127.0.0.1", "127.0.0.1"), 3, "ollama", "spin"),        # no llama.cpp threads in these processes
    (("127.0.0.1", "127.0.0.1"), 2, "transformers", "spin"),  # torch's threads are an OpenMP team too: 4 on 4
    (("127.0.0.1", "127.0.0.1"), 3, "transformers", "sleep"),
    (("127.0.0.1", "127.0.0.1"), None, "transformers", "sleep"),  # torch's default: every core, in each server
])
def test_openmp_wait_auto_without_shared_cores_sleeps_only_when_a_machines_servers_oversubscribe_it(
        monkeypatch, hosts, n_threads, backend, expected):
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    cfg = _cohosted(hosts, n_threads, backend, share_cores=False)
    for entry in (*cfg.prefill_servers, *cfg.decode_servers):
        settings = from_cluster(cfg, entry.name)
        assert settings.openmp_wait == expected and settings.core_group == ""


@pytest.mark.parametrize("hosts, n_threads, backend, expected, shared", [
    (("127.0.0.1", "localhost"), 3, "llama_cpp", "spin", True),      # 6 threads on 4 cores, shared at run time
    (("10.0.0.1", "10.0.0.2"), 3, "llama_cpp", "spin", True),        # one per machine: a group of one each
    (("127.0.0.1", "127.0.0.1"), 3, "transformers", "sleep", False),  # torch takes no share: counted as before
    (("127.0.0.1", "127.0.0.1"), 3, "ollama", "spin", False),        # nothing to share
])
def test_openmp_wait_auto_spins_where_the_cores_are_shared(monkeypatch, hosts, n_threads, backend, expected, shared):
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    cfg = _cohosted(hosts, n_threads, backend)
    groups = set()
    for entry in (*cfg.prefill_servers, *cfg.decode_servers):
        settings = from_cluster(cfg, entry.name)
        assert settings.openmp_wait == expected and bool(settings.core_group) == shared
        groups.add(settings.core_group)
    if shared:  # the servers of one machine are one group; two machines, two
        assert len(groups) == (1 if hosts[0] in ("127.0.0.1", "localhost") and hosts[1] in ("127.0.0.1", "localhost")
                               else 2)


def test_a_transformers_server_on_the_machine_keeps_the_llama_servers_from_sharing(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    cfg = cluster_config.from_dict({
        "prefill_servers": [{"host": "127.0.0.1", "port": 8000, "model": "torch"}],
        "decode_servers": [{"host": "127.0.0.1", "port": 8001, "model": "llama"}],
        "models": {"torch": {"backend": "transformers", "n_threads": 2},
                   "llama": {"backend": "llama_cpp", "n_threads": 3}}})
    decode = from_cluster(cfg, cfg.decode_servers[0].name)
    assert decode.core_group == "" and decode.openmp_wait == "sleep"  # 5 threads on 4 cores, unshared


def test_each_local_cluster_is_a_group_of_its_own(monkeypatch):
    from disaggregated_inference.ops import cluster

    monkeypatch.setattr(cluster.ServerProcess, "start", lambda self, extra_env=None: self.sock.close())
    data = {"prefill_servers": [{"name": "p", "host": "127.0.0.1", "port": 8000, "model": "m"}],
            "decode_servers": [{"name": "d", "host": "127.0.0.1", "port": 8001, "model": "m"}],
            "models": {"m": {"backend": "llama_cpp", "n_threads": 2}}}
    groups = []
    for _ in range(2):
        with cluster.LocalCluster(data, free_ports=True) as local:
            groups.append({p.settings.core_group for p in local.processes})
    assert all(len(g) == 1 and next(iter(g)) for g in groups)  # both servers of a cluster in one group
    assert groups[0] != groups[1]  # and two clusters on one machine in two


def test_openmp_wait_forced_values_and_a_wrong_one():
    for forced in ("spin", "sleep"):
        cfg = cluster_config.from_dict(_config(openmp_wait=forced))
        assert from_cluster(cfg, cfg.decode_servers[0].name).openmp_wait == forced
    with pytest.raises(ConfigError) as err:
        cluster_config.from_dict(_config(openmp_wait="sometimes"))
    assert err.value.field == "server.openmp_wait" and "auto, spin, sleep" in str(err.value)


def test_the_server_command_sets_the_wait_policy_and_the_operators_own_wins():
    sleep, spin = ServerSettings(name="a", openmp_wait="sleep"), ServerSettings(name="a", openmp_wait="spin")
    shared = ServerSettings(name="a", openmp_wait="spin", core_group="g")
    assert launch.server_command(sleep, "127.0.0.1:9001", {})[1]["OMP_WAIT_POLICY"] == "PASSIVE"
    assert not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(launch.server_command(spin, "127.0.0.1:9001", {})[1])
    env = launch.server_command(shared, "127.0.0.1:9001", {})[1]
    assert env["GOMP_SPINCOUNT"] == str(tuning.SHARED_SPIN_COUNT) and "OMP_WAIT_POLICY" not in env
    own = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert launch.server_command(sleep, "127.0.0.1:9001", own)[1]["OMP_WAIT_POLICY"] == "ACTIVE"
    own = {"GOMP_SPINCOUNT": "50000"}
    assert launch.server_command(shared, "127.0.0.1:9001", own)[1]["GOMP_SPINCOUNT"] == "50000"


@pytest.mark.parametrize("library", ["llama_cpp", pytest.param("torch", marks=pytest.mark.slow)])  # torch: ~8 s to load
@pytest.mark.parametrize("policy, group, spins", [
    ("sleep", "", 0), ("spin", "", 300_000), ("spin", "g", tuning.SHARED_SPIN_COUNT)])
def test_openmp_reads_the_policy_from_the_environment_we_build(policy, group, spins, library):
    """libgomp reads its settings when llama.cpp (or torch, with its own libgomp) loads: ask it what it
    took (OMP_DISPLAY_ENV): the spin rounds at a barrier are 0 (sleep), its default, or the bounded count
    of shared cores."""
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"{library} is not installed")
    settings = ServerSettings(name="a", openmp_wait=policy, core_group=group)
    _, env = launch.server_command(settings, "127.0.0.1:9001",
                                   {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))})
    env["OMP_DISPLAY_ENV"] = "VERBOSE"
    shown = subprocess.run([sys.executable, "-c", f"import {library}"], env=env, capture_output=True, text=True,
                           timeout=120).stderr
    line = next((ln for ln in shown.splitlines() if "GOMP_SPINCOUNT" in ln), None)
    if line is None:
        pytest.skip(f"this {library} build does not use GNU OpenMP")
    assert int(line.split("=", 1)[1].strip(" '")) == spins, line


def test_a_prefill_server_loads_its_model_without_speculation():
    # a prefill server never samples: no proposer, no step cost measured at load; a decode server keeps
    # the model's setting (ngram by default), and /health reports each as loaded
    data = _config()
    data["models"]["smollm2"] = {"backend": "llama_cpp", "model": "smollm2"}
    cfg = cluster_config.from_dict(data)
    prefill = from_cluster(cfg, cfg.prefill_servers[0].name)
    decode = from_cluster(cfg, cfg.decode_servers[0].name)
    assert prefill.model.speculation == decode.model.speculation == "ngram"
    assert prefill.engine_model.speculation == "off" and decode.engine_model.speculation == "ngram"
    assert prefill.engine_model.draft_max == prefill.model.draft_max  # the step's room is the same
    assert decode.engine_model is decode.model
