"""The grader on the real small models through the real servers: structured answers, determinism.

The calibration notebooks are graded once per session (``calibration_run`` in conftest.py, four at once on the
packaged models); these tests read that run, and grade one notebook again on its own.
"""
from __future__ import annotations

import json

import jsonschema
import pytest

from disaggregated_inference import config as cluster_config
from disaggregated_inference.client import DisaggregatedClient
from disaggregated_inference.grading import GradingOptions, deterministic_part, grade_notebook, load_rubric
from disaggregated_inference.grading.analysis import plan_requests
from disaggregated_inference.grading.evidence import check_rubric, collect_evidence
from disaggregated_inference.grading.notebook import load_submission

from .conftest import CALIBRATION, EXAMPLES, patient

pytestmark = pytest.mark.slow


def schemas_of(path, rubric, options) -> dict:
    """The JSON schema each role's request was constrained by, for the notebook at ``path``."""
    sub = load_submission(path, options.limits)
    evidence = collect_evidence(sub.notebook)
    requests, _ = plan_requests(rubric, sub.notebook, evidence, check_rubric(rubric, evidence), options)
    return {r.role: r.kwargs["json_schema"] for r in requests}


def test_both_models_answer_schema_valid_json_through_the_handoff(calibration_run):
    rubric, options, results = calibration_run
    complete = {"code": 0, "feedback": 0}
    for name, result in results.items():
        schemas = schemas_of(CALIBRATION / f"{name}.ipynb", rubric, options)
        answers = result["layers"]["analysis"]["answers"]
        assert {a["role"] for a in answers} == set(complete)
        for answer in answers:
            assert answer["error"] is None, (name, answer["error"])
            assert answer["metrics"]["method"] == "kv_handoff", (name, answer["metrics"])
            assert answer["metrics"]["prompt_tokens_recomputed"] == 1
            if answer["metrics"]["finish_reason"] != "stop":
                continue  # cut by max_tokens: a prefix of a document (the grader retries it, then drops it)
            # complete, so it parses and follows the schema it was constrained by (what the small models *say*
            # is judged by the grader's quality checks, tested elsewhere)
            jsonschema.validate(json.loads(answer["text"], strict=False), schemas[answer["role"]])
            complete[answer["role"]] += 1
    assert all(complete.values()), complete  # the check above ran for both models


def test_a_notebook_graded_again_gets_the_same_result(calibration_run, cluster):
    """Grading is repeatable: the same notebook, rubric, models and seed give the same result, the models' text
    included, graded alone in a run of its own and graded beside three others (the session's calibration run,
    ``--jobs 4``): the servers' steps are batch-invariant (the llama.cpp engine's ``deterministic``, on in the
    embedded config), and equal answers from two runs are the repeatability too."""
    rubric, options, results = calibration_run
    with DisaggregatedClient(patient(cluster.config), health_check=False) as client:
        alone = grade_notebook(CALIBRATION / "weak.ipynb", rubric, client, options)
    first = results["weak"]
    assert deterministic_part(first) == deterministic_part(alone)
    assert first["status"] in ("graded", "needs_review")
    # whichever answer was used or dropped, every score is the evidence's, moved within the band
    assert first["total"] == pytest.approx(sum(c["score"] for c in first["criteria"]))
    for c in first["criteria"]:
        criterion = rubric.criterion(c["id"])
        assert abs(c["score"] - c["evidence_score"]) <= criterion.points * criterion.model_band + 1e-9, c
        assert 0 <= c["score"] <= c["points"] and c["evidence_reason"] and c["adjustment_reason"]
    assert first["inference"]["requests"]  # per-request metrics are recorded


def test_an_invalid_file_is_reported_without_calling_the_models(cluster):
    rubric = load_rubric(EXAMPLES / "rubric.yaml")
    options = GradingOptions.for_cluster(cluster_config.coerce(cluster.config))
    with DisaggregatedClient(cluster.config, health_check=False) as client:
        result = grade_notebook(EXAMPLES / "notebooks" / "not_a_notebook.ipynb", rubric, client, options)
        assert result["status"] == "invalid" and result["review_reasons"]
        assert len(client.history) == 0
