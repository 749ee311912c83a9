"""Issue 18: scores from evidence first, the model's view bounded and checked, feedback grounded (no model)."""
from pathlib import Path

import pytest

from disaggregated_inference.grading import grade_notebook, load_rubric, render_markdown, rubric_from_dict
from disaggregated_inference.grading.analysis import CODE, FEEDBACK
from disaggregated_inference.grading.evidence import Check, check_rubric, collect_evidence
from .fakes import FEEDBACK_ANSWER, FakeGradingClient, full_marks_answer
from disaggregated_inference.grading.notebook import load_submission
from disaggregated_inference.grading.quality import (NotebookText, code_answer_problems, degenerate,
                                                     feedback_answer_problems, item_problems)
from disaggregated_inference.grading.scoring import bounded, evidence_score

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOKS = EXAMPLES / "notebooks"


@pytest.fixture(scope="module")
def rubric():
    return load_rubric(EXAMPLES / "rubric.yaml")


def evidence_scores(rubric, name):
    nb = load_submission(NOTEBOOKS / f"{name}.ipynb").notebook
    checks = check_rubric(rubric, collect_evidence(nb))
    return {c.id: evidence_score(c, checks[c.id]).score for c in rubric.criteria}


@pytest.mark.parametrize("name, expected", [
    ("good_sales_analysis", {"data_loading": 8, "aggregation": 10, "visualisation": 10, "interpretation": 6,
                             "code_quality": 6}),
    # a SyntaxError, a NameError, a chart cell never run, little markdown, no function
    ("errors_sales_analysis", {"data_loading": 8, "aggregation": 10, "visualisation": 5, "interpretation": 0,
                               "code_quality": 0}),
    ("incomplete_sales_analysis", {"data_loading": 8, "aggregation": 0, "visualisation": 0, "interpretation": 0,
                                   "code_quality": 1.5}),  # 2 of 3 rules (+4) but capped at 25% of 6
])
def test_evidence_scores_of_the_examples(rubric, name, expected):
    assert evidence_scores(rubric, name) == expected


def test_rule_points_and_default_shares():
    rubric = rubric_from_dict({"title": "t", "criteria": [
        {"id": "a", "title": "A", "points": 10, "missing_evidence_cap": 1,
         "evidence": {"imports": ["pandas", "numpy"], "chart": True, "points": {"chart": 6}}},
        {"id": "b", "title": "B", "points": 4, "no_evidence_share": 0.75}]})
    a, b = rubric.criteria
    checks = [Check("imports pandas", True, "", "imports"), Check("imports numpy", False, "", "imports"),
              Check("chart", True, "", "chart")]
    score = evidence_score(a, checks)
    assert score.score == 8  # chart 6 + pandas 2 (the 4 points left shared by the two imports)
    assert "imports pandas (+2), chart (+6)" in score.reason and "not met: imports numpy" in score.reason
    assert evidence_score(b, []).score == 3


def test_rule_points_are_validated():
    from disaggregated_inference.errors import RubricError

    base = {"id": "a", "title": "A", "points": 10, "evidence": {"chart": True, "points": {"imports": 3}}}
    with pytest.raises(RubricError, match=r"evidence.points.imports gives points to a rule"):
        rubric_from_dict({"title": "t", "criteria": [base]})
    base["evidence"]["points"] = {"chart": 4}
    with pytest.raises(RubricError, match="add up to 4; they must add up to the criterion's 10 points"):
        rubric_from_dict({"title": "t", "criteria": [base]})
    with pytest.raises(RubricError, match="model_band must be a number"):
        rubric_from_dict({"title": "t", "model_band": 2, "criteria": [{"id": "a", "title": "A", "points": 1}]})


def test_the_band_bounds_a_model_that_says_full_marks():
    rubric = rubric_from_dict({"title": "t", "criteria": [
        {"id": "a", "title": "A", "points": 10, "missing_evidence_cap": 1,
         "evidence": {"functions": ["f1", "f2", "f3", "f4", "f5"]}}]})
    c = rubric.criteria[0]
    checks = [Check(f"uses f{i}", i == 1, "", "functions") for i in range(1, 6)]
    ev = evidence_score(c, checks)
    assert ev.score == 2
    moved = bounded(c, ev, 10)  # the model says 10/10: it moves the 2 by the band (25% of 10) only
    assert (moved.score, moved.adjustment) == (4.5, 2.5)
    assert moved.reason == "model said 10/10 (+8 from the evidence); limited by the band of ±2.5 to +2.5"
    assert bounded(c, ev, 0).score == 0 and bounded(c, ev, 3).score == 3
    # a narrower band from the rubric
    narrow = rubric_from_dict({"title": "t", "criteria": [
        {"id": "a", "title": "A", "points": 10, "model_band": 0.1, "missing_evidence_cap": 1,
         "evidence": {"functions": ["f1", "f2", "f3", "f4", "f5"]}}]}).criteria[0]
    assert bounded(narrow, ev, 10).score == 3


def test_a_model_answer_with_one_reason_for_everything_is_not_used(rubric):
    same = lambda kwargs: {"scores": {cid: {"score": 0, "rationale": "The code is well tested and documented."}  # noqa
                                      for cid in kwargs["json_schema"]["properties"]["scores"]["required"]},
                           "issues": []}
    fake = FakeGradingClient(code=[same, same])
    result = grade_notebook(NOTEBOOKS / "good_sales_analysis.ipynb", rubric, fake)
    assert fake.rounds == [[CODE, FEEDBACK], [CODE]]
    assert fake.calls[2]["seed"] == fake.calls[0]["seed"] + 1  # retried once with another seed
    assert result["total"] == 40 and result["status"] == "graded"  # the evidence stands, not the model's zeros
    why = result["layers"]["validation"]["model_not_used"]["code"]
    assert why.startswith("failed the quality checks twice") and "the same reason for data_loading and" in why
    assert all(c["model_score"] is None and c["adjustment_reason"].startswith("the model's view was not used")
               for c in result["criteria"])
    assert "### Model answers not used" in render_markdown(result)
    assert result["feedback"]["model_text"]["issues"].startswith("not used: failed the quality checks")


def test_a_failed_request_is_retried_as_it_was(rubric):
    from disaggregated_inference.errors import NoServerAvailable

    fake = FakeGradingClient(code=[NoServerAvailable("busy")])
    grade_notebook(NOTEBOOKS / "good_sales_analysis.ipynb", rubric, fake)
    assert fake.calls[2]["prompt"] == fake.calls[0]["prompt"]  # nothing about the failure told to the model
    assert fake.calls[2]["seed"] == fake.calls[0]["seed"] + 1


def test_a_failing_answer_passing_on_retry_is_used(rubric):
    same = lambda kwargs: {"scores": {cid: {"score": 0, "rationale": "The code is well tested and documented."}  # noqa
                                      for cid in kwargs["json_schema"]["properties"]["scores"]["required"]},
                           "issues": []}
    low = lambda kwargs: full_marks_answer(kwargs, score=lambda cid, points: 0)  # noqa: E731
    result = grade_notebook(NOTEBOOKS / "good_sales_analysis.ipynb", rubric, FakeGradingClient(code=[same, low]))
    assert result["layers"]["validation"]["model_not_used"] == {}
    # the model's 0s lower each criterion by a quarter of its points: 40 - 10
    assert result["total"] == 30 and all(c["model_adjustment"] == -c["points"] / 4 for c in result["criteria"])


def test_feedback_of_single_words_or_off_notebook_is_never_shown(rubric):
    words = {"summary": "Good work on the regional analysis overall.", "strengths": ["North", "South", "West"],
             "improvements": ["Cost", "Revenue", "Margin"]}
    fake = FakeGradingClient(feedback=[words, words])
    result = grade_notebook(NOTEBOOKS / "good_sales_analysis.ipynb", rubric, fake)
    fb = result["feedback"]
    assert fake.rounds == [[CODE, FEEDBACK], [FEEDBACK]]
    shown = fb["strengths"] + fb["improvements"]
    assert not set(shown) & {"North", "South", "West", "Cost", "Revenue", "Margin"}
    assert set(fb["sources"]["strengths"]) == {"checks"} and fb["strengths"]
    assert fb["summary"].startswith("The automatic checks found the evidence for 5 of 5 criteria")
    assert "fewer than 3 words" in fb["model_text"]["feedback"]


def test_quality_checks(rubric):
    nb = load_submission(NOTEBOOKS / "good_sales_analysis.ipynb").notebook
    text = NotebookText.of(nb)
    instructions = "Answer in JSON only. For every criterion id give a score and a one-sentence rationale."
    assert item_problems("The groupby of revenue by region in cell 3 is clear.", instructions, text) == []
    assert item_problems("Great job, keep it up and stay motivated!", instructions, text) == [
        "not about this notebook (no word of its code, outputs or markdown)"]
    assert "fewer than 3 words" in item_problems("North", instructions, text)
    assert degenerate("the chart the chart the chart the chart is good") is not None
    assert degenerate("revenue revenue revenue revenue") is not None
    assert degenerate("Cell 5 draws revenue by region with a title.") is None
    copied = {"scores": {"a": {"score": 1, "rationale": "For every criterion id give a score and a one-sentence"},
                         "b": {"score": 1, "rationale": "Cell 3 totals revenue by region"}}, "issues": []}
    assert any("copies the prompt" in p for p in code_answer_problems(copied, instructions, text))
    ok = {"summary": "You load and total the sales data well.", "strengths": FEEDBACK_ANSWER["strengths"],
          "improvements": FEEDBACK_ANSWER["improvements"]}
    assert feedback_answer_problems(ok, instructions, text) == []
    twice = {**ok, "improvements": ok["strengths"]}
    assert any("given twice" in p for p in feedback_answer_problems(twice, instructions, text))


def test_grounded_feedback_names_cells_and_criteria(rubric):
    result = grade_notebook(NOTEBOOKS / "errors_sales_analysis.ipynb", rubric, FakeGradingClient())
    fb = result["feedback"]
    from_checks = [item for item, src in zip(fb["improvements"], fb["sources"]["improvements"]) if src == "checks"]
    assert from_checks[:3] == ["Cell 3 cannot run: its code has an error at line 1 ('(' was never closed).",
                               "Cell 4 stopped with NameError: name 'total_revenue' is not defined.",
                               "Cell 5 never ran: run the notebook top to bottom before handing it in."]
    assert any(i.startswith("Chart of revenue by region: plotting code in cell 5") for i in from_checks)
    assert "Load and inspect the data: pandas is imported; read_csv is used." in fb["strengths"]
