"""Layer 4, validation: the models' answers checked, retried once, and reconciled with the evidence.

- an answer that does not parse, lacks a criterion, names an unknown one or
  has a non-numeric score is *invalid*; a valid answer that fails the quality
  checks (``quality.py``) is not used either. Either is sent once more with
  another seed, told what was wrong; still failing, it is dropped (an invalid
  one also flags the submission for human review);
- each criterion's score starts from its evidence score (``scoring.py``); the
  model's score, clamped to ``0..points``, moves it by at most the criterion's
  band and never above what the evidence allows.

Every change to a score is recorded with its reason.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from .analysis import CODE, FEEDBACK, ModelAnswer, ModelRequest, instructions_of, retry_request, run_requests
from .evidence import Check
from .options import GradingOptions
from .quality import NotebookText, code_answer_problems, feedback_answer_problems
from .rubric import Rubric
from .scoring import bounded, evidence_score


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


# -- scores: the evidence first, the model's view within a band ----------------------------------------

@dataclass
class CriterionGrade:
    id: str
    title: str
    points: float
    score: float | None
    evidence_score: float | None = None
    evidence_reason: str = ""
    model_score: float | None = None
    model_adjustment: float = 0.0
    adjustment_reason: str = ""
    rationale: str = ""                               # the model's, when its view was used
    evidence: list = field(default_factory=list)      # the criterion's checks, as dicts
    adjustments: list = field(default_factory=list)   # every change to the model's score, with its reason

    def to_dict(self) -> dict:
        return asdict(self)


def _fmt(x: float) -> str:
    return f"{x:g}"


def reconcile(rubric: Rubric, checks: dict[str, list[Check]], code: dict | None,
              not_used: str | None = None) -> list[CriterionGrade]:
    """Each criterion's evidence score, moved by the model's score (clamped to the criterion's points)
    within the criterion's band and below the evidence's ceiling; without a usable model answer the
    evidence score stands and ``not_used`` says why."""
    grades = []
    for c in rubric.criteria:
        crit_checks = checks.get(c.id, [])
        ev = evidence_score(c, crit_checks)
        grade = CriterionGrade(c.id, c.title, c.points, ev.score, evidence_score=ev.score, evidence_reason=ev.reason,
                               evidence=[asdict(k) for k in crit_checks])
        if code is None:
            grade.adjustment_reason = f"the model's view was not used: {not_used or 'no answer'}"
            grades.append(grade)
            continue
        model = code["scores"][c.id]
        grade.model_score, grade.rationale = model["score"], model["rationale"]
        score = model["score"]
        if score < 0:
            grade.adjustments.append(f"clamped from {_fmt(score)} to 0")
            score = 0.0
        elif score > c.points:
            grade.adjustments.append(f"clamped from {_fmt(score)} to {_fmt(c.points)} (the criterion's points)")
            score = c.points
        moved = bounded(c, ev, score)
        grade.score, grade.model_adjustment, grade.adjustment_reason = moved.score, moved.adjustment, moved.reason
        if abs(moved.score - score) > 1e-9:
            grade.adjustments.append(f"{_fmt(score)} became {_fmt(moved.score)}: {moved.reason}")
        grades.append(grade)
    return grades


# -- one retry, then dropped -----------------------------------------------------------------------

NAMES = {CODE: "code-analysis answer", FEEDBACK: "feedback answer"}


@dataclass
class ValidatedAnalysis:
    code: dict | None                  # parsed scores that passed every check, or None
    feedback: dict | None              # parsed feedback that passed every check, or None
    answers: list                      # every ModelAnswer, all attempts
    problems: dict                     # role -> why its last attempt is invalid (schema, JSON, request)
    combined: list                     # generate_many's combined metrics, one per round
    request_failed: dict               # role -> True if the last attempt never got an answer
    quality: dict = field(default_factory=dict)  # role -> quality problems of its last attempt (valid JSON)

    @property
    def review_reasons(self) -> list[str]:
        return [f"{NAMES[role]} unusable after a retry: " + "; ".join(problems)
                for role, problems in self.problems.items() if problems]

    def not_used(self, role: str, short: bool = False) -> str | None:
        """Why the role's answer is not used (None: it is); ``short``: without the list of problems."""
        if self.problems.get(role):
            return "invalid after a retry" + ("" if short else ": " + _listed(self.problems[role]))
        if self.quality.get(role):
            return ("failed the quality checks twice (another seed the second time)"
                    + ("" if short else ": " + _listed(self.quality[role])))
        return None


def _listed(problems: list[str], most: int = 6) -> str:
    return "; ".join(problems[:most]) + (f"; and {len(problems) - most} more" if len(problems) > most else "")


def _check(answer: ModelAnswer, rubric: Rubric):
    return check_code_answer(answer, rubric) if answer.role == CODE else check_feedback_answer(answer)


def _quality(parsed: dict, answer: ModelAnswer, prompt: str, notebook: NotebookText | None) -> list[str]:
    if notebook is None:
        return []
    instructions = instructions_of(prompt)
    if answer.role == CODE:
        return code_answer_problems(parsed, instructions, notebook)
    return feedback_answer_problems(parsed, instructions, notebook)


def obtain_answers(client, requests: list[ModelRequest], rubric: Rubric, options: GradingOptions,
                   notebook: NotebookText | None = None) -> ValidatedAnalysis:
    """Run the requests in parallel; check both answers (schema, then quality against ``notebook``); retry
    the failing ones once, in parallel, with another seed; an answer still failing is dropped."""
    prompts = {r.role: r.kwargs["prompt"] for r in requests}
    parsed, problems, quality, failed = {}, {}, {}, {}

    def judge(answer: ModelAnswer) -> None:
        data, problems[answer.role] = _check(answer, rubric)
        quality[answer.role] = _quality(data, answer, prompts[answer.role], notebook) if data is not None else []
        parsed[answer.role] = data if not quality[answer.role] else None
        failed[answer.role] = answer.error is not None

    answers, combined = run_requests(client, requests, attempt=1)
    rounds, everything = [combined], list(answers)
    for answer in answers:
        judge(answer)
    again = [(req, ans) for req, ans in zip(requests, answers) if problems[ans.role] or quality[ans.role]]
    if again:
        retries = [retry_request(req, "; ".join(problems[ans.role] or quality[ans.role]), ans, options)
                   for req, ans in again]
        answers2, combined2 = run_requests(client, retries, attempt=2)
        rounds.append(combined2)
        everything.extend(answers2)
        for answer in answers2:
            judge(answer)
    return ValidatedAnalysis(code=parsed.get(CODE), feedback=parsed.get(FEEDBACK), answers=everything,
                             problems=problems, combined=rounds, request_failed=failed, quality=quality)
