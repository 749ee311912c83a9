"""Grade a file or a folder of notebooks, resumably.

Each submission's JSON is written as soon as it is graded. On the next run, a
submission whose JSON exists, is final (not an ``error``) and was made from the
same notebook bytes (SHA-256) with the same rubric is not graded again, unless
``force``. The gradebook and the summary are always rebuilt from all results.
"""
from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import GradingError
from .grader import FINAL_STATUSES, failed_result, grade_notebook
from ..kv.fingerprint import sha256_of
from .notebook import Submission, submission_name
from .options import GradingOptions
from .report import read_result, result_paths, write_batch_reports, write_result
from .rubric import Rubric, load_rubric


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


class StderrProgress:
    """A one-line progress bar on stderr (a line per submission when stderr is not a terminal)."""

    def __init__(self, stream=None, width: int = 24):
        self.stream, self.width = stream or sys.stderr, width
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.started = time.monotonic()

    def __call__(self, done: int, total: int, name: str, status: str) -> None:
        filled = int(self.width * done / total) if total else self.width
        bar = "#" * filled + "-" * (self.width - filled)
        line = f"[{bar}] {done}/{total} {name}: {status} ({time.monotonic() - self.started:.0f}s)"
        if self.tty:
            self.stream.write("\r\033[K" + line + ("\n" if done == total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


@dataclass
class BatchResult:
    results: list = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    out_dir: Path | None = None
    graded: list = field(default_factory=list)    # names graded in this run
    resumed: list = field(default_factory=list)   # names whose earlier result was kept


def grade_batch(target, rubric, client, out_dir, options: GradingOptions | None = None, *, force: bool = False,
                progress=None, jobs: int = 1) -> BatchResult:
    """Grade every notebook under ``target`` into ``out_dir``, ``jobs`` notebooks at a time.

    ``progress(done, total, name, status)`` is called before (status "grading")
    and after each submission, always from the calling thread; ``StderrProgress()``
    draws a bar. Results are in the notebooks' order whatever order they finish in;
    each is written as soon as it is graded, so an interrupted batch resumes.
    """
    rubric = rubric if isinstance(rubric, Rubric) else load_rubric(rubric)
    options = options or GradingOptions()
    out_dir = Path(out_dir)
    notebooks, root = find_notebooks(target)
    batch = BatchResult(out_dir=out_dir)
    total = len(notebooks)
    results: list = [None] * total
    todo = []
    done = 0
    for i, path in enumerate(notebooks):
        name = submission_name(path, root)
        json_path, _ = result_paths(out_dir, name)
        old = None if force else up_to_date(json_path, path, rubric)
        if old is not None:
            results[i] = old
            batch.resumed.append(name)
            done += 1
            if progress:
                progress(done, total, name, f"{old['status']} (earlier run)")
        else:
            todo.append((i, path, name))

    def one(path, name) -> dict:
        try:
            result = grade_notebook(path, rubric, client, options, name=name)
        except Exception as exc:  # noqa: BLE001 - e.g. MemoryError reading it: this notebook fails, not the batch
            result = failed_result(Submission(path=path, name=name), rubric, options, exc, time.perf_counter())
        write_result(result, out_dir)
        return result

    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(todo) or 1))) as pool:
        futures = {}
        for i, path, name in todo:
            if progress:
                progress(done, total, name, "grading")
            futures[pool.submit(one, path, name)] = (i, name)
        for future in as_completed(futures):
            i, name = futures[future]
            results[i] = future.result()
            done += 1
            if progress:
                progress(done, total, name, results[i]["status"])
    batch.results = results
    batch.graded = [name for _, _, name in todo]
    batch.summary = write_batch_reports(batch.results, out_dir, skipped=len(batch.resumed))
    return batch
