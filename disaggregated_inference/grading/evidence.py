"""Layer 2, the evidence: what the notebook demonstrably contains, found without any model.

``collect_evidence(notebook)`` reads every cell once (``ast`` for code, the
saved outputs for results) and ``check_criterion(criterion, evidence)`` turns a
rubric criterion's rules into pass/fail checks with a reason each. Cells are
numbered from 1 in notebook order, as a teacher counts them.
"""
from __future__ import annotations

import ast
import re
import threading
from dataclasses import asdict, dataclass, field

from .rubric import Criterion

CHART_MIME_TYPES = ("image/png", "image/jpeg", "image/svg+xml", "application/vnd.plotly.v1+json",
                    "application/vnd.vegalite.v4+json", "application/vnd.vegalite.v5+json")
PLOT_MODULE_ALIASES = ("plt", "sns", "px", "go", "alt", "matplotlib", "seaborn", "plotly")
PLOT_FUNCTIONS = {"plot", "hist", "bar", "barh", "scatter", "pie", "boxplot", "lineplot", "barplot", "histplot",
                  "heatmap", "scatterplot", "countplot", "catplot", "relplot", "displot", "pairplot", "imshow",
                  "savefig", "subplots", "figure"}
# Cell magics whose body is still Python.
PYTHON_CELL_MAGICS = {"time", "timeit", "capture", "prun"}
_MAGIC_LINE = re.compile(r"^(\s*)[%!]")
_TIMED_LINE = re.compile(r"^(\s*)%(?:time|timeit|prun)\b(?:\s+-\S+(?:\s+\d+)?)*\s+(.*)$")
_CALL_RE = re.compile(r"\b([A-Za-z_][\w.]*)\s*\(")
_IMPORT_RE = re.compile(r"^\s*(?:import\s+([\w.]+)|from\s+([\w.]+)\s+import)", re.M)
# CPython keeps the depth of the Python objects ``ast.parse`` builds in interpreter-wide state: a thread
# switch in the middle (a garbage collection running a finalizer) lets another thread's parse move it,
# and one of them fails with "SystemError: AST constructor recursion depth mismatch" (gh-106905). The
# grader collects evidence on several threads (--jobs): a notebook then came out invalid. One parse at a time.
_PARSING = threading.Lock()


@dataclass
class Check:
    rule: str
    passed: bool
    detail: str
    key: str = ""  # the rubric's evidence key it checks (imports, functions, chart, ...), or "tests"
    points: float | None = None  # a hidden test's own points (rules share the criterion's: scoring.rule_points)


@dataclass
class Evidence:
    code_cells: int = 0
    markdown_cells: int = 0
    markdown_words: int = 0
    syntax_errors: list = field(default_factory=list)     # {cell, line, message}
    error_outputs: list = field(default_factory=list)     # {cell, ename, evalue}
    unexecuted_cells: list = field(default_factory=list)  # cell numbers
    out_of_order: bool = False
    imports: list = field(default_factory=list)           # dotted module names
    calls: list = field(default_factory=list)             # dotted call expressions as written
    defined_functions: list = field(default_factory=list)
    constructs: list = field(default_factory=list)
    chart_outputs: list = field(default_factory=list)     # {cell, mime}
    plotting_calls: list = field(default_factory=list)    # {cell, call}

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def call_names(self) -> set:
        return {c.rsplit(".", 1)[-1] for c in self.calls}

    def findings(self) -> list[str]:
        """One readable line per thing a grader should know."""
        lines = [f"{self.code_cells} code cells, {self.markdown_cells} markdown cells "
                 f"({self.markdown_words} words of explanation)"]
        for e in self.syntax_errors:
            where = f"SyntaxError at line {e['line']}" if e["line"] is not None else "code"
            lines.append(f"cell {e['cell']}: {where}: {e['message']}")
        for e in self.error_outputs:
            lines.append(f"cell {e['cell']}: raised {e['ename']}: {e['evalue']}")
        if self.unexecuted_cells:
            lines.append("never run: " + _cells([{"cell": n} for n in self.unexecuted_cells]))
        if self.out_of_order:
            lines.append("cells were run out of order (execution counts not increasing)")
        lines.append("imports: " + (", ".join(self.imports) or "none"))
        if self.chart_outputs:
            lines.append("chart output in " + _cells(self.chart_outputs))
        elif self.plotting_calls:
            lines.append("plotting code in " + _cells(self.plotting_calls) + " but no chart output")
        else:
            lines.append("no chart")
        return lines


def _cells(items) -> str:
    """'cell 3' or 'cells 3, 5' for items with a "cell" number."""
    numbers = sorted({item["cell"] for item in items})
    return ("cell " if len(numbers) == 1 else "cells ") + ", ".join(map(str, numbers))


def _python_source(source: str) -> str | None:
    """The cell as Python: magic and shell lines blanked (line numbers kept); None for non-Python cells."""
    lines = source.splitlines()
    if lines and lines[0].lstrip().startswith("%%"):
        magic = lines[0].lstrip()[2:].split()[0] if lines[0].strip() != "%%" else ""
        if magic not in PYTHON_CELL_MAGICS:
            return None
        lines = [""] + lines[1:]
    out = []
    for line in lines:
        timed = _TIMED_LINE.match(line)
        if timed and timed.group(2).strip():  # "%time x = f()" still runs "x = f()"
            out.append(timed.group(1) + timed.group(2))
            continue
        m = _MAGIC_LINE.match(line)
        out.append(f"{m.group(1)}pass" if m else line)
    return "\n".join(out)


def _dotted(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    if isinstance(node, ast.Call):  # df.groupby(...).sum() -> "groupby().sum" keeps the method name
        inner = _dotted(node.func)
        return ".".join([inner + "()" if inner else "()"] + list(reversed(parts)))
    return ".".join(reversed(parts)) if parts else None


_CONSTRUCT_NODES = {
    "function_def": (ast.FunctionDef, ast.AsyncFunctionDef),
    "class_def": (ast.ClassDef,),
    "loop": (ast.For, ast.While, ast.AsyncFor),
    "comprehension": (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp),
    "conditional": (ast.If, ast.IfExp),
    "lambda": (ast.Lambda,),
    "try": (ast.Try,) + ((ast.TryStar,) if hasattr(ast, "TryStar") else ()),
    "with": (ast.With, ast.AsyncWith),
    "fstring": (ast.JoinedStr,),
}


def _is_plotting(call: str) -> bool:
    head, _, _ = call.partition(".")
    return head in PLOT_MODULE_ALIASES or call.rsplit(".", 1)[-1] in PLOT_FUNCTIONS


def _walk(tree) -> list:
    """Every node with its dotted call name (calls only): done up front, so that a tree too deep to walk
    fails here, inside the parse's error handling, and the cell counts as unparseable."""
    return [(node, _dotted(node.func) if isinstance(node, ast.Call) else None) for node in ast.walk(tree)]


def parse_python(source: str) -> ast.AST:
    """``ast.parse(source)``, one thread at a time (``_PARSING``)."""
    with _PARSING:
        return ast.parse(source)


def collect_evidence(notebook) -> Evidence:
    ev = Evidence()
    imports, calls, defined, constructs = set(), [], set(), set()
    plotting: list = []
    last_count = 0
    for number, cell in enumerate(notebook.cells, start=1):
        if cell.cell_type == "markdown":
            ev.markdown_cells += 1
            ev.markdown_words += len(re.findall(r"[A-Za-z]{2,}", cell.source))
            continue
        if cell.cell_type != "code":
            continue
        ev.code_cells += 1
        source = cell.source
        if source.strip():
            count = cell.get("execution_count")
            if count is None:
                ev.unexecuted_cells.append(number)
            else:
                if count <= last_count:
                    ev.out_of_order = True
                last_count = count
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                ev.error_outputs.append({"cell": number, "ename": output.get("ename", ""),
                                         "evalue": str(output.get("evalue", ""))[:200]})
            for mime in output.get("data", {}) or {}:
                if mime in CHART_MIME_TYPES:
                    ev.chart_outputs.append({"cell": number, "mime": mime})
        python = _python_source(source)
        if python is None or not python.strip():
            continue
        cell_calls: list[str] = []
        try:
            tree = parse_python(python)
            walked = _walk(tree)
        except SyntaxError as exc:
            tree = None
            ev.syntax_errors.append({"cell": number, "line": exc.lineno, "message": exc.msg})
        except (ValueError, MemoryError, RecursionError) as exc:  # null bytes; crafted, deeply nested code
            tree = None
            ev.syntax_errors.append({"cell": number, "line": None,
                                     "message": f"cannot be parsed ({type(exc).__name__}: {str(exc)[:80]})"})
        if tree is None:
            # the cell still shows intent: find imports and calls by pattern
            for a, b in _IMPORT_RE.findall(python):
                imports.add(a or b)
            cell_calls = _CALL_RE.findall(python)
        else:
            for node, name in walked:
                if isinstance(node, ast.Import):
                    imports.update(alias.name for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    imports.add(node.module)
                    imports.update(f"{node.module}.{alias.name}" for alias in node.names if alias.name != "*")
                elif isinstance(node, ast.Call) and name:
                    cell_calls.append(name)
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    defined.add(node.name)
                for kind, types in _CONSTRUCT_NODES.items():
                    if isinstance(node, types):
                        constructs.add(kind)
        calls.extend(cell_calls)
        plotting.extend({"cell": number, "call": c} for c in cell_calls if _is_plotting(c))
    ev.imports = sorted(imports)
    ev.calls = sorted(set(calls))
    ev.defined_functions = sorted(defined)
    ev.constructs = sorted(constructs)
    for item in plotting:
        if item not in ev.plotting_calls:
            ev.plotting_calls.append(item)
    return ev


def _has_import(ev: Evidence, module: str) -> bool:
    return any(name == module or name.startswith(module + ".") for name in ev.imports)


def _has_function(ev: Evidence, name: str) -> bool:
    if "." in name:
        return any(c == name or c.endswith("." + name) for c in ev.calls)
    return name in ev.call_names or name in ev.defined_functions


def check_criterion(criterion: Criterion, ev: Evidence, rerun=None) -> list[Check]:
    """The rubric's evidence rules for one criterion, each checked against the notebook; with ``rerun``
    (``rerun.Rerun``) ``runs_clean`` and ``executed`` are judged by the re-run, and the criterion's hidden
    tests are checks too (their points their own)."""
    rules = criterion.evidence
    checks: list[Check] = []

    def add(key: str, rule: str, passed: bool, detail: str) -> None:
        checks.append(Check(rule, passed, detail, key))

    for module in rules.imports:
        found = _has_import(ev, module)
        add("imports", f"imports {module}", found, f"{module} is imported" if found else f"{module} is never imported")
    for name in rules.functions:
        found = _has_function(ev, name)
        add("functions", f"uses {name}", found,
            f"{name} is used" if found else f"{name} is never called or defined")
    for kind in rules.constructs:
        found = kind in ev.constructs
        add("constructs", f"has {kind}", found, f"a {kind} is present" if found else f"no {kind} in the code")
    if rules.chart:
        if ev.chart_outputs:
            add("chart", "chart", True, "chart output in " + _cells(ev.chart_outputs))
        elif ev.plotting_calls:
            add("chart", "chart", False, "plotting code in " + _cells(ev.plotting_calls)
                + " but no chart in the saved outputs (not run, or it failed)")
        else:
            add("chart", "chart", False, "no chart: no chart output and no plotting code")
    if rules.runs_clean and rerun is not None and rerun.ran:
        problems = [f"cell {e['cell']}: SyntaxError" for e in ev.syntax_errors]
        for f in rerun.failing:
            if not any(p.startswith(f"cell {f['cell']}:") for p in problems):
                problems.append(f"cell {f['cell']}: " + (f["ename"] or f["status"]) + " when re-run")
        if rerun.not_run:
            problems.append("not reached when re-run: " + _cells(rerun.not_run))
        add("runs_clean", "runs without errors", not problems,
            "re-run top to bottom without errors" if not problems else "; ".join(problems))
    elif rules.runs_clean:
        problems = [f"cell {e['cell']}: SyntaxError" for e in ev.syntax_errors]
        for e in ev.error_outputs:  # a SyntaxError cell that was run also has an error output: say it once
            if f"cell {e['cell']}: {e['ename']}" not in problems:
                problems.append(f"cell {e['cell']}: {e['ename']}")
        add("runs_clean", "runs without errors", not problems,
            "no syntax errors or error outputs" if not problems else "; ".join(problems))
    if rules.executed and rerun is not None and rerun.ran:
        problems = ["never run: " + _cells([{"cell": n} for n in ev.unexecuted_cells])] if ev.unexecuted_cells else []
        if rerun.differs:
            problems.append("saved outputs differ from a re-run: " + _cells(rerun.differs))
        add("executed", "all cells executed", not problems, "every code cell was run and its saved outputs match a "
            "re-run" if not problems else "; ".join(problems))
    elif rules.executed:
        missing = ev.unexecuted_cells
        add("executed", "all cells executed", not missing, "every code cell was run" if not missing
            else "never run: " + _cells([{"cell": n} for n in missing]))
    if rules.markdown_words:
        ok = ev.markdown_words >= rules.markdown_words
        add("markdown_words", f"at least {rules.markdown_words} words of explanation", ok,
            f"{ev.markdown_words} words of markdown" + ("" if ok else f", fewer than {rules.markdown_words}"))
    if rerun is not None:
        outcomes = {t.id: t for t in rerun.tests}
        for test in criterion.tests:
            t = outcomes.get(test.id)
            status, message = (t.status, t.message) if t else ("not_run", "no result")
            detail = "passed" if status == "passed" else f"{status.replace('_', ' ')}: {message}"
            checks.append(Check(f"hidden test: {test.title}", status == "passed", detail, "tests", test.points))
    return checks


def check_rubric(rubric, ev: Evidence, rerun=None) -> dict[str, list[Check]]:
    """Every criterion's checks; without ``rerun`` (before the re-run is in) no hidden test is among them."""
    return {c.id: check_criterion(c, ev, rerun) for c in rubric.criteria}
