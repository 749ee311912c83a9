"""What the bench sends: the grader's own requests, short chats, long prompts, or a JSONL file.

A workload is a list of *units*, each sent as one: a unit is one request, or (the grader) the pair of
requests the grader sends for one notebook, code analysis on the code model and feedback on the feedback
model, both at once. Every request carries its own seed, so the cluster and each peer get the same
requests with the same seeds. Everything is built and checked before any load is sent: an unknown
workload, an unreadable JSONL line or an unknown model is a ``ConfigError`` that names it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_NOTEBOOKS = ROOT / "examples" / "notebooks"
EXAMPLE_RUBRIC = ROOT / "examples" / "rubric.yaml"
BUILT_IN = ("grader", "chat", "long")
JSONL_KEYS = {"model", "prompt", "messages", "max_tokens", "seed", "temperature", "system"}

CHAT_PROMPTS = (
    "In two sentences, what does a pandas groupby do?",
    "Name three ways to show a monthly sales trend.",
    "Why would a notebook's chart have no axis labels? One sentence.",
    "Suggest a title for a regional revenue report.",
    "What is the difference between mean and median revenue? Briefly.",
    "Give one tip for cleaning a CSV of sales data.",
)
LONG_PARAGRAPH = ("Store {i} reported revenue of {r} thousand dollars for week {w}, with returns of {t} percent "
                  "and a discount rate of {d} percent; the regional manager noted stock-outs on {s} days and "
                  "asked the analyst to compare the figures with the same week of the previous year. ")


@dataclass(frozen=True)
class BenchRequest:
    """One request, as every endpoint is sent it (``kwargs``: ``client.generate``'s keyword arguments)."""

    index: int
    model: str  # the config's model key
    kwargs: dict
    role: str = ""  # the grader's: code or feedback
    source: str = ""  # where it came from (a notebook, a JSONL line)

    @property
    def prompt_chars(self) -> int:
        return len(self.kwargs.get("prompt") or json.dumps(self.kwargs.get("messages") or ""))


@dataclass(frozen=True)
class Unit:
    """Requests sent together (a grader pair), or one request."""

    requests: tuple[BenchRequest, ...]
    label: str = ""


@dataclass
class Workload:
    name: str
    units: list[Unit]
    notes: list[str] = field(default_factory=list)

    @property
    def models(self) -> list[str]:
        return sorted({r.model for u in self.units for r in u.requests})


def _cap(kwargs: dict, max_tokens: int | None) -> dict:
    return {**kwargs, "max_tokens": min(kwargs["max_tokens"], max_tokens)} if max_tokens else kwargs


def grader_workload(config, max_tokens: int | None = None, notebooks=None, rubric=None) -> Workload:
    """The grader's requests for the example notebooks: the prompts its own planner builds (grading/analysis.py),
    one pair per gradable notebook, with the grader's options for this cluster (models, budgets, seed)."""
    from ..grading import GradingOptions, load_rubric
    from ..grading.analysis import plan_requests
    from ..grading.evidence import check_rubric, collect_evidence
    from ..grading.notebook import load_submission

    folder = Path(notebooks or EXAMPLE_NOTEBOOKS)
    paths = sorted(folder.glob("*.ipynb"))
    if not paths:
        raise ConfigError(f"--notebooks {folder}: no .ipynb file there", field="--notebooks")
    rubric = load_rubric(rubric or EXAMPLE_RUBRIC)
    options = GradingOptions.for_cluster(config)
    units, skipped = [], []
    for path in paths:
        sub = load_submission(path)
        if not sub.ok:
            skipped.append(path.name)
            continue
        evidence = collect_evidence(sub.notebook)
        planned, _ = plan_requests(rubric, sub.notebook, evidence, check_rubric(rubric, evidence), options)
        pair = tuple(BenchRequest(0, config.resolve_model(r.kwargs["model"]), _cap(r.kwargs, max_tokens), r.role,
                                  path.name) for r in planned)
        units.append(Unit(pair, path.stem))
    notes = [f"not gradable, left out as the grader leaves it: {', '.join(skipped)}"] if skipped else []
    return Workload("grader", _numbered(units), notes)


def _numbered(units: list[Unit]) -> list[Unit]:
    out, i = [], 0
    for unit in units:
        reqs = []
        for r in unit.requests:
            reqs.append(replace(r, index=i))
            i += 1
        out.append(replace(unit, requests=tuple(reqs)))
    return out


def chat_workload(config, max_tokens: int | None = None, seed: int = 0) -> Workload:
    """Short prompts, one request a unit, taking the configured models in turn."""
    models = list(config.models)
    units = []
    for i, text in enumerate(CHAT_PROMPTS * max(1, len(models))):
        model = models[i % len(models)]
        kwargs = {"model": model, "prompt": text, "max_tokens": min(64, max_tokens or 64), "temperature": 0.0,
                  "seed": seed + i}
        units.append(Unit((BenchRequest(i, model, kwargs, source="chat"),), f"chat {i}"))
    return Workload("chat", _numbered(units))


def long_workload(config, max_tokens: int | None = None, seed: int = 0, target_tokens: int = 2500) -> Workload:
    """Prompts of a few thousand tokens (where GPU prefill matters most), each different from the first word so
    that no prefix cache serves one from another; the models in turn. Kept inside the smallest context."""
    models = list(config.models)
    contexts = [config.models[m].get("n_ctx") for m in models if config.models[m].get("n_ctx")]
    answer = min(64, max_tokens or 64)
    tokens = min(target_tokens, (min(contexts) if contexts else 8192) - answer - 64)
    units = []
    for i in range(4 * max(1, len(models))):
        model = models[i % len(models)]
        body, w = [f"Report {i + 1}."], 0
        while len(" ".join(body)) < tokens * 3.2:  # ~3.5 characters a token: on the safe side
            w += 1
            body.append(LONG_PARAGRAPH.format(i=(i * 7 + w) % 97, r=100 + (w * 13 + i) % 400, w=w, t=w % 9,
                                              d=(w + i) % 15, s=w % 4))
        body.append("\nSummarise the three most important findings in two sentences.")
        kwargs = {"model": model, "prompt": " ".join(body), "max_tokens": answer, "temperature": 0.0,
                  "seed": seed + i}
        units.append(Unit((BenchRequest(i, model, kwargs, source="long"),), f"long {i}"))
    return Workload("long", _numbered(units), [f"prompts of about {tokens} tokens"])


def jsonl_workload(path, config, max_tokens: int | None = None) -> Workload:
    """One request a line: ``model``, ``prompt`` or ``messages``, ``max_tokens``; optional ``seed`` (default the
    line's number), ``temperature`` (0), ``system``. A bad line stops the bench before it sends anything."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"--workload {path}: cannot read it: {exc.strerror}", field="--workload") from None
    units = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not JSON: {exc.msg} at column {exc.colno}", field="--workload") from None
        if not isinstance(item, dict):
            raise ConfigError(f"{where}: a request is a JSON object, got {type(item).__name__}", field="--workload")
        unknown = set(item) - JSONL_KEYS
        if unknown:
            raise ConfigError(f"{where}: unknown key {', '.join(sorted(unknown))} (a line has: "
                              f"{', '.join(sorted(JSONL_KEYS))})", field="--workload")
        if not isinstance(item.get("model"), str):
            raise ConfigError(f"{where}: 'model' (a string) is required", field="--workload")
        try:
            model = config.resolve_model(item["model"])
        except Exception as exc:
            raise ConfigError(f"{where}: {getattr(exc, 'message', exc)}", field="--workload") from None
        has_prompt, has_messages = isinstance(item.get("prompt"), str), isinstance(item.get("messages"), list)
        if has_prompt == has_messages:
            raise ConfigError(f"{where}: give 'prompt' (a string) or 'messages' (a list), one of them",
                              field="--workload")
        n = item.get("max_tokens")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"{where}: 'max_tokens' must be a positive integer, got {json.dumps(n)}",
                              field="--workload")
        temperature, seed = item.get("temperature", 0.0), item.get("seed", number)
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature < 0:
            raise ConfigError(f"{where}: 'temperature' must be a number >= 0, got {json.dumps(temperature)}",
                              field="--workload")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ConfigError(f"{where}: 'seed' must be an integer, got {json.dumps(seed)}", field="--workload")
        kwargs = {"model": model, "max_tokens": n, "temperature": float(temperature), "seed": seed}
        kwargs.update({k: item[k] for k in ("prompt", "messages", "system") if k in item})
        units.append(Unit((BenchRequest(0, model, _cap(kwargs, max_tokens), source=f"line {number}"),),
                          f"line {number}"))
    if not units:
        raise ConfigError(f"--workload {path}: no request in it", field="--workload")
    return Workload(path.name, _numbered(units))


def load_workload(spec: str, config, max_tokens: int | None = None, seed: int = 0, notebooks=None,
                  rubric=None) -> Workload:
    """``grader``, ``chat``, ``long`` or a JSONL file's path."""
    if spec == "grader":
        return grader_workload(config, max_tokens, notebooks, rubric)
    if spec == "chat":
        return chat_workload(config, max_tokens, seed)
    if spec == "long":
        return long_workload(config, max_tokens, seed)
    if spec.endswith(".jsonl") or Path(spec).is_file():
        return jsonl_workload(spec, config, max_tokens)
    raise ConfigError(f"unknown workload {spec!r}: one of {', '.join(BUILT_IN)}, or a .jsonl file of requests",
                      field="--workload")


def pairs_for_efficiency(workload: Workload, n: int) -> list[tuple[BenchRequest, ...]]:
    """Up to ``n`` groups of requests on different models, for the parallel-efficiency check: the grader's pairs
    as they are, else consecutive requests of different models put together."""
    groups = [u.requests for u in workload.units if len({r.model for r in u.requests}) > 1]
    if not groups:
        by_model: dict[str, list] = {}
        for unit in workload.units:
            for r in unit.requests:
                by_model.setdefault(r.model, []).append(r)
        if len(by_model) > 1:
            groups = [tuple(g) for g in zip(*by_model.values())]
    return groups[:n]
