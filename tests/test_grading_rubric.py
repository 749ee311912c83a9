"""The rubric: the example loads; every bad rubric is refused with a message naming the file and the key."""
import json

import pytest

from disaggregated_inference.errors import DisaggError, GradingError, RubricError
from disaggregated_inference.grading.rubric import load_rubric, rubric_from_dict
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def good() -> dict:
    return {"title": "T", "criteria": [
        {"id": "load", "title": "Load", "points": 5, "evidence": {"imports": ["pandas"], "chart": False}},
        {"id": "chart", "title": "Chart", "points": 10, "evidence": {"chart": True}}]}


def test_example_rubric_loads():
    rubric = load_rubric(EXAMPLES / "rubric.yaml")
    assert rubric.ids == ["data_loading", "aggregation", "visualisation", "interpretation", "code_quality"]
    assert rubric.max_points == 40
    vis = rubric.criterion("visualisation")
    assert vis.evidence.chart is True and vis.evidence.imports == ("matplotlib",)
    assert rubric.criterion("code_quality").missing_evidence_cap == 0.25
    assert rubric.criterion("data_loading").missing_evidence_cap == 0.5  # the rubric's default
    assert "pandas" in rubric.assignment


def test_json_and_yaml_give_the_same_rubric(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(good()))
    from_json = load_rubric(path)
    assert from_json.source == str(path)
    assert from_json.fingerprint == rubric_from_dict(good()).fingerprint
    changed = good()
    changed["criteria"][0]["points"] = 6
    assert rubric_from_dict(changed).fingerprint != from_json.fingerprint


def test_rubric_error_is_part_of_the_hierarchy():
    assert issubclass(RubricError, GradingError) and issubclass(GradingError, DisaggError)


@pytest.mark.parametrize("mutate, key, words", [
    (lambda d: d["criteria"][1].pop("points"), "criteria[1] (chart).points", "is required"),
    (lambda d: d["criteria"][1].update(points=-3), "criteria[1] (chart).points", "must be a number > 0"),
    (lambda d: d["criteria"][1].update(points="ten"), "criteria[1] (chart).points", '"ten"'),
    (lambda d: d["criteria"][1].update(id="load"), "criteria[1] (load).id", "is used twice"),
    (lambda d: d["criteria"][0].update(id="1 bad"), "criteria[0].id", "short identifier"),
    (lambda d: d["criteria"][0].update(weight=2), "criteria[0] (load).weight", "not a known key"),
    (lambda d: d.update(extra=1), "extra", "not a known key"),
    (lambda d: d.pop("title"), "title", "is required"),
    (lambda d: d.update(criteria=[]), "criteria", "non-empty list"),
    (lambda d: d["criteria"][1]["evidence"].update(chart="yes"), "criteria[1] (chart).evidence.chart", "true or false"),
    (lambda d: d["criteria"][0]["evidence"].update(constructs=["goto"]), "criteria[0] (load).evidence.constructs",
     "unknown construct 'goto'"),
    (lambda d: d["criteria"][0]["evidence"].update(imports=[1]), "criteria[0] (load).evidence.imports",
     "list of names"),
    (lambda d: d["criteria"][0]["evidence"].update(screenshots=True), "criteria[0] (load).evidence.screenshots",
     "not a known key"),
    (lambda d: d["criteria"][0]["evidence"].update(markdown_words=-1), "criteria[0] (load).evidence.markdown_words",
     ">= 0"),
    (lambda d: d["criteria"][0].update(missing_evidence_cap=2), "criteria[0] (load).missing_evidence_cap", "<= 1"),
])
def test_bad_rubric_message_names_file_and_key(tmp_path, mutate, key, words):
    data = good()
    mutate(data)
    path = tmp_path / "bad_rubric.json"
    path.write_text(json.dumps(data))
    with pytest.raises(RubricError) as info:
        load_rubric(path)
    message = info.value.message
    assert message.startswith(f"{path}: {key} "), message
    assert words in message
    assert info.value.field == key


def test_unreadable_and_unparsable_rubrics(tmp_path):
    with pytest.raises(RubricError, match="cannot read rubric file .*missing.yaml"):
        load_rubric(tmp_path / "missing.yaml")
    bad_yaml = tmp_path / "r.yaml"
    bad_yaml.write_text("title: x\ncriteria: [\n  - id: a\n")
    with pytest.raises(RubricError, match=r"r\.yaml: not valid YAML at line \d+"):
        load_rubric(bad_yaml)
    bad_json = tmp_path / "r.json"
    bad_json.write_text('{"title": "x",')
    with pytest.raises(RubricError, match=r"r\.json: not valid JSON"):
        load_rubric(bad_json)
    as_list = tmp_path / "list.yaml"
    as_list.write_text("- a\n- b\n")
    with pytest.raises(RubricError, match="list.yaml: a rubric must be a mapping"):
        load_rubric(as_list)


@pytest.mark.parametrize("change, where, says", [
    (lambda r: r["criteria"][0].update(tests=[{"title": "t", "points": 1, "code": "assert ("}]),
     "criteria[0] (load).tests[0].code", "is not valid Python"),
    (lambda r: r["criteria"][0].update(tests=[{"title": "t", "points": 6, "code": "pass"}]),
     "criteria[0] (load).tests", "give 6 points; the criterion has 5"),
    (lambda r: r["criteria"][0].update(tests=[{"title": "t", "code": "pass"}]), "criteria[0] (load).tests[0].points",
     "is required"),
    (lambda r: r["criteria"][0].update(tests=[{"title": "t", "points": 1, "code": "pass", "shown": True}]),
     "criteria[0] (load).tests[0].shown", "is not a known key"),
    (lambda r: r.update(execution={"data": ["no_such.csv"]}), "execution.data", "not a file or folder"),
    (lambda r: r.update(execution={"timeout": 1}), "execution.timeout", "must be a number >= 5"),
    (lambda r: r.update(execution={"network": True}), "execution.network", "is not a known key"),
])
def test_bad_hidden_tests_and_execution_are_refused(tmp_path, change, where, says):
    data = good()
    change(data)
    with pytest.raises(RubricError) as err:
        rubric_from_dict(data, str(tmp_path / "r.yaml"))
    assert err.value.field == where and says in err.value.message


def test_execution_data_names_files_or_a_folder_s_files_never_its_notebooks(tmp_path):
    (tmp_path / "data").mkdir()
    for name in ("sales.csv", "regions.json", "other_student.ipynb", ".hidden"):
        (tmp_path / "data" / name).write_text("x")
    data = {**good(), "execution": {"data": ["data"], "cell_timeout": 10}}
    rubric = rubric_from_dict(data, str(tmp_path / "r.yaml"))
    assert [Path(p).name for p in rubric.execution.data] == ["regions.json", "sales.csv"]
    assert rubric.execution.cell_timeout_s == 10 and rubric.execution.enabled
    assert rubric_from_dict({**good(), "execution": {"enabled": False}}).execution.enabled is False
