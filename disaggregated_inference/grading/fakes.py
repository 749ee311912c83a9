"""A FAKE client for tests of the grading logic: canned JSON answers, no servers, no models.

It has the real client's surface that the grader and the web interface use
(``generate``, ``generate_many``, ``status``, ``check_health``, ``history``,
``config``) and records every request in ``calls``. It proves nothing about
the models; tests of real answers go through ``DisaggregatedClient``.

    fake = FakeGradingClient(code=['not json', {"scores": ...}])  # first answer invalid, then one valid
"""
from __future__ import annotations

import json
import time
from collections import deque

from ..client import overlap_figures

FAKE_TIMES = {"code": (0.25, 0.75), "feedback": (0.5, 1.0)}  # (prefill, decode) seconds reported per role
# what a reasoning model's metrics carry beside its answer; it must never reach a student
FAKE_REASONING = "PRIVATE-CHAIN-OF-THOUGHT: the student seems weak; be gentle."


def role_of(kwargs: dict) -> str:
    schema = kwargs.get("json_schema") or {}
    return "code" if "scores" in schema.get("properties", {}) else "feedback"


def full_marks_answer(kwargs: dict, score=None) -> dict:
    """A valid code-analysis answer for the schema in ``kwargs``: full points (or ``score(id, points)``)."""
    per = kwargs["json_schema"]["properties"]["scores"]["properties"]
    scores = {}
    for i, (cid, spec) in enumerate(per.items()):
        rule = spec["properties"]["score"]
        points = max(rule["enum"]) if "enum" in rule else rule.get("maximum", 10)
        value = score(cid, points) if score else points
        scores[cid] = {"score": value, "rationale": f"{FAKE_REASONS[i % len(FAKE_REASONS)]} (fake, {cid})"}
    return {"scores": scores, "issues": ["Fake issue: cell 2 could check the revenue column for gaps first."]}


# Distinct, notebook-grounded texts: they pass the quality checks on the example notebooks.
FAKE_REASONS = ("Reads the sales file with pandas and shows its first rows",
                "Totals revenue per region using groupby",
                "Draws a bar chart of revenue by region with a title",
                "Markdown conclusions name the best region",
                "Every cell ran once in order, helper function defined",
                "Sixth reason", "Seventh reason")
FEEDBACK_ANSWER = {"summary": "Fake feedback: a clear analysis with room to improve.",
                   "strengths": ["Fake strength: revenue by region is computed clearly."],
                   "improvements": ["Fake improvement: label the chart axes with units of revenue."]}


class FakeGradingClient:
    """Answers from queues per role (``code``, ``feedback``); a queue item is a str (returned as is),
    a dict (returned as JSON), an Exception (raised), or a callable of the request's kwargs."""

    def __init__(self, code=None, feedback=None, score=None, servers=None):
        self.queues = {"code": deque(code or []), "feedback": deque(feedback or [])}
        self.score = score
        self.calls: list[dict] = []      # every generate() request, in order
        self.rounds: list[list[str]] = []  # the roles sent together by each generate_many()
        self.history: deque = deque(maxlen=200)
        self.config = None
        self.health_checks = 0
        self._servers = servers if servers is not None else [
            {"name": f"fake-{role}-{model}", "role": role, "model": model, "url": f"http://fake-{role}-{model}",
             "up": True, "failures": 0, "last_error": None, "last_checked": None, "latency_s": 0.001,
             "outstanding": 0, "served": 0, "loaded": True, "backend": "fake", "handoff": None}
            for model in ("qwen", "gpt-oss") for role in ("prefill", "decode")]

    def _answer(self, role: str, kwargs: dict) -> str:
        item = self.queues[role].popleft() if self.queues[role] else None
        if item is None:
            item = full_marks_answer(kwargs, self.score) if role == "code" else FEEDBACK_ANSWER
        if callable(item) and not isinstance(item, type):
            item = item(kwargs)
        if isinstance(item, BaseException):
            raise item
        return item if isinstance(item, str) else json.dumps(item)

    def generate(self, model: str, prompt: str | None = None, max_tokens: int = 256, temperature: float = 0.0,
                 **kwargs) -> tuple[str, dict]:
        request = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, **kwargs}
        self.calls.append(request)
        role = role_of(request)
        text = self._answer(role, request)
        prefill, decode = FAKE_TIMES[role]
        metrics = {"prefill_time": prefill, "decode_time": decode, "total_time": prefill + decode,
                   "prompt_tokens": len(prompt or "") // 3, "completion_tokens": len(text) // 3,
                   "prefill_speed": 1000.0, "decode_speed": 50.0, "method": "disaggregated",
                   "prefill_server": f"fake-prefill-{model}", "decode_server": f"fake-decode-{model}",
                   "kv_bytes": 0, "finish_reason": "stop"}
        if kwargs.get("reasoning_effort"):  # a model that reasons before it answers, as gpt-oss does
            metrics.update(reasoning=FAKE_REASONING, reasoning_tokens=len(FAKE_REASONING) // 3)
        self.history.append({"time": time.time(), "model": model, **metrics})
        return text, metrics

    def generate_many(self, requests_: list[dict], max_workers=None) -> tuple[list, dict]:
        self.rounds.append([role_of(kwargs) for kwargs in requests_])
        results = []
        for kwargs in requests_:
            try:
                results.append(self.generate(**kwargs))
            except Exception as exc:
                results.append(exc)
        times = [r[1]["total_time"] for r in results if isinstance(r, tuple)]
        wall = max(times) if times else 0.01  # as if they had run in parallel
        return results, {**overlap_figures(sum(times), wall), "requests": len(results),
                         "failed": sum(1 for r in results if not isinstance(r, tuple))}

    def status(self) -> list[dict]:
        return [dict(s) for s in self._servers]

    def check_health(self) -> list[dict]:
        self.health_checks += 1
        return self.status()

    def close(self) -> None:
        pass
