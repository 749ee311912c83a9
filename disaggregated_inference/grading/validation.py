"""Layer 4, validation: the models' answers checked, retried once, and reconciled with the evidence.

- an answer that does not parse, lacks a criterion, names an unknown one or
  has a non-numeric score is *invalid*: the request is sent once more, told
  what was wrong; still invalid, the submission is flagged for human review;
- a score outside ``0..points`` is clamped to the rubric's points;
- a criterion whose evidence rules are not all met (a required chart missing,
  an error output where the code must run) scores at most
  ``missing_evidence_cap`` of its points.

Every change to a model's score is recorded with its reason.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from .analysis import CODE, FEEDBACK, ModelAnswer, ModelRequest, retry_request, run_requests
from .evidence import Check
from .options import GradingOptions
from .rubric import Rubric


# -- is an answer usable? ----------------------------------------------------------------------------

def _load_json(answer: ModelAnswer) -> tuple[object, list[str]]:
    if answer.error:
        return None, [f"the request failed: {answer.error}"]
    try:  # strict=False: a raw newline inside a string is harmless, not a reason to ask again
        return json.loads(answer.text or "", strict=False), []
    except json.JSONDecodeError as exc:
        cut = " (the answer was cut off at max_tokens)" if answer.finish_reason == "length" else ""
        return None, [f"not valid JSON: {exc.msg} at character {exc.pos}{cut}"]


def check_code_answer(answer: ModelAnswer, rubric: Rubric) -> tuple[dict | None, list[str]]:
    """The scores in a code-analysis answer, or the problems that make it unusable."""
    data, problems = _load_json(answer)
    if problems:
        return None, problems
    if not isinstance(data, dict) or not isinstance(data.get("scores"), dict):
        return None, ["the answer has no 'scores' object"]
    scores = data["scores"]
    missing = [cid for cid in rubric.ids if cid not in scores]
    unknown = [cid for cid in scores if cid not in rubric.ids]
    if missing:
        problems.append("no score for criteria " + ", ".join(missing))
    if unknown:
        problems.append("scores for criteria not in the rubric: " + ", ".join(map(str, unknown)))
    parsed = {}
    for cid in rubric.ids:
        item = scores.get(cid)
        if item is None:
            continue
        value = item.get("score") if isinstance(item, dict) else item
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            problems.append(f"the score of {cid} is not a number: {json.dumps(value)}")
            continue
        rationale = item.get("rationale", "") if isinstance(item, dict) else ""
        parsed[cid] = {"score": float(value), "rationale": rationale if isinstance(rationale, str) else ""}
    if problems:
        return None, problems
    issues = data.get("issues", [])
    issues = [i for i in issues if isinstance(i, str) and i.strip()] if isinstance(issues, list) else []
    return {"scores": parsed, "issues": issues}, []


def check_feedback_answer(answer: ModelAnswer) -> tuple[dict | None, list[str]]:
    data, problems = _load_json(answer)
    if problems:
        return None, problems
    if not isinstance(data, dict):
        return None, ["the answer is not a JSON object"]
    summary = data.get("summary")
    if not isinstance(summary, str) or not summary.strip():
        problems.append("the feedback has no summary")
    lists = {}
    for key in ("strengths", "improvements"):
        value = data.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            problems.append(f"'{key}' is not a list of strings")
        else:
            lists[key] = [v.strip() for v in value if v.strip()]
    same = set(lists.get("strengths", [])) & set(lists.get("improvements", []))
    if same:
        problems.append(f"inconsistent: {sorted(same)[0]!r} is given both as a strength and as an improvement")
    if problems:
        return None, problems
    return {"summary": summary.strip(), **lists}, []


# -- scores against the rubric and the evidence ----------------------------------------------------------

@dataclass
class CriterionGrade:
    id: str
    title: str
    points: float
    score: float | None
    model_score: float | None = None
    rationale: str = ""
    evidence: list = field(default_factory=list)      # the criterion's checks, as dicts
    adjustments: list = field(default_factory=list)   # every change to the model's score, with its reason

    def to_dict(self) -> dict:
        return asdict(self)


def _fmt(x: float) -> str:
    return f"{x:g}"


def reconcile(rubric: Rubric, checks: dict[str, list[Check]], code: dict | None) -> list[CriterionGrade]:
    """Scores clamped to each criterion's points and capped where the evidence is missing."""
    grades = []
    for c in rubric.criteria:
        crit_checks = checks.get(c.id, [])
        grade = CriterionGrade(c.id, c.title, c.points, None, evidence=[asdict(k) for k in crit_checks])
        if code is not None:
            model = code["scores"][c.id]
            grade.model_score, grade.rationale = model["score"], model["rationale"]
            score = model["score"]
            if score < 0:
                grade.adjustments.append(f"clamped from {_fmt(score)} to 0")
                score = 0.0
            elif score > c.points:
                grade.adjustments.append(f"clamped from {_fmt(score)} to {_fmt(c.points)} (the criterion's points)")
                score = c.points
            failed = [k for k in crit_checks if not k.passed]
            cap = round(c.points * c.missing_evidence_cap, 2)
            if failed and score > cap:
                reasons = "; ".join(k.detail for k in failed)
                grade.adjustments.append(
                    f"capped at {_fmt(cap)}/{_fmt(c.points)} because evidence is missing: {reasons}")
                score = cap
            grade.score = round(score, 2)
        grades.append(grade)
    return grades


# -- one retry, then a human ---------------------------------------------------------------------

@dataclass
class ValidatedAnalysis:
    code: dict | None                  # parsed scores, or None
    feedback: dict | None              # parsed feedback, or None
    answers: list                      # every ModelAnswer, all attempts
    problems: dict                     # role -> problems of its last attempt (empty if valid)
    combined: list                     # generate_many's combined metrics, one per round
    request_failed: dict               # role -> True if the last attempt never got an answer

    @property
    def review_reasons(self) -> list[str]:
        names = {CODE: "code-analysis answer", FEEDBACK: "feedback answer"}
        return [f"{names[role]} unusable after a retry: " + "; ".join(problems)
                for role, problems in self.problems.items() if problems]


def _check(answer: ModelAnswer, rubric: Rubric):
    return check_code_answer(answer, rubric) if answer.role == CODE else check_feedback_answer(answer)


def obtain_answers(client, requests: list[ModelRequest], rubric: Rubric, options: GradingOptions) -> ValidatedAnalysis:
    """Run the requests in parallel, validate both answers, retry the unusable ones once (in parallel)."""
    answers, combined = run_requests(client, requests, attempt=1)
    rounds = [combined]
    everything = list(answers)
    parsed, problems, failed = {}, {}, {}
    for answer in answers:
        parsed[answer.role], problems[answer.role] = _check(answer, rubric)
        failed[answer.role] = answer.error is not None
    again = [(req, ans) for req, ans in zip(requests, answers) if problems[ans.role]]
    if again:
        retries = [retry_request(req, "; ".join(problems[ans.role]), ans, options) for req, ans in again]
        answers2, combined2 = run_requests(client, retries, attempt=2)
        rounds.append(combined2)
        everything.extend(answers2)
        for answer in answers2:
            parsed[answer.role], problems[answer.role] = _check(answer, rubric)
            failed[answer.role] = answer.error is not None
    return ValidatedAnalysis(code=parsed.get(CODE), feedback=parsed.get(FEEDBACK), answers=everything,
                             problems=problems, combined=rounds, request_failed=failed)
