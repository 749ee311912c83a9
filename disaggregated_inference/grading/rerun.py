"""Evidence from re-running the notebook (``sandbox.py``): what fails now, what differs from the saved
outputs, whether it ran top to bottom, how long it took, how the hidden tests went, and, in words, what
the sandbox stopped it doing.

``Execution.start`` begins the run in a thread when a notebook's grading starts (it uses the CPU while
the model requests wait on the servers); ``result()`` joins it before scoring. The runner's report is
read as untrusted data: only known fields, of known types, cut to size. Cells are numbered from 1 in
notebook order, markdown cells included, as a teacher counts them (as ``evidence.py`` does).
"""
from __future__ import annotations

import math
import re
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .sandbox import ExecutionLimits, find_sandbox
from .sandbox_runner import summarize

RAN, OFF, UNAVAILABLE, FAILED, STOPPED = "ran", "off", "unavailable", "failed", "stopped"
REL_TOLERANCE, ABS_TOLERANCE = 1e-4, 1e-9   # numbers in text outputs: equal within these
_TOKEN = re.compile(r"0x[0-9a-fA-F]+|[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|\S+")
_CELL_FILE = re.compile(r"\(\d+\.py, line (\d+)\)")  # IPython's name for a cell's code differs between runs
_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?$")
FAILING = ("error", "timeout", "died")


def _s(value, limit: int = 300) -> str:
    return str(value if value is not None else "")[:limit]


def _cells(numbers) -> str:
    numbers = sorted(set(numbers))
    return ("cell " if len(numbers) == 1 else "cells ") + ", ".join(map(str, numbers))


def _same_token(a: str, b: str) -> bool:
    if a.startswith("0x") and b.startswith("0x"):  # memory addresses differ from run to run
        return True
    if _NUMBER.match(a) and _NUMBER.match(b):
        x, y = float(a), float(b)
        return math.isclose(x, y, rel_tol=REL_TOLERANCE, abs_tol=ABS_TOLERANCE) or (math.isnan(x) and math.isnan(y))
    return a == b


def text_difference(saved: str, now: str) -> str | None:
    """None when the texts agree (words equal, numbers within the tolerance), else where they first differ."""
    a, b = _TOKEN.findall(saved), _TOKEN.findall(now)
    for i, (x, y) in enumerate(zip(a, b)):
        if not _same_token(x, y):
            return f"saved {x[:40]!r}, re-run {y[:40]!r}"
    if len(a) != len(b):
        extra = (a if len(a) > len(b) else b)[min(len(a), len(b))]
        return f"the {'saved output' if len(a) > len(b) else 're-run'} goes on with {extra[:40]!r}"
    return None


def output_difference(saved: dict, now: dict) -> str | None:
    """How a cell's re-run output differs from its saved one (text, numbers, images by presence, error)."""
    if bool(saved["images"]) != bool(now["images"]):
        return "the saved output has a chart and the re-run none" if saved["images"] else \
            "the re-run draws a chart the saved output does not have"
    saved_error, error = (saved["error"] or {}).get("ename"), (now["error"] or {}).get("ename")
    if saved_error != error:
        return f"saved {saved_error or 'no error'}, re-run {error or 'no error'}"
    diff = text_difference(saved["stdout"], now["stdout"])
    if diff:
        return "printed text: " + diff
    if len(saved["results"]) != len(now["results"]):
        return f"{len(saved['results'])} results saved, {len(now['results'])} in the re-run"
    for x, y in zip(saved["results"], now["results"]):
        diff = text_difference(x, y)
        if diff:
            return "result: " + diff
    return None


@dataclass
class TestOutcome:
    id: str
    title: str
    points: float
    status: str          # passed, failed, not_run
    message: str = ""    # why it failed (its assertion message) or was not run; never its code


@dataclass
class Rerun:
    status: str                                   # ran, off, unavailable, failed, stopped
    reason: str = ""                              # why it did not run (off, unavailable, failed)
    seconds: float | None = None
    failing: list = field(default_factory=list)   # {cell, status, ename, evalue, why}
    not_run: list = field(default_factory=list)   # {cell, why}
    differs: list = field(default_factory=list)   # {cell, what}
    matched: int = 0                              # cells whose saved outputs the re-run reproduced
    tests: list = field(default_factory=list)     # TestOutcome
    incidents: list = field(default_factory=list)  # what the sandbox stopped, in words
    limits: dict = field(default_factory=dict)

    @property
    def ran(self) -> bool:
        return self.status == RAN

    @property
    def top_to_bottom(self) -> bool:
        return self.ran and not self.failing and not self.not_run

    def to_dict(self) -> dict:
        return {**asdict(self), "top_to_bottom": self.top_to_bottom, "findings": self.findings()}

    def findings(self) -> list[str]:
        """One readable line per thing a teacher should know about the re-run."""
        if not self.ran:
            return [f"not re-run: {self.reason}"]
        lines = [f"re-run in the sandbox in {self.seconds:.1f} s: "
                 + ("ran top to bottom without errors" if self.top_to_bottom else "did not run top to bottom")]
        for f in self.failing:
            lines.append(f"cell {f['cell']} fails when re-run: "
                         + (f"{f['ename']}: {f['evalue']}" if f["ename"] else f["why"]))
        if self.not_run:
            lines.append(f"not reached in the re-run: {_cells(n['cell'] for n in self.not_run)} "
                         f"({self.not_run[0]['why']})")
        for d in self.differs:
            lines.append(f"cell {d['cell']}: saved output differs from the re-run ({d['what']})")
        lines += [f"stopped by the sandbox: {i}" for i in self.incidents]
        for t in self.tests:
            lines.append(f"hidden test '{t.title}': {t.status.replace('_', ' ')}" + (f" ({t.message})" if t.message else ""))
        return lines


def not_run(rubric, status: str, reason: str) -> Rerun:
    return Rerun(status, reason, tests=[TestOutcome(t.id, t.title, t.points, "not_run", f"the notebook was not "
                                                    f"re-run ({reason})") for t in rubric.tests])


# -- what the runner reported, read as data ------------------------------------------------------------------

_SIGNALS = {"SIGXCPU": "it used up its CPU time limit", "SIGKILL": "it was killed at a limit (memory or CPU)",
            "SIGSEGV": "it crashed, typically out of memory (a flood of output does this)"}


def _cell_incident(cell: int, record: dict, limits: ExecutionLimits) -> str | None:
    ename, evalue, status = record["ename"], record["evalue"], record["status"]
    if ename == "OutputFlood":
        return f"cell {cell} flooded its output past the limit of {limits.output_kb} KB and was stopped"
    if ename == "MemoryError":  # the cause first: a cell stopped by a limit may also reach its time limit
        return f"cell {cell} allocated memory past the limit of {limits.memory_mb} MB and was stopped"
    if (ename == "BlockingIOError" and "Errno 11" in evalue) or "can't start new thread" in evalue:
        return f"cell {cell} tried to start more processes than the limit of {limits.processes} and was stopped"
    if "Network is unreachable" in evalue or ename == "gaierror":
        return f"cell {cell} tried to open a network connection and was stopped (the sandbox has no network)"
    if status == "timeout":
        return f"cell {cell} ran longer than its time limit of {limits.cell_timeout_s:g} s and was interrupted"
    if status == "died":
        cause = next((text for sig, text in _SIGNALS.items() if sig in record["why"]), "")
        return f"the notebook's kernel died in cell {cell}" + (f": {cause}" if cause else "")
    return None


def _attempt_incident(kind: str, targets: list[str]) -> str | None:
    what = ", ".join(targets[:3]) + (f" and {len(targets) - 3} more" if len(targets) > 3 else "")
    return {
        "network": f"the notebook tried to open a network connection ({what}) and was stopped: the sandbox has no "
                   f"network",
        "read": f"the notebook tried to read {what}, outside its folder, and was stopped: nothing outside its folder "
                f"is visible in the sandbox",
        "write": f"the notebook tried to write {what}, outside its folder, and was stopped: outside its folder the "
                 f"sandbox is read-only",
        "signal": f"the notebook tried to signal other processes ({what}) and was stopped: it sees only its own "
                  f"sandbox's processes",
    }.get(kind)


def read_run(raw, notebook, rubric, limits: ExecutionLimits) -> Rerun:
    """The evidence of one sandbox run (``sandbox.RawRun``) against the notebook's saved outputs."""
    if raw.cancelled:  # the batch was stopped: this notebook is graded again on the next run
        return not_run(rubric, STOPPED, "the grading was stopped")
    cells, tests, end, failure = {}, {}, None, None
    for r in raw.records:
        kind = r.get("kind")
        if kind == "cell" and isinstance(r.get("cell"), int):
            cells[r["cell"]] = r
        elif kind == "test" and isinstance(r.get("id"), str):
            tests[r["id"]] = r
        elif kind == "end":
            end = r
        elif kind == "failure":
            failure = _s(r.get("error"))
    run = Rerun(RAN, seconds=raw.seconds, limits=limits.to_dict())
    incidents: list[str] = []
    for number, cell in enumerate(notebook.cells, start=1):
        if cell.cell_type != "code" or not cell.source.strip():
            continue
        r = cells.get(number)
        if r is None:
            why = "the run was stopped before it" if (raw.killed or end is None) else "not run"
            run.not_run.append({"cell": number, "why": why})
            continue
        error = r.get("error") if isinstance(r.get("error"), dict) else {}
        record = {"status": _s(r.get("status"), 20), "why": _s(r.get("why")), "ename": _s(error.get("ename"), 100),
                  "evalue": _CELL_FILE.sub(r"(line \1)", _s(error.get("evalue")))}
        if record["status"] == "not_run":
            run.not_run.append({"cell": number, "why": record["why"]})
            continue
        if record["status"] in FAILING:
            run.failing.append({"cell": number, **record})
            incident = _cell_incident(number, record, limits)
            if incident and not ("flooded its output" in incident and any("flooded" in i for i in incidents)):
                incidents.append(incident)  # (a flood: the cells after it fail the same way; said once)
        if cell.get("execution_count") is None or record["status"] in ("timeout", "died"):
            continue  # never run before it was handed in: nothing saved to compare
        now = {"stdout": _s(r.get("stdout"), limits.text_chars), "images": int(r.get("images") or 0),
               "results": [_s(x, limits.text_chars) for x in (r.get("results") or [])[:20]
                           if isinstance(r.get("results"), list)],
               "error": error or None}
        diff = output_difference(summarize(cell.get("outputs", []), limits.text_chars), now)
        if diff:
            run.differs.append({"cell": number, "what": diff})
        else:
            run.matched += 1
    by_kind: dict[str, list[str]] = {}
    for a in raw.attempts[:50]:
        if isinstance(a, dict):
            by_kind.setdefault(_s(a.get("kind"), 20), []).append(_s(a.get("what"), 200))
    for kind, targets in by_kind.items():
        incident = _attempt_incident(kind, targets)
        if incident:
            incidents.append(incident)
    if any("network connection (" in i for i in incidents):  # the attempt says where: one line is enough
        incidents = [i for i in incidents if "network connection and was stopped" not in i]
    if isinstance(end, dict) and end.get("flooded") and not any("flooded its output" in i for i in incidents):
        incidents.append(f"the notebook flooded its output: only the first {limits.output_kb} KB were kept")
    if raw.killed:
        incidents.append(f"the notebook ran past its time limit of {limits.notebook_timeout_s:g} s and was stopped")
    elif end is None:
        incidents.append("the run ended without its report (exit code " + str(raw.exit_code) + "): the notebook's "
                         "code stopped the grader's runner inside its sandbox" + (f" ({failure})" if failure else ""))
    if raw.truncated:
        incidents.append("the run's report was too long and was cut")
    run.incidents = list(dict.fromkeys(incidents))
    for t in rubric.tests:
        r = tests.get(t.id)
        status = _s(r.get("status"), 20) if r else "not_run"
        error = r.get("error") if r and isinstance(r.get("error"), dict) else {}
        if status == "ok":
            run.tests.append(TestOutcome(t.id, t.title, t.points, "passed"))
        elif status == "error":
            ename, evalue = _s(error.get("ename"), 100), _s(error.get("evalue"))
            message = evalue if ename == "AssertionError" and evalue else \
                "the assertion failed" if ename == "AssertionError" else f"{ename}: {evalue}"
            run.tests.append(TestOutcome(t.id, t.title, t.points, "failed", message))
        else:
            why = _s(r.get("why")) if r else ("the run was stopped before the tests" if raw.killed or end is None
                                              else "not run")
            run.tests.append(TestOutcome(t.id, t.title, t.points, "not_run" if status != "timeout" else "failed",
                                         why or status))
    return run


class Execution:
    """One notebook's re-run, started when its grading starts and joined before it is scored."""

    def __init__(self, path: Path, notebook, rubric, limits: ExecutionLimits, off: str | None, name: str):
        self.path, self.notebook, self.rubric, self.limits = Path(path), notebook, rubric, limits
        self._result: Rerun | None = None
        self._thread = None
        if off:
            self._result = not_run(rubric, OFF, off)
            return
        sandbox, why = find_sandbox()
        if sandbox is None:
            self._result = not_run(rubric, UNAVAILABLE, why)
            return
        tests = [{"id": t.id, "title": t.title, "code": t.code} for t in rubric.tests]
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:80] or "notebook"

        def work():
            try:
                raw = sandbox.run(self.path, rubric.execution.data, tests, limits, name=f"{safe}.ipynb")
                self._result = read_run(raw, notebook, rubric, limits)
            except Exception as exc:  # noqa: BLE001 - the grader's own failure: this notebook is graded without
                self._result = not_run(rubric, FAILED, f"the sandbox could not be run: {type(exc).__name__}: "
                                                       f"{_s(exc, 200)}")

        self._thread = threading.Thread(target=work, name=f"sandbox-{safe}", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, sub, rubric, enabled: bool, limits: ExecutionLimits | None = None) -> "Execution":
        timeout = rubric.execution.notebook_timeout_s
        limits = limits or ExecutionLimits(cell_timeout_s=rubric.execution.cell_timeout_s, notebook_timeout_s=timeout,
                                           cpu_s=max(ExecutionLimits.cpu_s, int(timeout)))
        off = None if enabled else "execution is off (--execute off)"
        if not rubric.execution.enabled:
            off = "the rubric turns execution off"
        return cls(sub.path, sub.notebook, rubric, limits, off, sub.name)

    def result(self) -> Rerun:
        if self._thread is not None:
            self._thread.join()
        return self._result
