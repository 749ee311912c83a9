"""Run every server of a config on this machine, each as its own gunicorn process.

The launcher binds each listening socket itself (port 0 picks a free port) and
hands it to gunicorn as ``fd://N``, so there is no race for ports and a port
already in use is reported before any model loads. ``stop()`` ends only the
processes this launcher started; ``ops/lifetime.py`` makes sure that whatever stops the
launcher (SIGTERM, SIGHUP, SIGINT, at any moment of its start-up) stops them too.
"""
from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import requests

from .. import config as cluster_config
from ..errors import ConfigError, DisaggError
from .launch import check_exposure, gateway_command, server_command
from .lifetime import critical, spawn, stop_on_signals
from ..server.settings import from_cluster


class ClusterError(DisaggError):
    code = "cluster_error"


class ServerProcess:
    def __init__(self, entry, settings, sock: socket.socket, log_path: Path):
        self.entry, self.settings, self.sock, self.log_path = entry, settings, sock, log_path
        self.proc: subprocess.Popen | None = None
        self._terminated = False  # SIGTERM sent to this process

    @property
    def url(self) -> str:
        return self.entry.url

    def command(self, environ: dict) -> tuple[list[str], dict]:
        return server_command(self.settings, f"fd://{self.sock.fileno()}", environ)

    def start(self, extra_env: dict | None = None) -> None:
        cmd, env = self.command({**os.environ, **(extra_env or {})})
        env.setdefault("PYTHONUNBUFFERED", "1")
        self._extra_env = extra_env
        with open(self.log_path, "ab") as log, critical():  # no stop signal between the fork and self.proc
            self.proc = spawn(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                              pass_fds=(self.sock.fileno(),), start_new_session=True)
            self._terminated = False
            # The server owns the socket now; keeping our copy open would let the kernel accept
            # connections for a dead server, and clients would hang instead of being refused.
            self.sock.close()

    def restart(self) -> None:
        """Start the server again on the same port (after ``kill`` or ``stop``)."""
        if self.proc and self.proc.poll() is None:
            raise ClusterError(f"server {self.entry.name} is still running")
        self.sock = _bind(self.entry.host, self.entry.port)
        self.start(self._extra_env)

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def terminate(self) -> None:
        """Ask the server to stop (gunicorn: a graceful shutdown of its worker); ``stop`` waits for it."""
        if self.proc and self.proc.poll() is None and not self._terminated:
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = True

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc and self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)

    def kill(self) -> None:
        """End the server abruptly (tests of failure handling)."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


class GatewayProcess(ServerProcess):
    """The gateway (``disagg gateway``) in front of the servers a LocalCluster started."""

    def __init__(self, entry, cluster_config: dict, sock: socket.socket, log_path: Path):
        super().__init__(entry, None, sock, log_path)
        self.cluster_config = cluster_config

    def command(self, environ: dict) -> tuple[list[str], dict]:
        return gateway_command(self.cluster_config, f"fd://{self.sock.fileno()}", environ)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ClusterError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


class LocalCluster:
    """Start the servers of ``config`` (all, or those named) on this machine.

    With ``free_ports=True`` every server gets a free port and ``self.config``
    (a dict, like the file) says which. With ``gateway=True`` the gateway (the
    config's ``gateway`` section) is started too, last, in front of these servers:
    ``self.gateway`` is its process.
    """

    def __init__(self, config=None, names=None, free_ports: bool = False, log_dir=None, env=None,
                 gateway: bool = False):
        cfg = cluster_config.coerce(config)
        self.source = cfg
        self.env = env or {}
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="disagg-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        entries = [e for e in cfg.servers if not names or e.name in names]
        if names and len(entries) != len(set(names)):
            missing = set(names) - {e.name for e in entries}
            raise ConfigError(f"{cfg.source}: no server named {', '.join(sorted(missing))}")
        for e in entries:
            if e.host not in ("127.0.0.1", "localhost", "::1", "0.0.0.0"):
                raise ConfigError(f"{cfg.source}: server {e.name} is on {e.host}; the local cluster only "
                                  "starts servers on this machine (use scripts/start_*.sh for remote ones)")
        self.processes: list[ServerProcess] = []
        self.entries, self._free_ports = entries, free_ports
        self._run = uuid.uuid4().hex[:12]
        self.gateway: GatewayProcess | None = None
        self._with_gateway = gateway
        self._signals = ExitStack()  # stop_on_signals() while the cluster runs
        if gateway and cfg.gateway["host"] not in ("127.0.0.1", "localhost", "::1", "0.0.0.0"):
            raise ConfigError(f"{cfg.source}: the gateway is on {cfg.gateway['host']}; the local cluster only "
                              "starts it on this machine", field="gateway.host")

    def start(self) -> "LocalCluster":
        try:
            # before the first server: a stop signal from here on stops what was started (ops/lifetime.py)
            self._signals.enter_context(stop_on_signals(only_defaults=True))
            bound = []
            for entry in self.entries:
                sock = _bind(entry.host, 0 if self._free_ports else entry.port)
                bound.append((replace(entry, port=sock.getsockname()[1]), sock))
            # decode servers trust the prefill servers' KV at the ports actually bound
            ports = {e.name: e.port for e, _ in bound}
            peers = [replace(e, port=ports.get(e.name, e.port)) for e in self.source.prefill_servers]
            for entry, sock in bound:
                settings = from_cluster(self.source, entry.name, prefill_entries=peers)
                if settings.core_group:  # this cluster's servers share cores with each other, not another's
                    settings = replace(settings, core_group=f"{settings.core_group}#{self._run}")
                check_exposure(settings, entry.url.split("://", 1)[1])  # 0.0.0.0 without a token: refused
                proc = ServerProcess(entry, settings, sock, self.log_dir / f"{entry.name}.log")
                self.processes.append(proc)  # listed first: stop() covers it from its very start
                proc.start(self.env)
            if self._with_gateway:
                self.start_gateway()
        except BaseException:
            self.stop()
            raise
        return self

    def start_gateway(self) -> GatewayProcess:
        host = self.source.gateway["host"]
        sock = _bind(host, 0 if self._free_ports else self.source.gateway["port"])
        entry = cluster_config.ServerEntry("gateway", "gateway", host, sock.getsockname()[1], "")
        gateway = GatewayProcess(entry, self.config, sock, self.log_dir / "gateway.log")
        self.gateway = gateway
        gateway.start(self.env)
        return gateway

    @property
    def config(self) -> dict:
        """The cluster's config as a dict, with the ports actually used."""
        base = json.loads(Path(self.source.source).read_text()) if Path(self.source.source).is_file() else None
        data = copy.deepcopy(base) if base else {"models": self.source.models, "client": self.source.client,
                                                 "server": self.source.server, "gateway": self.source.gateway}
        if self.gateway is not None:
            data["gateway"] = {**data.get("gateway", {}), "host": self.gateway.entry.host,
                               "port": self.gateway.entry.port}
        for role in ("prefill", "decode"):
            data[f"{role}_servers"] = [
                {"name": p.entry.name, "host": p.entry.host, "port": p.entry.port, "model": p.entry.model}
                for p in self.processes if p.entry.role == role]
        data.setdefault("models", self.source.models)
        return data

    def process(self, name: str) -> ServerProcess:
        return next(p for p in self.processes if p.entry.name == name)

    def wait_healthy(self, timeout: float = 600.0, progress=None, names=None) -> None:
        """Wait until every server's model is loaded; report progress lines as they change."""
        deadline = time.monotonic() + timeout
        last: dict = {}
        everything = self.processes + ([self.gateway] if self.gateway else [])
        pending = [p for p in everything if not names or p.entry.name in names]
        while pending:
            for proc in list(pending):
                if proc.proc.poll() is not None:
                    raise ClusterError(f"server {proc.entry.name} exited with code {proc.proc.returncode}:\n"
                                       f"{proc.log_tail()}")
                try:
                    health = requests.get(proc.url + "/health", timeout=2).json()
                except (requests.RequestException, ValueError):
                    health = {"status": "starting", "progress": "starting gunicorn"}
                message = "ready" if health.get("loaded") else health.get("progress") or health.get("status")
                if health.get("status") == "unhealthy":
                    raise ClusterError(f"server {proc.entry.name} failed to load its model: {health.get('error')}")
                if progress and last.get(proc.entry.name) != message:
                    progress(proc.entry.name, message)
                last[proc.entry.name] = message
                if health.get("loaded"):
                    pending.remove(proc)
            if pending:
                if time.monotonic() > deadline:
                    raise ClusterError(f"servers not healthy after {timeout:g}s: "
                                       + ", ".join(p.entry.name for p in pending))
                time.sleep(0.25)

    def stop(self) -> None:
        """Stop the gateway, then every server: all asked at once, each then waited for (15 s, then
        SIGKILL), so that stopping takes the slowest server's time, not the sum. Interrupted (a second
        Ctrl-C, say), it kills what is left at once and lets the interruption go on."""
        try:
            if self.gateway is not None:
                self.gateway.stop()
            for proc in self.processes:
                proc.terminate()
            for proc in self.processes:
                proc.stop()
        except BaseException:
            self.kill()
            raise
        finally:
            self._signals.close()

    def kill(self) -> None:
        """SIGKILL to every process group this cluster started, the gateway's included."""
        for proc in [self.gateway, *self.processes]:
            if proc is not None and proc.proc is not None:
                try:
                    proc.kill()
                except (OSError, subprocess.TimeoutExpired):  # already gone, or not reaped in time: go on
                    pass

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
