"""Calibration notebooks graded as a teacher would order them, on the real embedded cluster.

The unit part (no model) checks their evidence scores; the slow part grades them once through the real servers
and small packaged models, as the grader's CLI does (several notebooks at once): the order holds, every number
is traced, and every feedback item a student would see is either a finding of the checks or model text that
passed the quality checks. That grading the same notebook again gives the same result is
tests/test_grading_real.py's ``test_a_notebook_graded_again_gets_the_same_result``.
"""
import pytest

from disaggregated_inference.grading import load_rubric
from disaggregated_inference.grading.analysis import instructions_of, plan_requests
from disaggregated_inference.grading.evidence import check_rubric, collect_evidence
from disaggregated_inference.grading.feedback import findings_for_student
from disaggregated_inference.grading.notebook import load_submission
from disaggregated_inference.grading.quality import NotebookText, item_problems, text_problems
from disaggregated_inference.grading.scoring import evidence_score

from .conftest import CALIBRATION, EXAMPLES

ORDER = ["excellent", "decent", "weak", "wrong"]


@pytest.fixture(scope="module")
def rubric():
    return load_rubric(EXAMPLES / "rubric.yaml")


def test_calibration_notebooks_are_real_and_their_evidence_is_ordered(rubric):
    totals = {}
    for name in ORDER:
        sub = load_submission(CALIBRATION / f"{name}.ipynb")
        assert sub.ok, sub.problems
        code = [c for c in sub.notebook.cells if c.cell_type == "code"]
        assert all(c.get("execution_count") for c in code) and any(c.get("outputs") for c in code)
        checks = check_rubric(rubric, collect_evidence(sub.notebook))
        totals[name] = sum(evidence_score(c, checks[c.id]).score for c in rubric.criteria)
    assert totals == {"excellent": 40, "decent": 29.5, "weak": 19.5, "wrong": 9.5}


def shown_items(result):
    fb = result["feedback"]
    for key in ("strengths", "improvements", "issues"):
        yield from zip(fb[key], fb["sources"][key])


@pytest.mark.slow
def test_calibration_order_on_the_embedded_cluster(calibration_run):
    rubric, options, results = calibration_run
    first = [results[n] for n in ORDER]
    totals = [r["total"] for r in first]
    assert totals[0] > totals[1] > totals[2] > totals[3], totals
    for result in first:
        assert result["status"] in ("graded", "needs_review"), result["review_reasons"]
        for c in result["criteria"]:  # every number traced: the evidence's reason and the adjustment's
            assert c["evidence_reason"] and c["adjustment_reason"], c
            criterion = rubric.criterion(c["id"])
            assert abs(c["score"] - c["evidence_score"]) <= criterion.points * criterion.model_band + 1e-9
        sub = load_submission(result["submission"]["file"])
        evidence = collect_evidence(sub.notebook)
        checks = check_rubric(rubric, evidence)
        found = findings_for_student(rubric, evidence, checks)
        text = NotebookText.of(sub.notebook)
        requests, _ = plan_requests(rubric, sub.notebook, evidence, checks, options)
        instructions = {r.role: instructions_of(r.kwargs["prompt"]) for r in requests}
        for item, source in shown_items(result):
            if source == "checks":
                assert item in found["strengths"] + found["improvements"]
            else:  # model text shown to a student passed the checks
                role = "code" if source == "code model" else "feedback"
                assert item_problems(item, instructions[role], text) == [], (source, item)
        if result["feedback"]["sources"]["summary"] == "feedback model":
            assert [p for p in text_problems(result["feedback"]["summary"], instructions["feedback"])
                    if p != "fewer than 3 words"] == []
