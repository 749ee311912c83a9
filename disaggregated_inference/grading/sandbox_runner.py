"""Runs INSIDE the sandbox that ``sandbox.py`` builds: one notebook through nbclient, top to bottom, then the
rubric's hidden tests in the same kernel. It imports nothing of this package (the package is not visible
in the sandbox), only the standard library, nbformat and nbclient.

    python sandbox_runner.py run < job.json            # JSON lines on stdout, one per cell and test, then "end"
    python sandbox_runner.py kernel LIMIT -f CONNECTION_FILE  # the kernel: an audit hook, output capped, ipykernel

The job (on stdin): ``{"notebook": NAME, "tests": [{"id", "title", "code"}], "cell_timeout": s,
"deadline": s, "output_limit": bytes, "text_limit": chars}``. The kernel's own stdout and stderr go
nowhere, and this process is made non-dumpable, so the notebook's code cannot write into the result
stream; the grader still reads it only as data, size-limited.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

IMAGE_MIMES = ("image/png", "image/jpeg", "image/svg+xml", "application/vnd.plotly.v1+json",
               "application/vnd.vegalite.v4+json", "application/vnd.vegalite.v5+json")
AUDIT_FILE = "/opt/audit/kernel.jsonl"  # a folder of its own, read by the grader after the run
KERNEL_NAME = "grader-sandbox"
PROBE_TIMEOUT = 5  # s: after a cell's time limit and an interrupt, how long the kernel has to answer again


# -- the kernel's audit hook: what the notebook tried, for the report (containment never depends on it) -----

def _outside(path: str, roots: tuple) -> bool:
    path = os.path.abspath(path)
    return not any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _descendant(pid: int, ancestor: int) -> bool:
    """Whether ``pid`` is a child (or grandchild...) of ``ancestor``: the kernel ending its own subprocesses."""
    for _ in range(8):
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if pid == ancestor:
            return True
    return False


def install_audit_hook() -> None:
    home = os.environ.get("HOME", "/home/student")
    own_tmp = ("/tmp/matplotlib", "/tmp/jupyter", "/tmp/ipython")  # the kernel's, in its own /tmp (and ipykernel_N)
    readable = (home, sys.prefix, sys.base_prefix, os.path.realpath(sys.prefix), "/usr", "/etc", "/dev",
                "/proc", "/sys", "/opt/grader")  # /proc and /sys show the sandbox's own processes only
    writable = (home, "/tmp", "/dev/null", "/opt/audit")
    fd = os.open(AUDIT_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    seen: dict = {}
    me = os.getpid()

    def record(kind: str, what: str) -> None:
        key = (kind, what)
        if key in seen or len(seen) >= 50:
            return
        seen[key] = True
        os.write(fd, (json.dumps({"kind": kind, "what": what[:200]}) + "\n").encode())

    def hook(event: str, args) -> None:
        try:
            if event == "socket.connect":
                record("network", repr(args[1]))
            elif event == "socket.getaddrinfo":
                record("network", repr(args[0]))
            elif event == "open" and isinstance(args[0], (str, bytes)):
                path = os.fsdecode(args[0])
                mode, flags = args[1], args[2] if len(args) > 2 else 0
                writes = (isinstance(mode, str) and any(m in mode for m in "wax+")) or bool(
                    (flags or 0) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC))
                if writes and _outside(path, writable):
                    record("write", path)
                elif not writes and _outside(path, readable) and (
                        _outside(path, ("/tmp",)) or not (os.path.exists(path) or not _outside(path, own_tmp)
                                                          or path.startswith("/tmp/ipykernel_"))):
                    record("read", path)  # (under /tmp: one that is not in its own /tmp, i.e. the grader's)
            elif event in ("os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.chmod", "shutil.rmtree"):
                if isinstance(args[0], (str, bytes)) and _outside(os.fsdecode(args[0]), writable):
                    record("write", os.fsdecode(args[0]))
            elif event in ("os.kill", "os.killpg") and args[0] not in (me, 0) and not _descendant(args[0], me):
                record("signal", f"{event}({args[0]}, {args[1]})")
            elif event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn"):
                cmd = args[1] if event != "os.system" else args[0]
                text = " ".join(map(str, cmd)) if isinstance(cmd, (list, tuple)) else str(cmd)
                if any(word in text.split() for word in ("kill", "pkill", "killall")):
                    record("signal", text)
        except Exception:  # noqa: BLE001 - the hook must never break the notebook's code
            pass

    sys.addaudithook(hook)


def end_strays(keep: set) -> int:
    """Kill every process of the sandbox but this one and the kernel (and bwrap's init, which it cannot): what a
    cell left behind, a fork bomb's processes first of all. Returns how many were killed."""
    killed = 0
    for _ in range(50):  # a fork bomb's processes fork while they are being killed: until none is left
        strays = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in keep and int(p) != 1]
        if not strays:
            break
        for pid in strays:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
        time.sleep(0.01)
    return killed


class OutputFlood(RuntimeError):
    """Raised by a print past the notebook's output limit: the flood ends as an error of its cell, before the
    kernel's buffers fill its memory."""


def limit_output(limit: int) -> None:
    from ipykernel import iostream

    write = iostream.OutStream.write
    left = [limit]

    def capped(self, string):
        if self.name == "stdout":
            left[0] -= len(string)
            if left[0] < 0:
                raise OutputFlood(f"the notebook's output passed its limit of {limit // 1024} KB")
        return write(self, string)

    iostream.OutStream.write = capped


def kernel_main(argv: list[str]) -> None:
    install_audit_hook()
    limit_output(int(argv[0]))
    from ipykernel import kernelapp

    sys.argv = [sys.argv[0]] + argv[1:]
    kernelapp.launch_new_instance()


# -- the notebook's run ------------------------------------------------------------------------------------

def _non_dumpable() -> None:
    """The kernel runs as the same user: without this it could open /proc/<runner>/fd/1 and write results."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    except Exception:  # noqa: BLE001 - not Linux: the sandbox is not used there anyway
        pass


def _kernelspec(output_limit: int) -> None:
    folder = f"/tmp/jupyter/kernels/{KERNEL_NAME}"
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "kernel.json"), "w") as f:
        json.dump({"argv": [sys.executable, os.path.abspath(__file__), "kernel", str(output_limit), "-f",
                            "{connection_file}"],
                   "display_name": "sandboxed Python", "language": "python"}, f)
    os.environ["JUPYTER_PATH"] = "/tmp/jupyter"


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else str(value or "")


def summarize(outputs, limit: int) -> dict:
    """A cell's outputs as the grader compares them: stdout, the results' text (not of images), images, error."""
    stdout, results, images, error = [], [], 0, None
    for out in outputs:
        kind = out.get("output_type")
        if kind == "stream" and out.get("name") == "stdout":
            stdout.append(_text(out.get("text")))
        elif kind in ("execute_result", "display_data"):
            data = out.get("data") or {}
            if any(m in data for m in IMAGE_MIMES):
                images += 1
            elif "text/plain" in data:
                results.append(_text(data["text/plain"]))
        elif kind == "error":
            error = {"ename": str(out.get("ename", ""))[:100], "evalue": str(out.get("evalue", ""))[:300]}
    return {"stdout": "".join(stdout)[:limit], "results": [r[:limit] for r in results[:20]], "images": images,
            "error": error}


def emit(record: dict) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def run_main() -> int:
    _non_dumpable()
    job = json.loads(sys.stdin.read(1 << 20))
    started = time.monotonic()
    deadline = started + float(job["deadline"])
    cell_timeout = float(job["cell_timeout"])
    output_limit, text_limit = int(job["output_limit"]), int(job["text_limit"])
    _kernelspec(output_limit)
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    class CappedClient(NotebookClient):
        """Keeps at most ``output_limit`` bytes of the notebook's output; drops the rest, and says so."""
        kept = 0
        flooded = False
        timed_out = False

        async def _async_handle_timeout(self, timeout, cell=None):
            self.timed_out = True
            return await super()._async_handle_timeout(timeout, cell)

        def output(self, outs, msg, display_id, cell_index):
            size = len(json.dumps(msg.get("content", {})))
            if self.kept + size > output_limit:
                self.flooded = True
                return None
            self.kept += size
            return super().output(outs, msg, display_id, cell_index)

    nb = nbformat.read(job["notebook"], as_version=4)
    client = CappedClient(nb, timeout=cell_timeout, kernel_name=KERNEL_NAME, allow_errors=True,
                          interrupt_on_timeout=True, record_timing=False, iopub_timeout=2,
                          error_on_timeout={"ename": "CellTimeoutError", "evalue": "time limit", "traceback": []}, resources={"metadata": {"path": os.getcwd()}})
    stopped = None  # why the remaining cells and tests were not run

    def kernel_exit() -> str | None:
        process = getattr(getattr(client.km, "provisioner", None), "process", None)
        code = process.poll() if process is not None else None
        if code is None:
            return None
        return signal.Signals(-code).name if code < 0 and -code in signal.Signals._value2member_map_ else str(code)

    def responsive() -> bool:
        """After an interrupt: does the kernel run a cell again (or is the notebook's code ignoring it)?"""
        probe = nbformat.v4.new_code_cell("pass")
        nb.cells.append(probe)
        client.timeout, client.timed_out = PROBE_TIMEOUT, False
        try:
            client.execute_cell(probe, len(nb.cells) - 1)
        except (CellTimeoutError, DeadKernelError):
            return False
        return not client.timed_out

    def run_cell(cell, index: int) -> dict:
        nonlocal stopped
        left = deadline - time.monotonic()
        if stopped or left < 1:
            stopped = stopped or "the notebook's time limit was reached"
            return {"status": "not_run", "why": stopped}
        client.timeout = max(1, int(min(cell_timeout, left)))
        began = time.monotonic()
        status, why = "ok", None
        client.timed_out = False
        try:
            client.execute_cell(cell, index)
        except CellTimeoutError:  # not expected (interrupt_on_timeout): the kernel is left as it is
            client.timed_out = True
        except DeadKernelError:
            exited = kernel_exit()
            status, why = "died", "the kernel died" + (f" ({exited})" if exited else "")
            stopped = f"the kernel died in cell {index + 1}" + (f" ({exited})" if exited else "")
        process = getattr(getattr(client.km, "provisioner", None), "process", None)
        if process is not None and os.getpid() != 1:
            end_strays({os.getpid(), process.pid})
        summary = summarize(cell.get("outputs", []), text_limit)
        if client.timed_out:
            status, why = "timeout", f"ran past its time limit of {client.timeout} s and was interrupted"
            if not responsive():
                stopped = f"cell {index + 1} ran past its time limit and did not stop when interrupted"
        elif status == "ok" and summary["error"]:
            status = "error"
        return {"status": status, "why": why, "seconds": round(time.monotonic() - began, 3), **summary}

    try:
        with client.setup_kernel(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL):
            for index, cell in list(enumerate(nb.cells)):  # the tests are appended
                if cell.cell_type == "code" and cell.source.strip():
                    emit({"kind": "cell", "cell": index + 1, **run_cell(cell, index)})
            for test in job.get("tests", []):
                cell = nbformat.v4.new_code_cell(test["code"])
                nb.cells.append(cell)
                result = run_cell(cell, len(nb.cells) - 1)
                emit({"kind": "test", "id": test["id"], "status": result["status"], "why": result["why"],
                      "error": result.get("error")})
    except Exception as exc:  # noqa: BLE001 - e.g. the kernel never started: the grader reports it
        emit({"kind": "failure", "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    emit({"kind": "end", "seconds": round(time.monotonic() - started, 3), "flooded": client.flooded,
          "output_bytes": client.kept, "stopped": stopped})
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "kernel":
        kernel_main(sys.argv[2:])
    else:
        raise SystemExit(run_main())
