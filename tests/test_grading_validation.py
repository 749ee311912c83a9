"""Layer 4: answers checked, clamped, reconciled with evidence; retried once, then flagged.

The model answers come from FakeGradingClient (canned JSON): this tests the
grader's logic, not the models.
"""
import json
from pathlib import Path

import pytest

from disaggregated_inference.errors import NoServerAvailable
from disaggregated_inference.grading import grade_notebook
from disaggregated_inference.grading.analysis import CODE, FEEDBACK, ModelAnswer
from disaggregated_inference.grading.evidence import Check
from disaggregated_inference.grading.fakes import FEEDBACK_ANSWER, FakeGradingClient, full_marks_answer
from disaggregated_inference.grading.rubric import load_rubric, rubric_from_dict
from disaggregated_inference.grading.validation import check_code_answer, check_feedback_answer, reconcile

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOKS = EXAMPLES / "notebooks"
RUBRIC = rubric_from_dict({"title": "t", "criteria": [
    {"id": "a", "title": "A", "points": 10, "evidence": {"chart": True}},
    {"id": "b", "title": "B", "points": 4, "missing_evidence_cap": 0.25}]})


@pytest.fixture(scope="module")
def rubric():
    return load_rubric(EXAMPLES / "rubric.yaml")


def answer(text, role=CODE, finish="stop"):
    return ModelAnswer(role, "m", 1, text=text, metrics={"finish_reason": finish})


@pytest.mark.parametrize("text, problem", [
    ('{"scores": {"a": {"score": 5, "rationale": "x"}', "not valid JSON"),
    ("[]", "no 'scores' object"),
    ('{"scores": {"a": {"score": 5, "rationale": "x"}}}', "no score for criteria b"),
    ('{"scores": {"a": {"score": 5}, "b": {"score": 1}, "z": {"score": 1}}}', "not in the rubric: z"),
    ('{"scores": {"a": {"score": "high"}, "b": {"score": 1}}}', 'the score of a is not a number: "high"'),
    ('{"scores": {"a": {"score": true}, "b": {"score": 1}}}', "the score of a is not a number: true"),
])
def test_invalid_code_answers(text, problem):
    parsed, problems = check_code_answer(answer(text), RUBRIC)
    assert parsed is None and any(problem in p for p in problems), problems


def test_truncated_answer_says_so():
    _, problems = check_code_answer(answer('{"scores": {', finish="length"), RUBRIC)
    assert "cut off at max_tokens" in problems[0]


def test_valid_answers_parse():
    parsed, problems = check_code_answer(answer(json.dumps(
        {"scores": {"a": {"score": 7, "rationale": "ok"}, "b": {"score": 2.5, "rationale": "ok"}},
         "issues": ["one", 3, ""]})), RUBRIC)
    assert problems == [] and parsed["scores"]["b"] == {"score": 2.5, "rationale": "ok"}
    assert parsed["issues"] == ["one"]
    fb, problems = check_feedback_answer(answer('{"summary": " Good. ", "strengths": ["s"], "improvements": []}',
                                                FEEDBACK))
    assert fb == {"summary": "Good.", "strengths": ["s"], "improvements": []}
    assert check_feedback_answer(answer('{"summary": ""}', FEEDBACK))[1] == ["the feedback has no summary"]
    _, problems = check_feedback_answer(answer('{"summary": "x", "strengths": ["1", "2"], "improvements": ["2"]}',
                                               FEEDBACK))
    assert problems == ["inconsistent: '2' is given both as a strength and as an improvement"]
    # small models sometimes put a raw newline inside a string: still usable
    fb, problems = check_feedback_answer(answer('{"summary": "Good.\n", "strengths": [], "improvements": []}',
                                                FEEDBACK))
    assert problems == [] and fb["summary"] == "Good."


def test_scores_are_clamped_and_capped_with_reasons():
    code = {"scores": {"a": {"score": 14, "rationale": ""}, "b": {"score": -2, "rationale": ""}}}
    checks = {"a": [Check("chart", False, "no chart: no chart output and no plotting code")], "b": []}
    a, b = reconcile(RUBRIC, checks, code)
    assert (a.model_score, a.score) == (14, 5.0)
    assert a.adjustments == ["clamped from 14 to 10 (the criterion's points)",
                             "capped at 5/10 because evidence is missing: "
                             "no chart: no chart output and no plotting code"]
    assert (b.score, b.adjustments) == (0.0, ["clamped from -2 to 0"])
    # evidence present: the model's score in range stands; a low score is never raised
    a, b = reconcile(RUBRIC, {"a": [Check("chart", True, "chart")], "b": []},
                     {"scores": {"a": {"score": 10, "rationale": ""}, "b": {"score": 1, "rationale": ""}}})
    assert (a.score, a.adjustments, b.score) == (10, [], 1)
    # a score already under the cap is not changed
    low = {"scores": {"a": {"score": 3, "rationale": ""}, "b": {"score": 1, "rationale": ""}}}
    a, _ = reconcile(RUBRIC, checks, low)
    assert (a.score, a.adjustments) == (3, [])


def test_missing_chart_cannot_get_full_marks(rubric):
    fake = FakeGradingClient()  # full marks on everything
    result = grade_notebook(NOTEBOOKS / "incomplete_sales_analysis.ipynb", rubric, fake)
    assert result["status"] == "graded" and not result["needs_review"]
    vis = {c["id"]: c for c in result["criteria"]}["visualisation"]
    assert (vis["model_score"], vis["score"]) == (10, 5)
    assert "no chart" in vis["adjustments"][0]
    assert result["layers"]["validation"]["adjustments"]["visualisation"] == vis["adjustments"]
    assert result["total"] == 8 + 5 + 5 + 3 + 1.5


def test_good_notebook_keeps_full_marks(rubric):
    result = grade_notebook(NOTEBOOKS / "good_sales_analysis.ipynb", rubric, FakeGradingClient())
    assert (result["status"], result["total"], result["percent"]) == ("graded", 40, 100.0)
    assert all(not c["adjustments"] for c in result["criteria"])
    assert result["feedback"]["summary"].startswith("Fake feedback")
    assert result["feedback"]["issues"] == ["fake issue"]


def test_invalid_answer_is_retried_once_and_accepted(rubric):
    fake = FakeGradingClient(code=["this is not JSON"])
    result = grade_notebook(NOTEBOOKS / "good_sales_analysis.ipynb", rubric, fake)
    assert fake.rounds == [[CODE, FEEDBACK], [CODE]]  # only the bad answer is asked again
    retry = fake.calls[2]
    assert "Your previous answer was rejected: not valid JSON" in retry["prompt"]
    assert retry["prompt"].startswith(fake.calls[0]["prompt"])
    assert (retry["temperature"], retry["seed"], retry["json_schema"]) == (
        fake.calls[0]["temperature"], fake.calls[0]["seed"], fake.calls[0]["json_schema"])
    assert result["status"] == "graded" and result["total"] == 40
    assert result["layers"]["validation"]["retried"] == [CODE]
    assert [(a["role"], a["attempt"]) for a in result["layers"]["analysis"]["answers"]] == [
        (CODE, 1), (FEEDBACK, 1), (CODE, 2)]
    assert len(result["inference"]["requests"]) == 3


def test_still_invalid_after_retry_is_flagged(rubric):
    missing = lambda kwargs: {"scores": {"data_loading": {"score": 1, "rationale": "x"}}, "issues": []}  # noqa: E731
    fake = FakeGradingClient(code=[missing, missing], feedback=["{}", "{}"])
    result = grade_notebook(NOTEBOOKS / "good_sales_analysis.ipynb", rubric, fake)
    assert fake.rounds == [[CODE, FEEDBACK], [CODE, FEEDBACK]]  # once more, both together, then no more
    assert result["status"] == "needs_review" and result["needs_review"]
    assert result["total"] is None and all(c["score"] is None for c in result["criteria"])
    assert result["feedback"] is None
    reasons = result["review_reasons"]
    assert reasons[0].startswith("code-analysis answer unusable after a retry: no score for criteria aggregation")
    assert reasons[1] == "feedback answer unusable after a retry: the feedback has no summary"


def test_feedback_failure_alone_keeps_the_scores(rubric):
    fake = FakeGradingClient(feedback=["nope", "nope"])
    result = grade_notebook(NOTEBOOKS / "good_sales_analysis.ipynb", rubric, fake)
    assert result["status"] == "needs_review" and result["total"] == 40
    assert result["feedback"] == {"issues": ["fake issue"]}


def test_cut_off_answer_gets_more_room_on_retry(rubric):
    class CutOff(FakeGradingClient):
        def generate(self, *args, **kwargs):
            text, metrics = super().generate(*args, **kwargs)
            if len(self.calls) == 1:
                return text[: len(text) // 2], {**metrics, "finish_reason": "length"}
            return text, metrics

    fake = CutOff()
    result = grade_notebook(NOTEBOOKS / "good_sales_analysis.ipynb", rubric, fake)
    assert result["status"] == "graded"
    assert fake.calls[2]["max_tokens"] > fake.calls[0]["max_tokens"]
    assert "cut off at max_tokens" in fake.calls[2]["prompt"]


def test_unreachable_cluster_is_an_error_result_not_an_exception(rubric):
    down = NoServerAvailable("no decode server for model 'qwen'")
    fake = FakeGradingClient(code=[down, down], feedback=[down, down])
    result = grade_notebook(NOTEBOOKS / "good_sales_analysis.ipynb", rubric, fake)
    assert result["status"] == "error" and result["total"] is None
    assert "NoServerAvailable: no decode server" in result["review_reasons"][0]


def test_invalid_notebook_is_a_result(rubric):
    fake = FakeGradingClient()
    result = grade_notebook(NOTEBOOKS / "not_a_notebook.ipynb", rubric, fake)
    assert result["status"] == "invalid" and result["needs_review"] and result["total"] is None
    assert result["review_reasons"][0].startswith("not a gradable notebook: not a notebook: invalid JSON")
    assert fake.calls == []  # no model time spent on it


def test_scores_out_of_range_from_a_backend_without_grammar_are_clamped(rubric):
    wild = lambda kwargs: full_marks_answer(kwargs, score=lambda cid, points: points * 3)  # noqa: E731
    result = grade_notebook(NOTEBOOKS / "good_sales_analysis.ipynb", rubric, FakeGradingClient(code=[wild]))
    assert result["total"] == 40 and result["status"] == "graded"
    assert all(c["adjustments"][0].startswith("clamped from") for c in result["criteria"])


def test_deterministic_part_leaves_out_timings(rubric):
    from disaggregated_inference.grading import deterministic_part

    path = NOTEBOOKS / "errors_sales_analysis.ipynb"
    first = grade_notebook(path, rubric, FakeGradingClient())
    second = grade_notebook(path, rubric, FakeGradingClient())
    second["graded_at"], second["elapsed_s"] = "later", 99.0
    second["inference"]["wall_time"] = 123.0
    assert deterministic_part(first) == deterministic_part(second)
    changed = grade_notebook(path, rubric, FakeGradingClient(feedback=[{**FEEDBACK_ANSWER, "summary": "Other."}]))
    assert deterministic_part(changed) != deterministic_part(first)
