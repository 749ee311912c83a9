"""Layer 1: a usable notebook is accepted; every unusable file is a reported result, never an exception."""
import json
from pathlib import Path

from disaggregated_inference.grading.notebook import Limits, load_submission, submission_name

NOTEBOOKS = Path(__file__).resolve().parents[1] / "examples" / "notebooks"


def minimal_notebook(cells) -> dict:
    return {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


def code_cell(source: str, count=1, outputs=(), cell_id="c1") -> dict:
    return {"cell_type": "code", "id": cell_id, "execution_count": count, "metadata": {}, "outputs": list(outputs),
            "source": source}


def write(tmp_path, name, content) -> Path:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_example_submissions():
    for name in ("good_sales_analysis", "errors_sales_analysis", "incomplete_sales_analysis"):
        sub = load_submission(NOTEBOOKS / f"{name}.ipynb")
        assert sub.ok, (name, sub.problems)
        assert sub.name == name and len(sub.sha256) == 64
        assert sub.summary()["code_cells"] >= 3
    bad = load_submission(NOTEBOOKS / "not_a_notebook.ipynb")
    assert not bad.ok and bad.notebook is None
    assert bad.problems[0].startswith("not a notebook: invalid JSON")
    assert bad.sha256  # known, so a resumed batch can skip it too


def test_unusable_files_are_reported(tmp_path):
    cases = {
        "empty.ipynb": ("", "the file is empty"),
        "binary.ipynb": (None, "not UTF-8"),
        "list.ipynb": ([1, 2], "no 'cells'"),
        "nocode.ipynb": (minimal_notebook([{"cell_type": "markdown", "id": "m", "metadata": {}, "source": "# hi"}]),
                         "has no code"),
        "blankcode.ipynb": (minimal_notebook([code_cell("   \n")]), "has no code"),
        "schema.ipynb": (minimal_notebook([{"cell_type": "code", "id": "x", "source": "1"}]),
                         "not a valid nbformat v4 notebook"),
        "version.ipynb": ({"cells": [], "metadata": {}, "nbformat": 99, "nbformat_minor": 0},
                          "not a readable nbformat notebook"),
    }
    for name, (content, expected) in cases.items():
        path = tmp_path / name
        if content is None:
            path.write_bytes(b"\xff\xfe\x00garbage")
        else:
            write(tmp_path, name, content)
        sub = load_submission(path)
        assert not sub.ok, name
        assert any(expected in p for p in sub.problems), (name, sub.problems)
    missing = load_submission(tmp_path / "nope.ipynb")
    assert not missing.ok and "cannot read the file" in missing.problems[0]


def test_size_and_cell_limits(tmp_path):
    nb = minimal_notebook([code_cell(f"x = {i}", i + 1, cell_id=f"c{i}") for i in range(5)])
    path = write(tmp_path, "five.ipynb", nb)
    assert load_submission(path).ok
    too_big = load_submission(path, Limits(max_bytes=100))
    assert not too_big.ok and "the limit is 100" in too_big.problems[0]
    too_long = load_submission(path, Limits(max_cells=3))
    assert not too_long.ok and "5 cells; the limit is 3" in too_long.problems[0]


def test_missing_cell_ids_are_tolerated(tmp_path):
    nb = minimal_notebook([code_cell("print(1)")])
    nb["nbformat_minor"] = 4
    del nb["cells"][0]["id"]
    assert load_submission(write(tmp_path, "old.ipynb", nb)).ok


def test_submission_names_keep_folders_apart(tmp_path):
    assert submission_name(tmp_path / "a" / "hw.ipynb", tmp_path) == "a__hw"
    assert submission_name(tmp_path / "hw.ipynb") == "hw"
