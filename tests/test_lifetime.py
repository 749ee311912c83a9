"""Issue 42 §5: whatever stops a launcher (SIGTERM, SIGHUP, SIGINT), at any moment of its start-up, stops
the servers it started. Real launchers (``disagg up``, ``disagg demo``, the grader's and the web interface's
``--local-cluster``, a benchmark) in processes of their own, starting real gunicorn servers on the generated
tiny model; the signal goes to the launcher alone, as a process manager or a closed terminal sends it.
Every process that carries the run's mark in its environment must be gone afterwards, and the ports free.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from disaggregated_inference.ops import lifetime

from .conftest import ROOT, command_of, tiny_config_dict

MARK = "DISAGG_LIFETIME_TEST"


# -- the mechanism, in this process ---------------------------------------------------------------

@pytest.fixture(autouse=True)
def fresh_lifetime():
    """Each test of the mechanism starts with nothing installed (a session's cluster may hold the handlers
    meanwhile); what was there is put back after."""
    state = lifetime._State
    saved = (state.holders, state.previous, state.taken, {sig: signal.getsignal(sig) for sig in lifetime.STOP_SIGNALS})
    state.holders, state.previous, state.taken = 0, {}, None
    for sig in lifetime.STOP_SIGNALS:
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    yield
    state.holders, state.previous, state.taken = saved[:3]
    for sig, handler in saved[3].items():
        signal.signal(sig, handler)


def test_a_stop_signal_raises_once_and_the_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(lifetime.StopRequested) as caught:
        with lifetime.stop_on_signals():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # interrupted by the handler
            finally:
                os.kill(os.getpid(), signal.SIGHUP)  # a second signal during the stop is not another exception
                time.sleep(0.05)
    assert caught.value.signum == signal.SIGTERM and caught.value.exit_code == 143
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_signal_is_held_back_until_the_child_is_recorded():
    recorded = []
    with pytest.raises(lifetime.StopRequested):
        with lifetime.stop_on_signals():
            with lifetime.critical():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # not raised here ...
                recorded.append(lifetime.spawn([sys.executable, "-c", "pass"]))
            time.sleep(5)  # ... but at the end of the critical section
    assert recorded and recorded[0].wait(10) == 0  # and the child itself does not inherit the blocked signals


def test_a_stop_that_came_through_counts_once_also_inside_a_longer_holder():
    """A process that goes on after a stop (a test session, whose cluster holds the handlers) is stopped by the
    next signal too."""
    with lifetime.stop_on_signals(only_defaults=True):  # e.g. a session's LocalCluster
        for _ in range(2):
            with pytest.raises(lifetime.StopRequested):
                with lifetime.stop_on_signals():
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(5)


def test_an_ignored_signal_stays_ignored():
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup
    try:
        with lifetime.stop_on_signals():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_only_defaults_leaves_a_launchers_own_handler():
    own = lambda *_: None  # noqa: E731
    previous = signal.signal(signal.SIGTERM, own), signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        with lifetime.stop_on_signals(only_defaults=True):
            assert signal.getsignal(signal.SIGTERM) is own
            assert getattr(signal.getsignal(signal.SIGHUP), "__wrapped__", None) is lifetime._request_stop
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGHUP, previous[1])


# -- real launchers ------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_model_config(tmp_path: Path) -> tuple[Path, list[int]]:
    """One prefill and one decode server of the tiny "qwen" (and the gateway), on fixed free ports."""
    data = tiny_config_dict()
    data["models"] = {"qwen": data["models"]["qwen"]}
    ports = [_free_port() for _ in range(3)]
    data["prefill_servers"] = [{"name": "p-qwen", "host": "127.0.0.1", "port": ports[0], "model": "qwen"}]
    data["decode_servers"] = [{"name": "d-qwen", "host": "127.0.0.1", "port": ports[1], "model": "qwen"}]
    data["gateway"] = {**data.get("gateway", {}), "host": "127.0.0.1", "port": ports[2]}
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(data))
    return path, ports


def _marked(mark: str) -> list[psutil.Process]:
    """Live processes (not zombies) whose environment carries ``mark``: the launcher's descendants, wherever
    they were reparented to."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARK) == mark and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _servers(launcher: psutil.Process) -> list[psutil.Process]:
    try:
        return [c for c in launcher.children(recursive=True) if "gunicorn" in command_of(c)]
    except psutil.NoSuchProcess:  # the launcher itself ended
        return []


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return "?"


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _as_from_a_terminal() -> None:
    """The launcher's stop signals at their defaults, as a shell in a terminal starts a command (this test
    process may run with some ignored, and ignored dispositions are inherited)."""
    for sig in lifetime.STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


class Launcher:
    def __init__(self, args: list[str], log: Path, cwd: Path = ROOT):
        self.mark = uuid.uuid4().hex
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                   OMP_WAIT_POLICY="PASSIVE", **{MARK: self.mark})
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, *args], cwd=cwd, env=env, stdout=out,
                                         stderr=subprocess.STDOUT, preexec_fn=_as_from_a_terminal)
        self.ps = psutil.Process(self.proc.pid)
        # every process it starts, noted as it appears (gunicorn's process titles overwrite the environment
        # that carries the mark, so the mark alone would miss them)
        self.started: dict[int, psutil.Process] = {}
        self._watch = threading.Thread(target=self._note_children, daemon=True)
        self._watch.start()

    def _note_children(self) -> None:
        while self.proc.poll() is None:
            try:
                for child in self.ps.children(recursive=True):
                    self.started.setdefault(child.pid, child)
            except psutil.Error:
                pass
            time.sleep(0.02)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, condition, what: str, timeout: float = 240.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = condition()
            if value:
                return value
            if self.proc.poll() is not None:
                pytest.fail(f"the launcher exited ({self.proc.returncode}) before {what}:\n{self.text()[-3000:]}")
            time.sleep(0.05)
        pytest.fail(f"no {what} within {timeout} s:\n{self.text()[-3000:]}")

    def first_server(self) -> list[psutil.Process]:
        return self.wait_for(lambda: _servers(self.ps), "server process")

    def stop_with(self, signum: int, timeout: float = 60.0) -> int:
        self.proc.send_signal(signum)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher did not exit within {timeout} s of {signal.Signals(signum).name}:\n"
                        f"{self.text()[-3000:]}")

    def kill_leftovers(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for proc in _marked(self.mark):
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass

    def assert_nothing_left(self, seen: list[psutil.Process], ports=(), timeout: float = 10.0) -> None:
        """Nothing the launcher started is alive: by pid (every child noted, and ``seen``), by the mark in the
        environment, and its ports are free. ``timeout``: a server SIGKILLed by the launcher is gone at once;
        one stopping gracefully (SIGTERM) takes its graceful time."""
        self._watch.join(5)
        everything = {**self.started, **{p.pid: p for p in seen}}
        deadline = time.monotonic() + timeout
        while (left := [p for p in everything.values() if _alive(p)] + _marked(self.mark)) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, ([(p.pid, _name(p)) for p in left], self.text()[-3000:])
        assert len(everything) >= len(seen)
        assert all(_port_free(p) for p in ports), [p for p in ports if not _port_free(p)]


@pytest.fixture
def launcher_factory(tmp_path):
    started = []

    def start(args, name="launcher"):
        launcher = Launcher(args, tmp_path / f"{name}.log")
        started.append(launcher)
        return launcher

    yield start
    for launcher in started:
        launcher.kill_leftovers()


SIGNALS = [signal.SIGTERM, signal.SIGHUP, signal.SIGINT]


@pytest.mark.slow
@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: signal.Signals(s).name)
@pytest.mark.parametrize("moment", ["early", "late"])
def test_disagg_up_stops_its_servers_on_any_stop_signal(signum, moment, tmp_path, launcher_factory):
    config, ports = _one_model_config(tmp_path)
    up = launcher_factory(["-m", "disaggregated_inference", "up", "--config", str(config),
                           "--log-dir", str(tmp_path / "logs")])
    if moment == "early":  # the first server has just been started: the others, the gateway, the models to come
        seen = up.first_server()
    else:
        up.wait_for(lambda: "cluster running" in up.text(), "running cluster")
        seen = _servers(up.ps)
        assert len(seen) >= 3  # two servers and the gateway (their masters; each with its worker)
    code = up.stop_with(signum)
    text = up.text()
    if moment == "early":
        assert "all servers healthy" not in text, "the signal came too late to test the start-up"
        assert code == 128 + signum, text[-3000:]
        assert f"stopped by {signal.Signals(signum).name}" in text
    else:
        assert code == 0, text[-3000:]
    up.assert_nothing_left(seen, ports)


@pytest.mark.slow
def test_disagg_demo_stops_its_servers_on_sigterm_while_models_load(tmp_path, launcher_factory):
    config, _ = _one_model_config(tmp_path)
    demo = launcher_factory(["-m", "disaggregated_inference", "demo", "--config", str(config),
                             "--log-dir", str(tmp_path / "logs")])
    seen = demo.first_server()
    assert demo.stop_with(signal.SIGTERM) == 143, demo.text()[-3000:]
    demo.assert_nothing_left(seen)


@pytest.mark.slow
def test_the_graders_local_cluster_is_stopped_on_sighup(tmp_path, launcher_factory):
    from disaggregated_inference.grading.classgen import generate_class

    config, _ = _one_model_config(tmp_path)
    data = json.loads(config.read_text())
    data["models"]["gpt-oss"] = data["models"]["qwen"]  # the grader asks both models
    config.write_text(json.dumps(data))
    generate_class(tmp_path / "class", 1)
    grader = launcher_factory([str(ROOT / "business_analytics_grader_v2.py"), str(tmp_path / "class"), "--rubric",
                               str(ROOT / "examples" / "rubric.yaml"), "--local-cluster", "--config", str(config),
                               "--out", str(tmp_path / "grades"), "--no-progress"])
    seen = grader.first_server()
    assert grader.stop_with(signal.SIGHUP) == 130, grader.text()[-3000:]
    grader.assert_nothing_left(seen)


@pytest.mark.slow
def test_the_web_interfaces_local_cluster_and_streamlit_are_stopped_on_sigterm_once_up(tmp_path, launcher_factory):
    config, ports = _one_model_config(tmp_path)
    webui = launcher_factory(["-m", "disaggregated_inference.webui", "--local-cluster", "--config", str(config),
                              "--out", str(tmp_path / "out")])
    webui.wait_for(lambda: "grader web interface: http" in webui.text(), "web interface")
    seen = webui.wait_for(lambda: [c for c in webui.ps.children(recursive=True) if "streamlit" in command_of(c)]
                          and webui.ps.children(recursive=True), "streamlit")
    assert webui.stop_with(signal.SIGTERM) == 143, webui.text()[-3000:]
    webui.assert_nothing_left(seen)


@pytest.mark.slow
def test_a_benchmarks_cluster_is_stopped_on_sighup_while_models_load(tmp_path, launcher_factory):
    bench = launcher_factory([str(ROOT / "benchmarks" / "failover.py"), "--quick", "--json"])
    seen = bench.first_server()
    code = bench.stop_with(signal.SIGHUP)
    assert code != 0, bench.text()[-3000:]
    bench.assert_nothing_left(seen)


@pytest.mark.slow
def test_a_launcher_killed_outright_takes_its_servers_with_it(tmp_path, launcher_factory):
    """SIGKILL cannot be handled: PR_SET_PDEATHSIG (Linux) has the kernel send each server SIGTERM."""
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    config, ports = _one_model_config(tmp_path)
    up = launcher_factory(["-m", "disaggregated_inference", "up", "--config", str(config),
                           "--log-dir", str(tmp_path / "logs")])
    up.wait_for(lambda: "cluster running" in up.text(), "running cluster")
    seen = _servers(up.ps)
    assert up.stop_with(signal.SIGKILL) == -signal.SIGKILL
    up.assert_nothing_left(seen, ports, timeout=45)  # each server's graceful stop (gunicorn: 20 s at most)
