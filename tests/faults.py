"""Faults to inject into a running LocalCluster's servers (each a gunicorn master and its worker, in a
process group of their own): freeze one (SIGSTOP: a hung machine that keeps its sockets open) and thaw it.
A frozen server's listening socket still accepts connections, so a request sent to it waits, as it would
for a server stuck in a long prefill."""
from __future__ import annotations

import os
import signal


def freeze(proc) -> None:
    """Stop every process of a ``ServerProcess`` (the master and its worker)."""
    if proc.proc is not None and proc.proc.poll() is None:
        os.killpg(proc.proc.pid, signal.SIGSTOP)


def thaw(proc) -> None:
    """Let a frozen ``ServerProcess`` run again (harmless on one that runs)."""
    if proc.proc is not None and proc.proc.poll() is None:
        os.killpg(proc.proc.pid, signal.SIGCONT)
