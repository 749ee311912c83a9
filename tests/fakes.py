"""A FAKE client for tests of the grading logic: canned JSON answers, no servers, no models (test-only).

It has the real client's surface that the grader and the web interface use
(``generate``, ``generate_many``, ``status``, ``check_health``, ``history``,
``config``) and records every request in ``calls``. It proves nothing about
the models; tests of real answers go through ``DisaggregatedClient``.

    fake = FakeGradingClient(code=['not json', {"scores": ...}])  # first answer invalid, then one valid

Its requests are ``GenerationRequest``s built as the real client builds them (an argument the real
client does not take fails here) and its metrics a ``RequestMetrics`` (a renamed quantity or a
method that is not one fails here): the fake cannot drift from the real client's shapes.
"""
from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import fields

from disaggregated_inference.client import overlap_figures
from disaggregated_inference.metrics import Method, RequestMetrics
from disaggregated_inference.request import GenerationRequest

FAKE_TIMES = {"code": (0.25, 0.75), "feedback": (0.5, 1.0)}  # (prefill, decode) seconds reported per role
FAKE_SLOTS = 4  # slots each fake server reports, as /health's slots.total
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
             "outstanding": 0, "slots": FAKE_SLOTS, "served": 0, "loaded": True, "backend": "fake",
             "handoff": None}
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

    @staticmethod
    def _request(model, prompt, max_tokens, temperature, kwargs: dict) -> dict:
        """The request as the real client takes it (``GenerationRequest.of``), as a dict of the fields given
        (the first four always)."""
        request = model if isinstance(model, GenerationRequest) else GenerationRequest.of(
            model, prompt, max_tokens, temperature, **kwargs)
        return {f.name: getattr(request, f.name) for f in fields(request)
                if f.name in ("model", "prompt", "max_tokens", "temperature") or getattr(request, f.name) != f.default}

    def generate(self, model: str, prompt: str | None = None, max_tokens: int = 256, temperature: float = 0.0,
                 route: str | None = None, **kwargs) -> tuple[str, dict]:
        request = self._request(model, prompt, max_tokens, temperature, kwargs)
        self.calls.append(request)
        role = role_of(request)
        text = self._answer(role, request)
        prefill, decode = FAKE_TIMES[role]
        return text, self._metrics(request["model"], request["prompt"], text, prefill, decode,
                                   request.get("reasoning_effort"))

    def _metrics(self, model: str, prompt: str | None, text: str, prefill: float, decode: float,
                 reasoning_effort: str | None = None) -> dict:
        reasoning = {}
        if reasoning_effort:  # a model that reasons before it answers, as gpt-oss does
            reasoning = {"reasoning": FAKE_REASONING, "reasoning_tokens": len(FAKE_REASONING) // 3}
        metrics = RequestMetrics(
            method=Method.KV_HANDOFF, prefill_server=f"fake-prefill-{model}", decode_server=f"fake-decode-{model}",
            prefill_time=prefill, decode_time=decode, total_time=prefill + decode,
            prompt_tokens=len(prompt or "") // 3, completion_tokens=len(text) // 3, prefill_speed=1000.0,
            decode_speed=50.0, kv_bytes=0, finish_reason="stop", **reasoning).as_dict()
        self.history.append({"time": time.time(), "model": model, **metrics})
        return metrics

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


class StreamingFakeClient(FakeGradingClient):
    """The fake with ``stream`` (as ``DisaggregatedClient.stream``): it waits ``prefill_s``, calls
    ``on_route``, then yields its answer in ``pieces`` pieces ``piece_s`` apart, then the metrics
    (measured on the clock). It records how many streams of each model were open at once
    (``most_open``), how many were in that prefill wait at once (``most_prefilling``), and how many
    were closed before their end (``closed_early``: the grader cancelled them)."""

    def __init__(self, *args, prefill_s: float = 0.0, piece_s: float = 0.0, pieces: int = 4, **kwargs):
        super().__init__(*args, **kwargs)
        self.prefill_s, self.piece_s, self.pieces = prefill_s, piece_s, pieces
        self.lock = threading.Lock()
        self.open: dict[str, int] = {}
        self.most_open: dict[str, int] = {}
        self.prefilling: dict[str, int] = {}
        self.most_prefilling: dict[str, int] = {}
        self.opened = 0
        self.closed_early = 0

    def piece_delay(self, index: int) -> float:
        """Seconds between the pieces of the ``index``-th stream opened (from 0)."""
        return self.piece_s

    def stream(self, model: str, prompt: str | None = None, max_tokens: int = 256, temperature: float = 0.0,
               on_route=None, route: str | None = None, parts: bool = False, **kwargs):
        started = time.perf_counter()
        request = self._request(model, prompt, max_tokens, temperature, kwargs)
        model = request["model"]
        with self.lock:
            self.calls.append(request)
            index = self.opened
            self.opened += 1
            self.open[model] = self.open.get(model, 0) + 1
            self.most_open[model] = max(self.most_open.get(model, 0), self.open[model])
            self.prefilling[model] = self.prefilling.get(model, 0) + 1
            self.most_prefilling[model] = max(self.most_prefilling.get(model, 0), self.prefilling[model])
        try:
            try:
                text = self._answer(role_of(request), request)
                time.sleep(self.prefill_s)
            finally:
                with self.lock:
                    self.prefilling[model] -= 1
            if on_route is not None:
                on_route({"method": "kv_handoff", "prefill_server": f"fake-prefill-{model}",
                          "decode_server": f"fake-decode-{model}", "kv_bytes": 0, "warnings": []})
            step, pause = max(1, -(-len(text) // self.pieces)), self.piece_delay(index)
            for at in range(0, len(text), step):
                time.sleep(pause)
                yield text[at:at + step]
            prefill_time = self.prefill_s
            elapsed = time.perf_counter() - started
            metrics = self._metrics(model, request["prompt"], text, prefill_time, elapsed - prefill_time,
                                    request.get("reasoning_effort"))
            metrics["total_time"] = round(elapsed, 6)
            yield metrics
        except GeneratorExit:  # closed by the caller before its end
            with self.lock:
                self.closed_early += 1
            raise
        finally:
            with self.lock:
                self.open[model] -= 1
