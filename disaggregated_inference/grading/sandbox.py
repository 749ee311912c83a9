"""The sandbox that re-runs a student's notebook: bubblewrap on Linux, or nothing.

``find_sandbox()`` says once per process whether notebooks can be run confined here (Linux, ``bwrap``,
``prlimit``, nbclient and ipykernel, and a probe run that works), or why not; without one the grader
grades from the saved outputs and never runs student code unconfined. ``Sandbox.run`` executes one
notebook (``sandbox_runner.py`` drives a Jupyter kernel through nbclient, both inside) and returns what
it reported, read as size-limited data.

What the notebook's code gets:

- its own network namespace (only a loopback; no route out), PID namespace (it sees and can signal only
  its own processes), IPC and UTS namespaces; a new session; it dies with the grader;
- the system (``/usr``, a few files of ``/etc``), the Python installation and its environment, read-only;
  nothing else of the grader's filesystem (no home, no config, no other submission);
- one private writable directory, ``/home/student`` (its HOME and working directory), holding only the
  notebook and the assignment's data files; a small ``/tmp``;
- its own unprivileged user (when the grader runs as root: a uid of its own per sandbox, no capabilities,
  no new privileges), with limits on CPU seconds, address space, processes, file size and open files;
- a time limit per cell and per notebook, and a cap on the output kept.
"""
from __future__ import annotations

import importlib.util
import itertools
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)

RUNNER = Path(__file__).with_name("sandbox_runner.py")
INSIDE_RUNNER = "/opt/grader/sandbox_runner.py"
INSIDE_AUDIT = "/opt/audit"  # what the kernel's audit hook saw the notebook try (sandbox_runner.AUDIT_FILE)
MAX_AUDIT_BYTES = 1 << 16
HOME = "/home/student"
MAX_REPORT_BYTES = 4 << 20   # what the grader reads of the runner's report; the rest is dropped
MAX_STDERR_BYTES = 4096      # the runner's stderr kept for a diagnosis
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives", "/etc/fonts",
             "/etc/localtime", "/etc/mime.types")
_UIDS = itertools.count()
_RUNNING: set = set()         # the sandboxes' processes now running (end_all stops them)
_ENDED: set = set()           # those end_all stopped: their runs say so (RawRun.cancelled)
_RUNNING_LOCK = threading.Lock()


def end_all() -> int:
    """Kill every sandbox this process has running (a stopped batch): each ends with its PID namespace."""
    with _RUNNING_LOCK:
        running = list(_RUNNING)
        _ENDED.update(proc.pid for proc in running)
    for proc in running:
        try:
            os.killpg(proc.pid, 9)
        except (ProcessLookupError, PermissionError):
            pass
    return len(running)


@dataclass(frozen=True)
class ExecutionLimits:
    cell_timeout_s: float = 30.0
    notebook_timeout_s: float = 120.0   # the whole run: kernel start, every cell and the hidden tests
    cpu_s: int = 120                    # CPU seconds of each process (the kernel is killed past it)
    memory_mb: int = 2048               # address space of each process
    processes: int = 64                 # processes and threads of the sandbox's user
    file_mb: int = 64                   # the largest file it may write
    tmp_mb: int = 64                    # its /tmp (memory-backed)
    output_kb: int = 10240              # notebook output kept (charts included); the rest is dropped and reported
    text_chars: int = 4000              # of each cell's text compared with the saved outputs

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RawRun:
    """What came back from one sandbox run, before it is read as evidence (``rerun.py``)."""
    records: list        # the runner's JSON lines (cells, tests, end), parsed, unchecked
    exit_code: int | None
    killed: bool         # the grader killed it at the notebook's time limit
    seconds: float
    stderr: str
    truncated: bool      # the report was longer than MAX_REPORT_BYTES
    attempts: list       # what the notebook tried that the sandbox stops ({kind, what}), parsed, unchecked
    cancelled: bool = False  # ended by the grader's stop (end_all), not by the notebook


def _bwrap_paths() -> list[str]:
    """The read-only view of the system and of this Python (its installation and its environment)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for path in ETC_FILES:
        args += ["--ro-bind-try", path, path]
    made = {"/", "/usr", "/home", "/opt", "/tmp"}
    for prefix in dict.fromkeys([sys.base_prefix, sys.prefix]):
        if prefix.startswith("/usr/") or prefix == "/usr":
            continue
        parts = Path(prefix).parts
        for i in range(2, len(parts)):
            parent = str(Path(*parts[:i]))
            if parent not in made:
                made.add(parent)
                args += ["--perms", "0755", "--dir", parent]
        args += ["--ro-bind", os.path.realpath(prefix), prefix]
    return args


def _environment() -> list[str]:
    env = {"HOME": HOME, "USER": "student", "LOGNAME": "student", "LANG": "C.UTF-8", "TMPDIR": "/tmp",
           "PATH": f"{sys.prefix}/bin:/usr/local/bin:/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONHASHSEED": "0", "JUPYTER_RUNTIME_DIR": "/tmp/jupyter/runtime", "IPYTHONDIR": "/tmp/ipython",
           "MPLCONFIGDIR": "/tmp/matplotlib", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    args = ["--clearenv"]
    for key, value in env.items():
        args += ["--setenv", key, value]
    return args


class Sandbox:
    """bubblewrap around ``sandbox_runner.py``: see the module's docstring for what the notebook gets."""

    def __init__(self, bwrap: str, prlimit: str, setpriv: str | None):
        self.bwrap, self.prlimit, self.setpriv = bwrap, prlimit, setpriv
        self.as_root = os.geteuid() == 0

    def _uid(self) -> int:
        # root: a user of its own per sandbox (RLIMIT_NPROC counts a user's processes, and root has no limit)
        return 1_000_000 + (os.getpid() % 4096) * 256 + next(_UIDS) % 256

    def command(self, private: Path, audit: Path, limits: ExecutionLimits, uid: int | None) -> list[str]:
        mb = 1 << 20
        cmd = [self.prlimit, f"--as={limits.memory_mb * mb}", f"--cpu={limits.cpu_s}:{limits.cpu_s + 5}",
               f"--nproc={limits.processes}", f"--fsize={limits.file_mb * mb}", "--nofile=256", "--core=0", "--",
               self.bwrap, "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
               "--die-with-parent", "--new-session"]
        if uid is None:  # an ordinary user: a user namespace, the same user inside, no capabilities
            cmd += ["--unshare-user", "--cap-drop", "ALL"]
        # its /tmp first: a Python installed under /tmp (a checkout's .venv there) is bound inside it, not hidden by it
        cmd += ["--perms", "1777", "--size", str(limits.tmp_mb * mb), "--tmpfs", "/tmp"]
        cmd += _bwrap_paths() + _environment()
        cmd += ["--perms", "0755", "--dir", "/opt/grader", "--ro-bind", str(RUNNER), INSIDE_RUNNER,
                "--perms", "0755", "--dir", INSIDE_AUDIT, "--bind", str(audit), INSIDE_AUDIT,
                "--proc", "/proc", "--dev", "/dev",
                "--perms", "0755", "--dir", "/home", "--bind", str(private), HOME, "--chdir", HOME, "--"]
        if uid is not None:  # root: become the sandbox's own user, with no capabilities, before any of its code
            cmd += [self.setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                    "--bounding-set=-all", "--no-new-privs", "--"]
        return cmd + [sys.executable, INSIDE_RUNNER, "run"]

    def run(self, notebook: Path, data_files=(), tests=(), limits: ExecutionLimits | None = None,
            name: str = "notebook.ipynb") -> RawRun:
        """Run ``notebook`` with ``data_files`` beside it and then ``tests`` ({id, title, code}); never raises
        for what the notebook does."""
        limits = limits or ExecutionLimits()
        root = Path(tempfile.mkdtemp(prefix="grader-sandbox-"))
        private, audit = root / "home", root / "audit"
        private.mkdir(mode=0o700)
        audit.mkdir(mode=0o700)
        uid = self._uid() if self.as_root else None
        try:
            shutil.copyfile(notebook, private / name)
            for data in data_files:
                shutil.copyfile(data, private / Path(data).name)
            if uid is not None:
                for path in [private, audit, *private.iterdir()]:
                    os.chown(path, uid, uid)
            job = {"notebook": name, "tests": list(tests), "cell_timeout": limits.cell_timeout_s,
                   "deadline": max(5.0, limits.notebook_timeout_s - 3.0), "output_limit": limits.output_kb * 1024,
                   "text_limit": limits.text_chars}
            run = self._execute(self.command(private, audit, limits, uid), job, limits)
            run.attempts = _read_attempts(audit / "kernel.jsonl")
            return run
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def _execute(self, cmd: list[str], job: dict, limits: ExecutionLimits) -> RawRun:
        started = time.monotonic()
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        with _RUNNING_LOCK:
            _RUNNING.add(proc)
        try:
            return self._collect(proc, job, limits, started)
        finally:
            with _RUNNING_LOCK:
                _RUNNING.discard(proc)
                _ENDED.discard(proc.pid)

    def _collect(self, proc, job: dict, limits: ExecutionLimits, started: float) -> RawRun:
        report, errors = bytearray(), bytearray()
        state = {"truncated": False}

        def read_report():
            while chunk := proc.stdout.read(65536):
                room = MAX_REPORT_BYTES - len(report)
                if len(chunk) > room:
                    state["truncated"] = True
                report.extend(chunk[:max(0, room)])

        def read_errors():
            while chunk := proc.stderr.read(65536):
                errors.extend(chunk)
                del errors[:-MAX_STDERR_BYTES]

        readers = [threading.Thread(target=f, daemon=True) for f in (read_report, read_errors)]
        for t in readers:
            t.start()
        try:
            proc.stdin.write(json.dumps(job).encode())
            proc.stdin.close()
        except OSError:
            pass
        killed = False
        try:
            proc.wait(timeout=limits.notebook_timeout_s + 5)
        except subprocess.TimeoutExpired:
            killed = True
            try:
                os.killpg(proc.pid, 9)  # bwrap and, through --die-with-parent, its PID namespace
            except ProcessLookupError:
                pass
            proc.wait()
        for t in readers:
            t.join(5)
        records = _json_objects(bytes(report).decode("utf-8", "replace").splitlines())
        with _RUNNING_LOCK:
            cancelled = proc.pid in _ENDED
        return RawRun(records, proc.returncode, killed, round(time.monotonic() - started, 3),
                      bytes(errors).decode("utf-8", "replace"), state["truncated"], [], cancelled)


def _read_attempts(path: Path) -> list:
    """The audit hook's lines, written where the notebook could write too: data, size-limited, never trusted."""
    try:  # not through a link the notebook put there, nor from a pipe that never ends
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return []
    with os.fdopen(fd, "rb") as f:
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return []
            text = f.read(MAX_AUDIT_BYTES).decode("utf-8", "replace")
        except OSError:
            return []
    return _json_objects(text.splitlines()[:50])


def _json_objects(lines) -> list[dict]:
    """The lines that are JSON objects, parsed; anything else (a cut line, stray output) skipped."""
    out = []
    for line in lines:
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict):
            out.append(item)
    return out


PROBE_NOTEBOOK = {"cells": [{"cell_type": "code", "execution_count": None, "id": "probe", "metadata": {},
                             "outputs": [], "source": "print('sandbox ok')"}],
                  "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


@lru_cache(maxsize=1)
def find_sandbox() -> tuple[Sandbox | None, str]:
    """(the sandbox, "") where notebooks can be run confined here, else (None, why not). Decided once."""
    if not sys.platform.startswith("linux"):
        return None, (f"no sandbox on {sys.platform}: notebooks are not re-run here (bubblewrap is Linux only; "
                      "see docs/DEPLOYMENT.md)")
    bwrap, prlimit, setpriv = shutil.which("bwrap"), shutil.which("prlimit"), shutil.which("setpriv")
    missing = [name for name, path in (("bwrap (Debian: bubblewrap)", bwrap), ("prlimit (util-linux)", prlimit))
               if not path]
    if os.geteuid() == 0 and not setpriv:
        missing.append("setpriv (util-linux)")
    for module in ("nbclient", "ipykernel"):
        if importlib.util.find_spec(module) is None:
            missing.append(f"the Python package {module}")
    if missing:
        return None, "no sandbox: " + ", ".join(missing) + " missing; notebooks are not re-run"
    sandbox = Sandbox(bwrap, prlimit, setpriv)
    with tempfile.TemporaryDirectory() as folder:
        probe = Path(folder) / "probe.ipynb"
        probe.write_text(json.dumps(PROBE_NOTEBOOK))
        run = sandbox.run(probe, limits=ExecutionLimits(notebook_timeout_s=60, cell_timeout_s=30))
    cells = [r for r in run.records if r.get("kind") == "cell"]
    if not cells or cells[0].get("stdout") != "sandbox ok\n":
        tail = (run.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return None, f"no sandbox: a probe run in bubblewrap failed ({tail}); notebooks are not re-run"
    return sandbox, ""
