"""Scores from evidence first; the code-analysis model's view moves them only within a band.

For each criterion:

- ``evidence_score``: each evidence rule met earns its points (the rubric's
  ``evidence.points``, or an equal share of what the weighted rules leave); a
  criterion without rules starts at ``no_evidence_share`` of its points. When a
  rule is not met the criterion's ceiling is ``missing_evidence_cap`` of its points.
- ``bounded``: the model's score, if its answer was usable and passed the
  quality checks, moves the evidence score by at most ``model_band`` of the
  criterion's points, never below 0 nor above the ceiling.

Every number comes with the reason for it.
"""
from __future__ import annotations

from dataclasses import dataclass

from .evidence import Check
from .rubric import Criterion


def _fmt(x: float) -> str:
    return f"{round(x, 2):g}"


@dataclass
class EvidenceScore:
    score: float
    ceiling: float   # the most this criterion may score with this evidence
    reason: str


def rule_points(criterion: Criterion, checks: list[Check]) -> list[float]:
    """The points each check is worth: a hidden test its own points; a weighted rule's points split between
    its names; what is left of the criterion's points shared equally by the unweighted rules."""
    weights = dict(criterion.evidence.points)
    per_key: dict[str, int] = {}
    for k in checks:
        per_key[k.key] = per_key.get(k.key, 0) + 1
    unweighted = [k for k in checks if k.key not in weights and k.points is None]
    rest = max(0.0, criterion.points - sum(weights.values()) - sum(k.points for k in checks if k.points is not None))
    share = rest / len(unweighted) if unweighted else 0.0
    return [k.points if k.points is not None else weights[k.key] / per_key[k.key] if k.key in weights else share
            for k in checks]


def evidence_score(criterion: Criterion, checks: list[Check]) -> EvidenceScore:
    """The score from the checks: each rule met and each hidden test passed earns its points; a failing
    rule caps the criterion at ``missing_evidence_cap`` of its points, a failing test loses its own points."""
    points = criterion.points
    rules = [k for k in checks if k.points is None]
    tests = [k for k in checks if k.points is not None]
    if not checks:
        score = round(points * criterion.no_evidence_share, 2)
        return EvidenceScore(score, points, f"no evidence rules: starts at {_fmt(criterion.no_evidence_share * 100)}%"
                                            f" of the points ({_fmt(score)}/{_fmt(points)})")
    worth = rule_points(criterion, checks)
    earned = sum(w for w, k in zip(worth, checks) if k.passed)
    met = [k for k in checks if k.passed]
    failed = [k for k in checks if not k.passed]
    parts = [f"{k.rule} (+{_fmt(w)})" for w, k in zip(worth, checks) if k.passed]
    reason = f"{len(met)} of {len(checks)} {'checks' if tests else 'evidence rules'} met"
    if parts:
        reason += ": " + ", ".join(parts)
    if failed:
        reason += "; not met: " + "; ".join(f"{k.rule} ({k.detail})" for k in failed)
    if not rules:  # only hidden tests: the rest of the points starts as a criterion without rules does
        rest = max(0.0, points - sum(k.points for k in tests))
        if rest > 0:
            base = round(rest * criterion.no_evidence_share, 2)
            earned += base
            reason += (f"; no evidence rules for the other {_fmt(rest)} points: they start at "
                       f"{_fmt(criterion.no_evidence_share * 100)}% (+{_fmt(base)})")
    ceiling = points
    if any(not k.passed for k in rules):
        ceiling = round(points * criterion.missing_evidence_cap, 2)
    lost = sum(k.points for k in tests if not k.passed)
    ceiling = round(min(ceiling, points - lost), 2)
    if earned > ceiling + 1e-9:
        reason += f"; capped at {_fmt(ceiling)} because evidence is missing"
        earned = ceiling
    return EvidenceScore(round(earned, 2), ceiling, reason)


@dataclass
class Bounded:
    score: float
    adjustment: float
    reason: str


def bounded(criterion: Criterion, evidence: EvidenceScore, model_score: float) -> Bounded:
    """The final score from the evidence score and a usable model score: moved toward the model's by at
    most the band, within 0 and the evidence's ceiling."""
    band = round(criterion.points * criterion.model_band, 2)
    wanted = model_score - evidence.score
    move = max(-band, min(band, wanted))
    final = max(0.0, min(evidence.ceiling, evidence.score + move))
    applied = round(final - evidence.score, 2)
    reason = f"model said {_fmt(model_score)}/{_fmt(criterion.points)}"
    if abs(wanted) < 1e-9:
        reason += ", the same as the evidence"
    else:
        reason += f" ({'+' if wanted > 0 else ''}{_fmt(wanted)} from the evidence)"
        if abs(applied - wanted) > 1e-9:
            limits = [f"the band of ±{_fmt(band)}"] if abs(wanted) > band else []
            if evidence.score + move > evidence.ceiling:
                limits.append(f"the evidence's ceiling of {_fmt(evidence.ceiling)}")
            reason += f"; limited by {' and '.join(limits) or 'the range 0 to the points'} to "
            reason += f"{'+' if applied > 0 else ''}{_fmt(applied)}"
    return Bounded(round(final, 2), applied, reason)
