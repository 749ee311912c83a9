"""Grade one notebook: the four layers in order, one JSON-ready result dict out.

    from disaggregated_inference.client import DisaggregatedClient
    from disaggregated_inference.grading import grade_notebook, load_rubric

    result = grade_notebook("examples/notebooks/good_sales_analysis.ipynb",
                            load_rubric("examples/rubric.yaml"), DisaggregatedClient("config_current.json"))
    result["total"], result["criteria"], result["feedback"], result["inference"]["overlap"]

A bad file is a result (``status: "invalid"``), never an exception; so is a
cluster that cannot answer (``status: "error"``, graded again on the next run).
"""
from __future__ import annotations

import time
from dataclasses import asdict
from datetime import datetime, timezone

from ..client import overlap_figures
from .analysis import CODE, FEEDBACK, plan_requests
from .evidence import check_rubric, collect_evidence
from .notebook import load_submission
from .feedback import compose_feedback
from .options import GradingOptions
from .quality import NotebookText
from .rerun import Execution
from .rubric import Rubric, load_rubric
from .validation import obtain_answers, reconcile

RESULT_FORMAT = "grading-result/1"
GRADED, NEEDS_REVIEW, INVALID, ERROR = "graded", "needs_review", "invalid", "error"
FINAL_STATUSES = (GRADED, NEEDS_REVIEW, INVALID)  # an "error" result is graded again on the next run
REQUEST_FIELDS = ("method", "prefill_time", "decode_time", "total_time", "prompt_tokens", "completion_tokens",
                  "prefill_speed", "decode_speed", "prefill_server", "decode_server", "kv_bytes", "finish_reason",
                  "reasoning_tokens", "speculation", "draft_tokens", "accepted_tokens")


def inference_summary(answers, rounds) -> dict:
    """Timings of every request of a submission, and how much they overlapped (``overlap_figures``)."""
    requests = [{"role": a.role, "model": a.model, "attempt": a.attempt, "error": a.error,
                 **{k: a.metrics.get(k) for k in REQUEST_FIELDS}} for a in answers]
    wall = sum(r.get("wall_time") or 0.0 for r in rounds)
    request_time = sum(r.get("request_time") or 0.0 for r in rounds)
    return {
        "requests": requests,
        "prefill_time": round(sum(r["prefill_time"] or 0.0 for r in requests), 6),
        "decode_time": round(sum(r["decode_time"] or 0.0 for r in requests), 6),
        **overlap_figures(request_time, wall),
        "methods": sorted({r["method"] for r in requests if r["method"]}),
        "fallbacks": sum(1 for r in requests if r["method"] == "decode_only_fallback"),
    }


def _base_result(sub, rubric: Rubric, options: GradingOptions) -> dict:
    return {
        "format": RESULT_FORMAT,
        "submission": {"name": sub.name, "file": str(sub.path), "sha256": sub.sha256, "size_bytes": sub.size_bytes},
        "rubric": {"title": rubric.title, "source": rubric.source, "fingerprint": rubric.fingerprint,
                   "max_points": rubric.max_points},
        "status": None,
        "total": None,
        "max_points": rubric.max_points,
        "percent": None,
        "needs_review": False,
        "review_reasons": [],
        "criteria": [],
        "feedback": None,
        "layers": {"submission": sub.summary()},
        "inference": inference_summary([], []),
        "options": options.to_dict(),
        "graded_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def grade_notebook(path, rubric, client, options: GradingOptions | None = None, *, name: str | None = None) -> dict:
    """Grade one notebook file with ``client`` (anything with ``generate_many``); return the result dict.

    Whatever one notebook does to the grader (crafted code, a parser's MemoryError), the answer is a result
    for that notebook (``status: "invalid"``, the reason in ``review_reasons``), never an exception."""
    options = options or GradingOptions()
    rubric = rubric if isinstance(rubric, Rubric) else load_rubric(rubric)
    started = time.perf_counter()
    sub = load_submission(path, options.limits, name)
    try:
        return _grade(sub, rubric, client, options, started)
    except Exception as exc:  # noqa: BLE001 - one notebook's failure is that notebook's result
        return failed_result(sub, rubric, options, exc, started)


def failed_result(sub, rubric: Rubric, options: GradingOptions, exc: BaseException, started: float) -> dict:
    """The result of a notebook the grader could not get through: invalid, with the reason."""
    result = _base_result(sub, rubric, options)
    result.update(status=INVALID, needs_review=True,
                  review_reasons=[f"the grader could not process this notebook: {type(exc).__name__}: "
                                  f"{str(exc)[:200]}"],
                  elapsed_s=round(time.perf_counter() - started, 3))
    return result


def _grade(sub, rubric: Rubric, client, options: GradingOptions, started: float) -> dict:
    result = _base_result(sub, rubric, options)

    # layer 1: the submission
    if not sub.ok:
        result.update(status=INVALID, needs_review=True,
                      review_reasons=["not a gradable notebook: " + "; ".join(sub.problems)],
                      elapsed_s=round(time.perf_counter() - started, 3))
        return result

    # the re-run, in the sandbox, while the models are asked (it uses the CPU while they wait on the servers)
    execution = Execution.start(sub, rubric, options.execute)
    try:
        return _grade_with(sub, rubric, client, options, started, result, execution)
    finally:
        execution.result()  # a notebook's sandbox never outlives its grading


def _grade_with(sub, rubric: Rubric, client, options: GradingOptions, started: float, result: dict,
                execution: Execution) -> dict:
    # layer 2: the evidence (the models see what the file shows; the re-run and the hidden tests join later)
    evidence = collect_evidence(sub.notebook)
    checks = check_rubric(rubric, evidence)

    # layer 3: the two models, in parallel
    requests, rendered = plan_requests(rubric, sub.notebook, evidence, checks, options)
    analysed = obtain_answers(client, requests, rubric, options, NotebookText.of(sub.notebook))
    result["layers"]["analysis"] = {
        "notebook_chars": rendered.original_chars,
        "shown_chars": len(rendered.text),
        "omitted": rendered.omitted,
        "prompt_chars": {r.role: len(r.kwargs["prompt"]) for r in requests},
        "answers": [a.to_dict() for a in analysed.answers],
    }
    result["inference"] = inference_summary(analysed.answers, analysed.combined)
    rerun = execution.result()
    checks = check_rubric(rubric, evidence, rerun)
    result["layers"]["execution"] = rerun.to_dict()
    result["layers"]["evidence"] = {**evidence.to_dict(), "findings": evidence.findings(),
                                    "checks": {cid: [asdict(k) for k in items] for cid, items in checks.items()}}

    # layer 4: evidence scores, the model's view within a band, grounded feedback
    if analysed.code is None and analysed.request_failed.get("code"):
        reasons = analysed.review_reasons  # the cluster did not answer: graded again on the next run
        result.update(status=ERROR, needs_review=True, review_reasons=reasons,
                      elapsed_s=round(time.perf_counter() - started, 3))
        return result
    code_not_used, feedback_not_used = analysed.not_used(CODE), analysed.not_used(FEEDBACK)
    short = analysed.not_used(CODE, short=True)
    grades = reconcile(rubric, checks, analysed.code, short and f"the code-analysis answer {short} (see why below)")
    result["criteria"] = [g.to_dict() for g in grades]
    total = round(sum(g.score for g in grades), 2)
    result.update(total=total, percent=round(100.0 * total / rubric.max_points, 1))
    result["layers"]["validation"] = {
        "problems": analysed.problems,
        "quality": analysed.quality,
        "retried": sorted({a.role for a in analysed.answers if a.attempt > 1}),
        "model_not_used": {role: why for role, why in ((CODE, code_not_used), (FEEDBACK, feedback_not_used)) if why},
        "adjustments": {g.id: g.adjustments for g in grades if g.adjustments},
    }
    result["feedback"] = compose_feedback(
        rubric, evidence, checks, total, analysed.feedback,
        analysed.code["issues"] if analysed.code is not None else None, feedback_not_used, code_not_used)
    reasons = analysed.review_reasons + execution_reasons(rerun)
    if rendered.trimmed:
        result["layers"]["analysis"]["note"] = "the models saw a shortened notebook"
    result.update(status=NEEDS_REVIEW if reasons else GRADED, needs_review=bool(reasons), review_reasons=reasons,
                  elapsed_s=round(time.perf_counter() - started, 3))
    return result


def execution_reasons(rerun) -> list[str]:
    """What in the re-run a person should look at: what the sandbox stopped, hidden tests that could not run."""
    reasons = [f"contained in the sandbox: {i}" for i in rerun.incidents]
    unrun = [t for t in rerun.tests if t.status == "not_run"]
    if unrun:
        reasons.append(f"{len(unrun)} hidden test{'s' if len(unrun) > 1 else ''} not run "
                       f"({sum(t.points for t in unrun):g} points not awarded): {unrun[0].message}")
    return reasons


def deterministic_part(result: dict) -> dict:
    """What must not change when the same notebook is graded again with the same rubric, models and seed:
    everything but timings, timestamps and server addresses."""
    analysis = result["layers"].get("analysis", {})
    return {
        "status": result["status"], "total": result["total"], "criteria": result["criteria"],
        "feedback": result["feedback"], "review_reasons": result["review_reasons"],
        "submission": result["submission"]["sha256"], "rubric": result["rubric"]["fingerprint"],
        "evidence": result["layers"].get("evidence"),
        "execution": {k: v for k, v in (result["layers"].get("execution") or {}).items()
                      if k not in ("seconds", "findings")},
        "answers": [(a["role"], a["attempt"], a["text"], a["error"]) for a in analysis.get("answers", [])],
    }
