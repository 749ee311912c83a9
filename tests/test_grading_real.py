"""The grader on the real small models through the real servers: structured answers, determinism."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from disaggregated_inference import config as cluster_config
from disaggregated_inference.client import DisaggregatedClient
from disaggregated_inference.grading import GradingOptions, deterministic_part, grade_notebook, load_rubric
from disaggregated_inference.grading.analysis import plan_requests, run_requests
from disaggregated_inference.grading.evidence import check_rubric, collect_evidence
from disaggregated_inference.grading.notebook import load_submission

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
GOOD = EXAMPLES / "notebooks" / "good_sales_analysis.ipynb"


def patient(config: dict) -> dict:
    """The cluster's config with room for complete answers on a slow, shared machine (the default 180 s
    decode timeout is for production hardware)."""
    return {**config, "client": {**config.get("client", {}), "decode_timeout": 900.0}}


@pytest.fixture(scope="module")
def client(cluster):
    with DisaggregatedClient(patient(cluster.config), health_check=False) as c:
        yield c


@pytest.fixture(scope="module")
def options(cluster):
    cfg = cluster_config.coerce(cluster.config)
    # room for the long answers the schemas allow (1,500 characters of strings, about a token each for the
    # small models), so that an answer ends with "stop" and is parsed; 768 was not enough for gemma3-270m
    return GradingOptions.for_cluster(cfg, code_max_tokens=1500, feedback_max_tokens=1500)


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
        # complete, so it parses and follows the schema it was constrained by (what the small models *say*
        # is judged by the grader's quality checks, tested elsewhere)
        assert answer.finish_reason == "stop", (answer.role, answer.metrics)
        schema = next(r for r in requests if r.role == answer.role).kwargs["json_schema"]
        jsonschema.validate(json.loads(answer.text, strict=False), schema)
    assert combined["requests"] == 2 and combined["overlap"] > 0 and "speedup" not in combined


def test_grading_the_same_notebook_twice_gives_the_same_result(client, options):
    rubric = load_rubric(EXAMPLES / "rubric.yaml")
    first = grade_notebook(GOOD, rubric, client, options)
    second = grade_notebook(GOOD, rubric, client, options)
    assert first["status"] in ("graded", "needs_review")
    assert deterministic_part(first) == deterministic_part(second)
    # whichever answer was used or dropped, every score is the evidence's, moved within the band
    assert first["total"] == pytest.approx(sum(c["score"] for c in first["criteria"]))
    for c in first["criteria"]:
        criterion = rubric.criterion(c["id"])
        assert abs(c["score"] - c["evidence_score"]) <= criterion.points * criterion.model_band + 1e-9, c
        assert 0 <= c["score"] <= c["points"] and c["evidence_reason"] and c["adjustment_reason"]
    assert first["inference"]["requests"]  # per-request metrics are recorded


def test_an_invalid_file_is_reported_without_calling_the_models(client, options):
    rubric = load_rubric(EXAMPLES / "rubric.yaml")
    before = len(client.history)
    result = grade_notebook(EXAMPLES / "notebooks" / "not_a_notebook.ipynb", rubric, client, options)
    assert result["status"] == "invalid" and result["review_reasons"]
    assert len(client.history) == before
