"""Faults to inject into a running LocalCluster's servers (each a gunicorn master and its worker, in a
process group of their own): freeze one (SIGSTOP: a hung machine that keeps its sockets open) and thaw it;
send it slow clients. A frozen server's listening socket still accepts connections, so a request sent to it
waits, as it would for a server stuck in a long prefill."""
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


class SlowClients:
    """``n`` connections to ``address`` (host, port), each sending a request's headers one byte every
    ``gap`` seconds (slowloris), from a thread, until the server closes it or the ``with`` block ends.
    ``closed`` maps each connection the server closed to when (seconds after the start) and what it
    had answered before closing (b"" for nothing)."""

    HEAD = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Pad: " + b"a" * 100_000

    def __init__(self, address: tuple, n: int, gap: float):
        import socket
        import threading
        import time

        self._time = time
        self.socks = [socket.create_connection(address, timeout=5) for _ in range(n)]
        self.gap, self.closed, self.stop = gap, {}, threading.Event()
        self.started = time.monotonic()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        for s in self.socks:
            s.setblocking(False)
        heard = {}
        i = 0
        while len(self.closed) < len(self.socks) and not self.stop.is_set():
            for k, s in enumerate(self.socks):
                if k in self.closed:
                    continue
                try:
                    s.send(self.HEAD[i:i + 1])
                    data = s.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                heard[k] = heard.get(k, b"") + data
                if not data or b"\r\n\r\n" in heard[k]:  # closed, or a whole answer: it closes next
                    self.closed[k] = (self._time.monotonic() - self.started, heard[k])
            i += 1
            self.stop.wait(self.gap)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(10)
        for s in self.socks:
            s.close()
