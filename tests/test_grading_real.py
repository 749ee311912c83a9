"""The grader on the real small models through the real servers: structured answers, determinism."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from disaggregated_inference import config as cluster_config
from disaggregated_inference.client import DisaggregatedClient
from disaggregated_inference.grading import GradingOptions, deterministic_part, grade_notebook, load_rubric
from disaggregated_inference.grading.analysis import plan_requests, run_requests
from disaggregated_inference.grading.evidence import check_rubric, collect_evidence
from disaggregated_inference.grading.notebook import load_submission
from disaggregated_inference.grading.validation import check_code_answer, check_feedback_answer

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
GOOD = EXAMPLES / "notebooks" / "good_sales_analysis.ipynb"


@pytest.fixture(scope="module")
def client(cluster):
    with DisaggregatedClient(cluster.config, health_check=False) as c:
        yield c


@pytest.fixture(scope="module")
def options(cluster):
    cfg = cluster_config.coerce(cluster.config)
    return GradingOptions.for_cluster(cfg, code_max_tokens=320, feedback_max_tokens=240)


def test_both_models_answer_schema_valid_json_through_the_handoff(client, options):
    rubric = load_rubric(EXAMPLES / "rubric.yaml")
    sub = load_submission(GOOD, options.limits)
    evidence = collect_evidence(sub.notebook)
    requests, _ = plan_requests(rubric, sub.notebook, evidence, check_rubric(rubric, evidence), options)
    answers, combined = run_requests(client, requests)
    assert {a.role for a in answers} == {r.role for r in requests} and len(answers) == 2
    for answer in answers:
        assert answer.error is None, answer.error
        assert answer.metrics["method"] == "kv_handoff"
        assert answer.metrics["prompt_tokens_recomputed"] == 1
        if answer.finish_reason == "stop":  # complete: the grammar guarantees it parses
            json.loads(answer.text)
    code = next(a for a in answers if a.role == requests[0].role)
    feedback = next(a for a in answers if a is not code)
    parsed_code, code_problems = check_code_answer(code, rubric)
    parsed_feedback, feedback_problems = check_feedback_answer(feedback)
    assert parsed_code is not None or code.finish_reason == "length", code_problems
    assert parsed_feedback is not None or feedback.finish_reason == "length", feedback_problems
    assert combined["requests"] == 2 and combined["speedup"] > 0


def test_grading_the_same_notebook_twice_gives_the_same_result(client, options):
    rubric = load_rubric(EXAMPLES / "rubric.yaml")
    first = grade_notebook(GOOD, rubric, client, options)
    second = grade_notebook(GOOD, rubric, client, options)
    assert first["status"] in ("graded", "needs_review")
    assert deterministic_part(first) == deterministic_part(second)
    if first["status"] == "graded":
        assert 0 <= first["total"] <= rubric.max_points
        assert all(0 <= c["score"] <= c["points"] for c in first["criteria"])
    else:  # flagged for a human: the reasons are recorded, no total is claimed
        assert first["review_reasons"] and first["total"] is None
    assert first["inference"]["requests"]  # per-request metrics are recorded


def test_an_invalid_file_is_reported_without_calling_the_models(client, options):
    rubric = load_rubric(EXAMPLES / "rubric.yaml")
    before = len(client.history)
    result = grade_notebook(EXAMPLES / "notebooks" / "not_a_notebook.ipynb", rubric, client, options)
    assert result["status"] == "invalid" and result["review_reasons"]
    assert len(client.history) == before
