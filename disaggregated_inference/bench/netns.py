"""A prefill server behind a link of its own: a network namespace joined to this machine by two veth pairs.

The soak's link faults need the prefill→decode data path apart from everything else. One prefill server
runs in a namespace of its own (``ip netns exec``), listening on both of its addresses there:

- the *control* pair (``10.214.N.0/30``): the client and the gateway send it ``/prefill`` here;
- the *data* pair (``10.214.N.4/30``): its ``data_url``, where the decode servers pull the KV bundles.

So cutting (both ends of the data pair down) or slowing it (a ``tbf`` on both ends) cuts or slows the KV
transfers alone, the way ``benchmarks/link.py`` shapes its veth (its measurements in
``../shared/reference/link-emulation.md``). It needs root and ``ip``/``tc`` (iproute2); ``unavailable()``
says why not. Names carry this process's id; namespaces a killed run left behind are removed first; ``close``
removes the namespace (and with it both pairs) on every way out. Nothing outside this machine is touched.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from ..ops.cluster import ServerProcess
from ..ops.launch import server_command
from ..ops.lifetime import critical, spawn

PREFIX = "dsk-"
PORT = 8000


class LinkUnavailable(Exception):
    """The namespaced link cannot be made here (the message says why)."""


def _run(*cmd: str, check: bool = True) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode and check:
        raise LinkUnavailable(f"`{' '.join(cmd)}` failed: {(done.stderr or done.stdout).strip()}")
    return done.stdout


def unavailable() -> str | None:
    """Why the namespaced link cannot be made here, or None."""
    if not sys.platform.startswith("linux"):
        return "the link faults need Linux network namespaces"
    if os.geteuid() != 0:
        return "the link faults need root (ip netns, tc): run the soak as root"
    missing = [tool for tool in ("ip", "tc", "ss") if shutil.which(tool) is None]
    if missing:
        return f"the link faults need {' and '.join(missing)} (iproute2)"
    return None


class DataLink:
    def __init__(self, subnet: int | None = None):
        pid = os.getpid()
        self.ns = f"{PREFIX}{pid}"
        n = subnet if subnet is not None else pid % 250 + 1
        self.host_ctl, self.ctl = f"10.214.{n}.1", f"10.214.{n}.2"
        self.host_data, self.data = f"10.214.{n}.5", f"10.214.{n}.6"
        self.devs = {"ctl": (f"dskc{pid}", f"dskC{pid}"), "data": (f"dskd{pid}", f"dskD{pid}")}  # (host, ns)
        self.name = f"prefill→decode data path {self.data} (namespace {self.ns})"
        self.state = "down"
        self._made = False

    def open(self) -> "DataLink":
        self._remove_stale()
        try:
            _run("ip", "netns", "add", self.ns)
            self._made = True
            _run("ip", "-n", self.ns, "link", "set", "lo", "up")
            pairs = (("ctl", (self.host_ctl, self.ctl)), ("data", (self.host_data, self.data)))
            for key, (host_addr, ns_addr) in pairs:
                host_dev, ns_dev = self.devs[key]
                _run("ip", "link", "add", host_dev, "type", "veth", "peer", "name", ns_dev)
                _run("ip", "link", "set", ns_dev, "netns", self.ns)
                _run("ip", "addr", "add", f"{host_addr}/30", "dev", host_dev)
                _run("ip", "link", "set", host_dev, "up")
                _run("ip", "-n", self.ns, "addr", "add", f"{ns_addr}/30", "dev", ns_dev)
                _run("ip", "-n", self.ns, "link", "set", ns_dev, "up")
        except BaseException:
            self.close()
            raise
        self.state = "up"
        return self

    def _remove_stale(self) -> None:
        for name in _run("ip", "netns", "list", check=False).split():
            pid = name[len(PREFIX):]
            if name.startswith(PREFIX) and pid.isdigit() and not Path(f"/proc/{pid}").exists():
                subprocess.run(["ip", "netns", "del", name], capture_output=True)

    def command(self, cmd: list[str]) -> list[str]:
        """``cmd`` run inside the namespace."""
        return ["ip", "netns", "exec", self.ns, *cmd]

    # -- the faults: on both ends of the data pair ------------------------------------------------------
    def _both(self, *qdisc: str) -> None:
        host_dev, ns_dev = self.devs["data"]
        _run("tc", "qdisc", "replace", "dev", host_dev, "root", *qdisc)
        _run("tc", "-n", self.ns, "qdisc", "replace", "dev", ns_dev, "root", *qdisc)

    def cut(self) -> None:
        """Both ends of the data pair down: nothing crosses, and the connections on it stall (no reset), as
        with a pulled cable (``netem loss 100%`` would need sch_netem, which not every kernel has)."""
        host_dev, ns_dev = self.devs["data"]
        _run("ip", "-n", self.ns, "link", "set", ns_dev, "down")
        _run("ip", "link", "set", host_dev, "down")
        self.state = "cut"

    def slow(self, mbit: float) -> None:
        burst = max(16 << 10, int(mbit * 1e6 / 8 * 0.002))  # 2 ms worth, at least 16 KiB
        self._both("tbf", "rate", f"{mbit:g}mbit", "burst", str(burst), "latency", "100ms")
        self.state = f"{mbit:g} Mbit/s"

    def restore(self) -> None:
        host_dev, ns_dev = self.devs["data"]
        subprocess.run(["ip", "link", "set", host_dev, "up"], capture_output=True)
        subprocess.run(["ip", "-n", self.ns, "link", "set", ns_dev, "up"], capture_output=True)
        subprocess.run(["tc", "qdisc", "del", "dev", host_dev, "root"], capture_output=True)
        subprocess.run(["tc", "-n", self.ns, "qdisc", "del", "dev", ns_dev, "root"], capture_output=True)
        self.state = "up"

    def bytes_in_flight(self) -> int:
        """Bytes queued to send on the data path's connections (the prefill server's side): a KV transfer in
        flight; 0 when none."""
        out = _run("ip", "netns", "exec", self.ns, "ss", "-tnH", "state", "established", "src", self.data,
                   check=False)
        total = 0
        for line in out.splitlines():  # Recv-Q Send-Q Local Peer
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                total += int(parts[1])
        return total

    def close(self) -> None:
        if self._made:  # the namespace's ends go with it, and so the pairs
            subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
            self._made = False
        for host_dev, _ in self.devs.values():
            subprocess.run(["ip", "link", "del", host_dev], capture_output=True)
        self.state = "down"


class NamespacedProcess(ServerProcess):
    """A server started inside the link's namespace (``ip netns exec``, which execs it: its pid is the
    server's), listening on every address of the namespace; stopped, killed and restarted as any other."""

    def __init__(self, entry, settings, link: DataLink, log_path: Path):
        super().__init__(entry, settings, None, log_path)
        self.link = link
        self._extra_env = None

    def start(self, extra_env: dict | None = None) -> None:
        cmd, env = server_command(self.settings, f"0.0.0.0:{self.entry.port}", {**os.environ, **(extra_env or {})})
        env.setdefault("PYTHONUNBUFFERED", "1")
        with open(self.log_path, "ab") as log, critical():  # no stop signal between the fork and self.proc
            self.proc = spawn(self.link.command(cmd), env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
        self._terminated = False
        self._extra_env = extra_env

    def restart(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.start(self._extra_env)
