"""Grade a file or a folder of notebooks, resumably, a few at a time, and stop cleanly when asked.

Each submission's JSON is written as soon as it is graded. On the next run, a
submission whose JSON exists, is final (not an ``error``) and was made from the
same notebook bytes (SHA-256) with the same rubric is not graded again, unless
``force``. The gradebook and the summary are always rebuilt from all results.

At most ``jobs`` notebooks are graded at once; the others wait, not started. Their model
requests go through a ``pace.ClusterPace``, which sends each model no more than its servers
can serve. Setting the ``stop`` event (Ctrl-C in the command line, the stop button of the
web interface) ends a batch within seconds: no other notebook is started, the requests in
flight are cancelled (their streams closed, so the decode servers free their slots) and the
notebooks' re-runs in the sandbox are ended, a
notebook whose grading was cut short is not written (it is graded on the next run), and the
reports are rebuilt from what was graded.
"""
from __future__ import annotations

import queue
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from ..errors import GradingError, GradingStopped
from .grader import FINAL_STATUSES, failed_result, grade_notebook
from ..kv.fingerprint import sha256_of
from .notebook import Submission, submission_name
from .options import GradingOptions
from .pace import ClusterPace
from .report import read_result, result_paths, write_batch_reports, write_result
from .rubric import Rubric, load_rubric
from .sandbox import end_all

TICK = 0.5        # s: how often a running batch redraws its progress, looks at the servers and at ``stop``
STOP_GRACE = 3.0  # s: how long a stopping batch waits for the notebooks whose requests it cancelled (a
#                   stream ends at its next token; a request in prefill ends when that does, not waited for)


def find_notebooks(target) -> tuple[list[Path], Path | None]:
    """The ``.ipynb`` files of a file, a folder (recursively; checkpoints and hidden folders skipped) or a
    list of files, and the folder that submission names are relative to (None for files)."""
    if isinstance(target, (list, tuple)):
        paths = [Path(p) for p in target]
        for p in paths:
            if not p.is_file():
                raise GradingError(f"no such file: {p}")
        return paths, None
    target = Path(target)
    if target.is_file():
        return [target], None
    if target.is_dir():
        found = sorted(p for p in target.rglob("*.ipynb")
                       if not any(part.startswith(".") for part in p.relative_to(target).parts))
        return found, target
    raise GradingError(f"no such file or folder: {target}")


def up_to_date(json_path: Path, notebook: Path, rubric: Rubric) -> dict | None:
    """The earlier result if it still stands for this notebook and rubric, else None."""
    old = read_result(json_path)
    if not old or old.get("status") not in FINAL_STATUSES:
        return None
    sha = old.get("submission", {}).get("sha256")
    if not sha or old.get("rubric", {}).get("fingerprint") != rubric.fingerprint:
        return None
    try:
        return old if sha == sha256_of(notebook) else None
    except OSError:
        return None


def pending(target, rubric: Rubric, out_dir) -> list[Path]:
    """The notebooks under ``target`` that a (non-forced) ``grade_batch`` would send to the models' cluster."""
    notebooks, root = find_notebooks(target)
    return [p for p in notebooks
            if up_to_date(result_paths(out_dir, submission_name(p, root))[0], p, rubric) is None]


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


@dataclass(frozen=True)
class BatchProgress:
    """Where a batch stands: every notebook is waiting (not started), grading, or done (graded in this
    run or kept from an earlier one). ``name``/``status`` say what just happened (None on a periodic
    update); ``eta_s`` is the time left at the rate measured in this run (None until one is graded)."""

    total: int
    waiting: int
    grading: int
    done: int
    kept: int
    elapsed_s: float
    eta_s: float | None
    name: str | None = None
    status: str | None = None
    stopping: bool = False
    final: bool = False  # the batch has ended (finished or stopped)

    def describe(self) -> str:
        line = f"{self.done}/{self.total} done, {self.grading} grading, {self.waiting} waiting; " \
               f"{_duration(self.elapsed_s)}"
        if self.stopping:
            line += ", stopping"
        elif self.eta_s is not None and not self.final:
            line += f", about {_duration(self.eta_s)} left"
        if self.name:
            line += f" | {self.name}: {self.status}"
        return line


class StderrProgress:
    """A progress line on stderr: redrawn in place on a terminal (also between notebooks, so that the
    time and the estimate move), one line per notebook started or finished otherwise."""

    def __init__(self, stream=None, width: int = 24):
        self.stream, self.width = stream or sys.stderr, width
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def __call__(self, p: BatchProgress) -> None:
        if not self.tty and p.name is None and not p.final:
            return
        filled = int(self.width * p.done / p.total) if p.total else self.width
        line = f"[{'#' * filled}{'-' * (self.width - filled)}] {p.describe()}"
        if self.tty:
            self.stream.write("\r\033[K" + line + ("\n" if p.final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


class ServerWatch:
    """The servers the client marks down during a batch (``client.status()``, read at every tick)."""

    def __init__(self, client, started: float):
        self.client, self.started = client, started
        self.marked_down: list[dict] = []
        self._up = self._read()

    def _read(self) -> dict:
        try:
            return {s["name"]: (bool(s.get("up")), s.get("last_error")) for s in self.client.status()}
        except Exception:  # noqa: BLE001 - a client without status: nothing to watch
            return {}

    def poll(self) -> None:
        now, at = self._read(), round(time.monotonic() - self.started, 1)
        for name, (up, error) in now.items():
            was_up = self._up.get(name, (up, None))[0]
            if was_up and not up:
                self.marked_down.append({"server": name, "at_s": at, "error": error, "up_again_at_s": None})
            elif up and not was_up:
                for event in self.marked_down:
                    if event["server"] == name and event["up_again_at_s"] is None:
                        event["up_again_at_s"] = at
        self._up = now


class _NotebookRequests:
    """The pace as one notebook's client: remembers whether one of its requests was stopped."""

    def __init__(self, pace: ClusterPace):
        self.pace, self.stopped = pace, False
        self.config = getattr(pace.client, "config", None)

    def generate_many(self, requests_: list[dict], max_workers=None) -> tuple[list, dict]:
        results, combined = self.pace.generate_many(requests_)
        self.stopped = self.stopped or any(isinstance(r, GradingStopped) for r in results)
        return results, combined


@dataclass
class BatchResult:
    results: list = field(default_factory=list)   # in the notebooks' order; only those with a result
    summary: dict = field(default_factory=dict)
    out_dir: Path | None = None
    graded: list = field(default_factory=list)     # names graded in this run
    resumed: list = field(default_factory=list)    # names whose earlier result was kept
    not_graded: list = field(default_factory=list)  # names left for the next run (the batch was stopped)
    stopped: bool = False

    def describe_stop(self) -> str:
        """The line a stopped batch ends with: what was graded, and how to go on."""
        return (f"stopped: {len(self.graded)} notebooks graded in this run, {len(self.resumed)} kept from an "
                f"earlier run, {len(self.not_graded)} not graded; run the same command again to grade the rest "
                f"(graded notebooks are kept)")


def grade_batch(target, rubric, client, out_dir, options: GradingOptions | None = None, *, force: bool = False,
                progress=None, jobs: int = 1, stop: threading.Event | None = None) -> BatchResult:
    """Grade every notebook under ``target`` into ``out_dir``, ``jobs`` notebooks at a time.

    ``progress(BatchProgress)`` is called from the calling thread when a notebook starts or ends and
    every ``TICK`` seconds between (``StderrProgress()`` draws it). Results are in the notebooks'
    order whatever order they finish in; each is written as soon as it is graded, so a batch that
    is stopped resumes. Setting ``stop`` stops the batch (see the module's docstring): the result
    says ``stopped`` and which notebooks are ``not_graded``. An exception raised in the calling
    thread (KeyboardInterrupt, or a ``progress`` that raises) stops it the same way, then propagates.
    """
    rubric = rubric if isinstance(rubric, Rubric) else load_rubric(rubric)
    options = options or GradingOptions()
    out_dir = Path(out_dir)
    stop = stop if stop is not None else threading.Event()
    notebooks, root = find_notebooks(target)
    started, started_at = time.monotonic(), datetime.now(timezone.utc)
    batch = BatchResult(out_dir=out_dir)
    total = len(notebooks)
    results: list = [None] * total
    todo: deque = deque()
    for i, path in enumerate(notebooks):
        name = submission_name(path, root)
        old = None if force else up_to_date(result_paths(out_dir, name)[0], path, rubric)
        if old is not None:
            results[i] = old
            batch.resumed.append(name)
        else:
            todo.append((i, path, name))
    jobs = max(1, jobs)
    pace, watch = ClusterPace(client, stop), ServerWatch(client, started)
    running: dict[int, str] = {}
    finished: queue.Queue = queue.Queue()

    def report(name=None, status=None, final=False) -> None:
        if progress is None:
            return
        elapsed = time.monotonic() - started
        done = len(batch.resumed) + len(batch.graded)
        left = total - done
        eta = elapsed / len(batch.graded) * left if batch.graded and left and not stop.is_set() else None
        progress(BatchProgress(total=total, waiting=total - done - len(running), grading=len(running), done=done,
                               kept=len(batch.resumed), elapsed_s=elapsed, eta_s=eta, name=name, status=status,
                               stopping=stop.is_set() and not final, final=final))

    def grade_one(i: int, path: Path, name: str) -> None:
        requests = _NotebookRequests(pace)
        try:
            try:
                result = grade_notebook(path, rubric, requests, options, name=name)
            except Exception as exc:  # noqa: BLE001 - e.g. MemoryError reading it: this notebook fails, not the batch
                result = failed_result(Submission(path=path, name=name), rubric, options, exc, time.perf_counter())
            # cut short by the stop (a request cancelled, or failing as the stopping cluster goes away):
            # graded on the next run, not recorded as it is
            rerun_stopped = result["layers"].get("execution", {}).get("status") == "stopped"
            if requests.stopped or rerun_stopped or (stop.is_set() and result["status"] not in FINAL_STATUSES):
                finished.put((i, None))
                return
            write_result(result, out_dir)
            finished.put((i, result))
        except BaseException as exc:  # writing failed (disk full...): the batch reports it
            finished.put((i, exc))

    def collect(i: int, outcome, announce: bool = True) -> None:
        name = running.pop(i)
        if isinstance(outcome, BaseException):
            raise outcome
        if outcome is None:
            batch.not_graded.append(name)
            return
        results[i] = outcome
        batch.graded.append(name)
        if announce:
            report(name, outcome["status"])

    for name in batch.resumed:
        report(name, "kept from an earlier run")
    raised = None
    try:
        while todo or running:
            while todo and len(running) < jobs and not stop.is_set():
                i, path, name = todo.popleft()
                running[i] = name
                threading.Thread(target=grade_one, args=(i, path, name), name=f"grading-{name}",
                                 daemon=True).start()
                report(name, "grading")
            if stop.is_set():
                break
            try:
                outcome = finished.get(timeout=TICK)
            except queue.Empty:
                outcome = None
            watch.poll()
            if outcome is None:
                report()
            else:
                collect(*outcome)
    except BaseException as exc:  # KeyboardInterrupt, a progress callback's exception: stop, then re-raise
        stop.set()
        raised = exc
    if stop.is_set():
        end_all()  # the notebooks' re-runs in their sandboxes too: those notebooks are graded on the next run
        deadline = time.monotonic() + STOP_GRACE
        while running and time.monotonic() < deadline:
            try:
                i, outcome = finished.get(timeout=min(TICK, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                continue
            if isinstance(outcome, BaseException):
                raised = raised or outcome
                running.pop(i)
            else:  # after an exception the progress callback (it may be what raised) is not called again
                collect(i, outcome, announce=raised is None)
        batch.not_graded += list(running.values()) + [name for _, _, name in todo]
        batch.stopped = True
    ended, ended_at = time.monotonic(), datetime.now(timezone.utc)
    watch.poll()
    order = {submission_name(p, root): n for n, p in enumerate(notebooks)}
    batch.not_graded.sort(key=order.get)
    batch.graded.sort(key=order.get)
    batch.results = [r for r in results if r is not None]
    run = {
        "started_at": started_at.isoformat(timespec="seconds"),
        "ended_at": ended_at.isoformat(timespec="seconds"),
        "wall_time_s": round(ended - started, 3),
        "jobs": jobs,
        "graded": len(batch.graded),
        "kept": len(batch.resumed),
        "not_graded": len(batch.not_graded),
        "stopped": batch.stopped,
        "notebooks_per_minute": round(len(batch.graded) / (ended - started) * 60, 3) if batch.graded else None,
        "servers_marked_down": watch.marked_down,
        "pace": pace.snapshot(),
    }
    fresh = set(batch.graded)
    batch.summary = write_batch_reports(batch.results, out_dir, run=run,
                                        graded_now=[r for r in batch.results if r["submission"]["name"] in fresh])
    if raised is not None:
        raise raised
    report(final=True)
    return batch

