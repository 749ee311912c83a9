"""What a launcher starts ends with it: the signals that stop a launcher stop its servers.

A launcher (``disagg up`` and ``demo``, the grader's and the web interface's
``--local-cluster``, the benchmarks' clusters) starts servers in sessions of their own, so that
a Ctrl-C at the terminal reaches the launcher alone and the launcher stops them in order.
Then nothing but the launcher stops them, at any moment of its life:

- ``stop_on_signals()``: SIGTERM (a process manager, CI), SIGHUP (a closed terminal) and
  SIGINT (Ctrl-C) raise ``StopRequested`` in the main thread, a ``KeyboardInterrupt``, so
  the ``finally`` blocks that stop the servers run. It is installed before the first server
  starts (``LocalCluster.start`` holds it for as long as the cluster runs, on the signals nobody
  else handles); once one signal has been taken, the others wait for the stop it began.
- ``critical()``: a server is started (forked, executed, its handle kept) with these signals
  held back, so none lands between the fork and the moment the launcher knows the process: a
  handler installed with ``guarded`` runs right after, when the server can be stopped.
- ``child_setup``: each server also gets ``PR_SET_PDEATHSIG`` (Linux): were the launcher
  killed outright (SIGKILL, a crash), the kernel sends its servers SIGTERM. It is tied to the
  thread that started the child, so it is set only for servers started by the main thread
  (a helper thread that ends would take its servers with it).
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


class StopRequested(KeyboardInterrupt):
    """A stop signal reached the launcher; ``exit_code`` is the shell's 128 + signal number."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.name = signal.Signals(signum).name
        self.exit_code = 128 + signum


class _State:
    depth = 0  # critical sections open in the main thread
    pending: list = []  # (handler, signum) held back by a critical section
    holders = 0  # stop_on_signals() in force
    previous: dict = {}  # signal -> the handler stop_on_signals() replaced
    taken: int | None = None  # the signal that began the stop


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def guarded(handler):
    """``handler`` (a Python signal handler) held back while a ``critical()`` section runs."""
    def handle(signum, frame):
        if _State.depth:
            _State.pending.append((handler, signum))
            return
        handler(signum, frame)

    handle.__wrapped__ = handler
    return handle


@contextmanager
def critical():
    """Hold the stop signals back (in the main thread, where Python runs handlers) for the body: for
    starting a child and recording it, which must not be cut in two. Held signals are handled at its end."""
    if not _main_thread():
        yield
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    _State.depth += 1
    try:
        yield
    finally:
        _State.depth -= 1
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        if not _State.depth and _State.pending:
            held, _State.pending = _State.pending, []
            for handler, signum in held:
                if callable(handler):
                    handler(signum, None)


def _request_stop(signum, frame):
    if _State.taken is not None:  # a stop is under way: let it finish
        return
    _State.taken = signum
    raise StopRequested(signum)


def _is_default(handler) -> bool:
    return handler in (signal.SIG_DFL, signal.default_int_handler, None)


@contextmanager
def stop_on_signals(only_defaults: bool = False):
    """While in force, SIGTERM, SIGHUP and SIGINT raise ``StopRequested`` (once). A signal ignored (SIG_IGN:
    nohup's SIGHUP) stays ignored; ``only_defaults``: so does one whose handler someone already chose (a
    launcher's own). Outside the
    main thread (where Python cannot install handlers) it does nothing. Nested uses share one installation."""
    if not _main_thread():
        yield
        return
    if _State.holders == 0:
        _State.previous, _State.taken = {}, None
        for sig in STOP_SIGNALS:
            current = signal.getsignal(sig)
            if current is signal.SIG_IGN or (only_defaults and not _is_default(current)):
                continue  # ignored on purpose (nohup's SIGHUP, a background job's SIGINT), or someone else's
            _State.previous[sig] = signal.signal(sig, guarded(_request_stop))
    _State.holders += 1
    try:
        yield
    finally:
        _State.holders -= 1
        _State.taken = None  # the stop that was taken has come through this context: the next signal counts again
        if _State.holders == 0:
            for sig, handler in _State.previous.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
            _State.previous = {}


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


def child_setup():
    """A ``preexec_fn`` for a server: the stop signals unblocked (``critical`` held them back in the
    parent) and, when started by the main thread on Linux, SIGTERM to it when the launcher dies."""
    parent = os.getpid()
    deathsig = _PRCTL if _main_thread() else None

    def setup():
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        if deathsig is not None:
            deathsig(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
            if os.getppid() != parent:  # the launcher died before the line above: nobody will send it
                os.kill(os.getpid(), signal.SIGTERM)

    return setup


def spawn(cmd, **popen_kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` for a child the launcher must always be able to stop (see the module's doc).
    Call it inside ``critical()`` together with whatever records the child."""
    return subprocess.Popen(cmd, preexec_fn=child_setup(), **popen_kwargs)
