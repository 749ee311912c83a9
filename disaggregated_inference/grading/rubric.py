"""The rubric: what a submission is graded on, loaded from YAML or JSON and validated once.

A rubric file looks like (``examples/rubric.yaml``)::

    title: Sales analysis
    assignment: Load sales.csv with pandas, ...      # shown to the models
    missing_evidence_cap: 0.5                       # optional; see below
    criteria:
      - id: visualisation
        title: Chart of revenue
        description: A labelled chart of revenue by region.
        points: 10
        evidence:                                   # optional, all keys optional
          imports: [matplotlib]                     # modules imported (prefix match)
          functions: [groupby, plot]                # called or defined ("pd.read_csv" matches dotted)
          constructs: [function_def]                # from CONSTRUCTS
          chart: true                               # a chart output is in the notebook
          runs_clean: true                          # no syntax errors, no error outputs (re-run: no cell fails)
          executed: true                            # every code cell was run (re-run: and its saved outputs
                                                    # match the re-run's, numbers within 1e-4, charts by presence)
          markdown_words: 40                        # at least this many words of explanation
          points: {chart: 6}                        # optional: points of a rule (the rest share the rest)
        model_band: 0.25                            # optional; see below
        tests:                                      # optional: hidden tests, run after the notebook in its kernel
          - title: South's revenue is 825           # the only part of a test a report shows
            points: 4                               # earned when it passes (part of the criterion's points)
            code: assert by_region["South"] == 825, "South's revenue should be 825"
    execution:                                      # optional: re-running each notebook in a sandbox
      enabled: true                                 # false: grade from the saved outputs only
      data: [notebooks/sales.csv]                   # files (or folders' files) copied beside each notebook,
                                                    # relative to the rubric file
      cell_timeout: 30                              # seconds per cell
      timeout: 120                                  # seconds for the whole notebook and its tests

The score starts from the evidence (``scoring.py``): each rule met earns its
points (by default an equal share of the criterion's points); a criterion
without rules starts at ``no_evidence_share`` of its points (default 0.5). A
criterion whose evidence rules are not all met can score at most
``missing_evidence_cap`` of its points (default 0.5). The code-analysis model
may move a criterion's score by at most ``model_band`` of its points (default
0.25), never above that cap. The three keys may be set per criterion or for the
rubric. A criterion's hidden tests have points of their own, out of the criterion's
points (the evidence rules share the rest): a passing test earns them, a failing one
loses them and no more. Every problem raises one ``RubricError`` naming the file and the key.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import RubricError

# Syntactic constructs a rule may require; evidence.py finds them with ast.
CONSTRUCTS = ("function_def", "class_def", "loop", "comprehension", "conditional", "lambda", "try", "with",
              "fstring")
DEFAULT_MISSING_EVIDENCE_CAP = 0.5
DEFAULT_MODEL_BAND = 0.25
DEFAULT_NO_EVIDENCE_SHARE = 0.5
_SHARES = ("missing_evidence_cap", "model_band", "no_evidence_share")  # fractions of a criterion's points
_ID = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")
_TOP_KEYS = {"title", "assignment", "description", "criteria", "execution", *_SHARES}
_CRITERION_KEYS = {"id", "title", "description", "points", "evidence", "tests", *_SHARES}
_TEST_KEYS = {"title", "points", "code"}
_EXECUTION_KEYS = {"enabled", "data", "cell_timeout", "timeout"}
_RULE_KEYS = ("imports", "functions", "constructs", "chart", "runs_clean", "executed", "markdown_words")
_EVIDENCE_KEYS = {*_RULE_KEYS, "points"}


@dataclass(frozen=True)
class EvidenceRules:
    imports: tuple[str, ...] = ()
    functions: tuple[str, ...] = ()
    constructs: tuple[str, ...] = ()
    chart: bool = False
    runs_clean: bool = False
    executed: bool = False
    markdown_words: int = 0
    points: tuple[tuple[str, float], ...] = ()  # (rule key, points) for the rules given points

    @property
    def empty(self) -> bool:
        return self == EvidenceRules()


@dataclass(frozen=True)
class HiddenTest:
    id: str          # "<criterion id>-<n>", n from 1
    title: str
    points: float
    code: str        # never shown in a report


@dataclass(frozen=True)
class Execution:
    """How notebooks of this assignment are re-run (``sandbox.py``)."""
    enabled: bool = True
    data: tuple[str, ...] = ()       # absolute paths of the files copied beside each notebook
    cell_timeout_s: float = 30.0
    notebook_timeout_s: float = 120.0


@dataclass(frozen=True)
class Criterion:
    id: str
    title: str
    description: str
    points: float
    evidence: EvidenceRules = field(default_factory=EvidenceRules)
    missing_evidence_cap: float = DEFAULT_MISSING_EVIDENCE_CAP
    model_band: float = DEFAULT_MODEL_BAND
    no_evidence_share: float = DEFAULT_NO_EVIDENCE_SHARE
    tests: tuple[HiddenTest, ...] = ()

    @property
    def test_points(self) -> float:
        return float(sum(t.points for t in self.tests))


@dataclass(frozen=True)
class Rubric:
    title: str
    assignment: str
    criteria: tuple[Criterion, ...]
    source: str = "<dict>"
    execution: Execution = field(default_factory=Execution)

    @property
    def tests(self) -> list[HiddenTest]:
        return [t for c in self.criteria for t in c.tests]

    @property
    def max_points(self) -> float:
        return float(sum(c.points for c in self.criteria))

    @property
    def ids(self) -> list[str]:
        return [c.id for c in self.criteria]

    def criterion(self, criterion_id: str) -> Criterion:
        for c in self.criteria:
            if c.id == criterion_id:
                return c
        raise KeyError(criterion_id)

    def to_dict(self) -> dict:
        return {"title": self.title, "assignment": self.assignment,
                "criteria": [{**asdict(c), "evidence": {k: list(v) if isinstance(v, tuple) else v
                                                        for k, v in asdict(c.evidence).items()},
                              "tests": [asdict(t) for t in c.tests]}
                             for c in self.criteria],
                # the data files by name: moving the rubric's folder does not make its grades stale
                "execution": {**asdict(self.execution), "data": [Path(p).name for p in self.execution.data]}}

    @property
    def fingerprint(self) -> str:
        """A hash of the rubric's content: a changed rubric means earlier grades are stale."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


def _fail(source: str, where: str, message: str):
    raise RubricError(f"{source}: {where} {message}", field=where)


def _check_unknown(obj: dict, allowed: set, where: str, source: str) -> None:
    for key in obj:
        if key not in allowed:
            _fail(source, f"{where}.{key}" if where else str(key),
                  f"is not a known key (expected one of: {', '.join(sorted(allowed))})")


def _text(obj: dict, key: str, where: str, source: str, required: bool, default: str = "") -> str:
    value = obj.get(key, None)
    if value is None:
        if required:
            _fail(source, f"{where}.{key}" if where else key, "is required")
        return default
    if not isinstance(value, str) or (required and not value.strip()):
        _fail(source, f"{where}.{key}" if where else key, f"must be a non-empty string, got {json.dumps(value)}")
    return value.strip()


def _number(value, where: str, source: str, low: float, high: float, low_open: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and value <= high
    if not ok:
        bound = f"{'>' if low_open else '>='} {low:g} and <= {high:g}"
        _fail(source, where, f"must be a number {bound}, got {json.dumps(value)}")
    return float(value)


def _names(value, where: str, source: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        _fail(source, where, f"must be a list of names, got {json.dumps(value)}")
    return tuple(v.strip() for v in value)


def _evidence(raw, where: str, source: str) -> EvidenceRules:
    if raw is None:
        return EvidenceRules()
    if not isinstance(raw, dict):
        _fail(source, where, f"must be a mapping, got {type(raw).__name__}")
    _check_unknown(raw, _EVIDENCE_KEYS, where, source)
    kwargs = {}
    for key in ("imports", "functions", "constructs"):
        if key in raw:
            kwargs[key] = _names(raw[key], f"{where}.{key}", source)
    for name in kwargs.get("constructs", ()):
        if name not in CONSTRUCTS:
            _fail(source, f"{where}.constructs", f"has unknown construct {name!r} (known: {', '.join(CONSTRUCTS)})")
    for key in ("chart", "runs_clean", "executed"):
        if key in raw:
            if not isinstance(raw[key], bool):
                _fail(source, f"{where}.{key}", f"must be true or false, got {json.dumps(raw[key])}")
            kwargs[key] = raw[key]
    if "markdown_words" in raw:
        value = raw["markdown_words"]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            _fail(source, f"{where}.markdown_words", f"must be a whole number >= 0, got {json.dumps(value)}")
        kwargs["markdown_words"] = value
    if "points" in raw:
        kwargs["points"] = _rule_points(raw["points"], kwargs, f"{where}.points", source)
    return EvidenceRules(**kwargs)


def _rule_points(raw, rules: dict, where: str, source: str) -> tuple[tuple[str, float], ...]:
    if not isinstance(raw, dict) or not raw:
        _fail(source, where, f"must be a mapping of evidence rules to points, got {json.dumps(raw)}")
    out = []
    for key, value in raw.items():
        if not rules.get(key):
            _fail(source, f"{where}.{key}", f"gives points to a rule this criterion does not have "
                                            f"(its rules: {', '.join(k for k in _RULE_KEYS if rules.get(k))})")
        out.append((key, _number(value, f"{where}.{key}", source, 0, 1000)))
    return tuple(out)


def _tests(raw, cid: str, where: str, source: str) -> tuple[HiddenTest, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw:
        _fail(source, where, "must be a non-empty list of tests (title, points, code)")
    tests = []
    for n, item in enumerate(raw, start=1):
        at = f"{where}[{n - 1}]"
        if not isinstance(item, dict):
            _fail(source, at, f"must be a mapping, got {type(item).__name__}")
        _check_unknown(item, _TEST_KEYS, at, source)
        if "points" not in item:
            _fail(source, f"{at}.points", "is required")
        code = _text(item, "code", at, source, required=True)
        try:
            compile(code, f"{source}: {at}.code", "exec")
        except SyntaxError as exc:
            _fail(source, f"{at}.code", f"is not valid Python: {exc.msg} at line {exc.lineno}")
        tests.append(HiddenTest(id=f"{cid}-{n}", title=_text(item, "title", at, source, required=True),
                                points=_number(item["points"], f"{at}.points", source, 0, 1000), code=code))
    return tuple(tests)


def _execution(raw, source: str) -> Execution:
    if raw is None:
        return Execution()
    if not isinstance(raw, dict):
        _fail(source, "execution", f"must be a mapping, got {type(raw).__name__}")
    _check_unknown(raw, _EXECUTION_KEYS, "execution", source)
    enabled = raw.get("enabled", True)
    if not isinstance(enabled, bool):
        _fail(source, "execution.enabled", f"must be true or false, got {json.dumps(enabled)}")
    base = Path(source).parent if source != "<dict>" else Path.cwd()
    data: list[str] = []
    for name in _names(raw["data"], "execution.data", source) if "data" in raw else ():
        path = (base / name).resolve()
        if path.is_dir():  # a folder: its files, never its notebooks (other students' work)
            data += [str(p) for p in sorted(path.iterdir()) if p.is_file() and p.suffix != ".ipynb"
                     and not p.name.startswith(".")]
        elif path.is_file():
            data.append(str(path))
        else:
            _fail(source, "execution.data", f"names {name!r}, which is not a file or folder beside the rubric")
    return Execution(enabled=enabled, data=tuple(data),
                     cell_timeout_s=_number(raw.get("cell_timeout", 30), "execution.cell_timeout", source, 1, 3600),
                     notebook_timeout_s=_number(raw.get("timeout", 120), "execution.timeout", source, 5, 7200))


def rubric_from_dict(data, source: str = "<dict>") -> Rubric:
    """Validate a parsed rubric; raise ``RubricError`` naming ``source`` and the bad key."""
    if not isinstance(data, dict):
        raise RubricError(f"{source}: a rubric must be a mapping at the top level, got {type(data).__name__}")
    _check_unknown(data, _TOP_KEYS, "", source)
    title = _text(data, "title", "", source, required=True)
    assignment = _text(data, "assignment", "", source, required=False) or _text(
        data, "description", "", source, required=False)
    defaults = {"missing_evidence_cap": DEFAULT_MISSING_EVIDENCE_CAP, "model_band": DEFAULT_MODEL_BAND,
                "no_evidence_share": DEFAULT_NO_EVIDENCE_SHARE}
    for key in _SHARES:
        if key in data:
            defaults[key] = _number(data[key], key, source, 0, 1)
    raw_criteria = data.get("criteria")
    if not isinstance(raw_criteria, list) or not raw_criteria:
        _fail(source, "criteria", "must be a non-empty list of criteria")
    criteria, seen = [], set()
    for i, raw in enumerate(raw_criteria):
        where = f"criteria[{i}]"
        if not isinstance(raw, dict):
            _fail(source, where, f"must be a mapping, got {type(raw).__name__}")
        cid = raw.get("id")
        if not isinstance(cid, str) or not _ID.match(cid):
            _fail(source, f"{where}.id", f"must be a short identifier (letters, digits, _ or -, starting with a "
                                         f"letter), got {json.dumps(cid)}")
        where = f"criteria[{i}] ({cid})"
        if cid in seen:
            _fail(source, f"{where}.id", "is used twice")
        seen.add(cid)
        _check_unknown(raw, _CRITERION_KEYS, where, source)
        if "points" not in raw:
            _fail(source, f"{where}.points", "is required")
        points = _number(raw["points"], f"{where}.points", source, 0, 1000, low_open=True)
        shares = {key: _number(raw[key], f"{where}.{key}", source, 0, 1) if key in raw else defaults[key]
                  for key in _SHARES}
        evidence = _evidence(raw.get("evidence"), f"{where}.evidence", source)
        tests = _tests(raw.get("tests"), cid, f"{where}.tests", source)
        if sum(t.points for t in tests) > points + 1e-9:
            _fail(source, f"{where}.tests", f"give {sum(t.points for t in tests):g} points; the criterion has "
                                            f"{points:g}")
        given = sum(p for _, p in evidence.points) + sum(t.points for t in tests)
        all_given = {k for k, _ in evidence.points} == {k for k in _RULE_KEYS if getattr(evidence, k)}
        if evidence.points and (given > points + 1e-9 or (all_given and abs(given - points) > 1e-9)):
            _fail(source, f"{where}.evidence.points", f"add up to {given:g}; they must add up to "
                  f"{'the' if all_given else 'at most the'} criterion's {points:g} points")
        criteria.append(Criterion(
            id=cid,
            title=_text(raw, "title", where, source, required=True),
            description=_text(raw, "description", where, source, required=False),
            points=points,
            evidence=evidence,
            tests=tests,
            **shares,
        ))
    return Rubric(title=title, assignment=assignment, criteria=tuple(criteria), source=source,
                  execution=_execution(data.get("execution"), source))


def load_rubric(path) -> Rubric:
    """Load a rubric from a ``.yaml``/``.yml`` or ``.json`` file and validate it."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise RubricError(f"cannot read rubric file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise RubricError(f"{path}: not a UTF-8 text file") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise RubricError(f"{path}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
            raise RubricError(f"{path}: not valid YAML{where}: {getattr(exc, 'problem', None) or exc}") from None
    return rubric_from_dict(data, str(path))
