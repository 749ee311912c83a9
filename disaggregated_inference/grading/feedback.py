"""Grounded feedback: the deterministic findings phrased for a student, then the models' text that passed.

``compose_feedback`` always gives the student what the checks found (which
cells fail, what each criterion is missing, what was done well); the feedback
model's summary and items, and the code model's issues, are added only when
their answer passed every check (``quality.py``). Each list says where its
items came from in ``sources`` so a teacher can trace them.
"""
from __future__ import annotations

from .evidence import Check, Evidence
from .rubric import Rubric


def _cells(numbers) -> str:
    numbers = sorted(set(numbers))
    return ("cell " if len(numbers) == 1 else "cells ") + ", ".join(map(str, numbers))


def findings_for_student(rubric: Rubric, evidence: Evidence, checks: dict[str, list[Check]]) -> dict:
    """{"strengths": [...], "improvements": [...]} from the evidence alone."""
    strengths, improvements = [], []
    for e in evidence.syntax_errors:
        where = f" at line {e['line']}" if e["line"] is not None else ""
        improvements.append(f"Cell {e['cell']} cannot run: its code has an error{where} ({e['message']}).")
    for e in evidence.error_outputs:
        if any(s["cell"] == e["cell"] for s in evidence.syntax_errors):
            continue
        improvements.append(f"Cell {e['cell']} stopped with {e['ename']}: {e['evalue'][:100]}.".replace("..", "."))
    if evidence.unexecuted_cells:
        improvements.append(f"{_cells(evidence.unexecuted_cells).capitalize()} never ran: run the notebook "
                            "top to bottom before handing it in.")
    for c in rubric.criteria:
        items = checks.get(c.id, [])
        if not items:
            continue
        # a hidden test the grader could not run is the grader's matter, not the student's
        missing = [k for k in items if not k.passed and k.key not in ("runs_clean", "executed")
                   and not (k.key == "tests" and k.detail.startswith("not run"))]
        if missing:
            improvements.append(f"{c.title}: " + "; ".join(k.detail for k in missing) + ".")
        elif all(k.passed for k in items):
            strengths.append(f"{c.title}: " + "; ".join(k.detail for k in items) + ".")
    return {"strengths": strengths, "improvements": improvements}


def compose_feedback(rubric: Rubric, evidence: Evidence, checks: dict[str, list[Check]], total: float | None,
                     model_feedback: dict | None, model_issues: list | None,
                     feedback_not_used: str | None, code_not_used: str | None) -> dict:
    found = findings_for_student(rubric, evidence, checks)
    met = sum(1 for c in rubric.criteria if checks.get(c.id) and all(k.passed for k in checks[c.id]))
    with_rules = sum(1 for c in rubric.criteria if checks.get(c.id))
    summary = (f"The automatic checks found the evidence for {met} of {with_rules} criteria"
               + (f"; your score is {total:g} of {rubric.max_points:g}." if total is not None else "."))
    model = model_feedback or {}
    strengths = found["strengths"] + list(model.get("strengths", []))
    improvements = found["improvements"] + list(model.get("improvements", []))
    issues = list(model_issues or [])
    return {
        "summary": model.get("summary") or summary,
        "strengths": strengths,
        "improvements": improvements,
        "issues": issues,
        "sources": {
            "summary": "feedback model" if model.get("summary") else "checks",
            "strengths": ["checks"] * len(found["strengths"]) + ["feedback model"] * len(model.get("strengths", [])),
            "improvements": (["checks"] * len(found["improvements"])
                             + ["feedback model"] * len(model.get("improvements", []))),
            "issues": ["code model"] * len(issues),
        },
        "model_text": {"feedback": "used" if model_feedback is not None else f"not used: {feedback_not_used}",
                       "issues": "used" if model_issues is not None else f"not used: {code_not_used}"},
    }
