"""Layer 2: what the example notebooks demonstrably contain, and the rubric's checks on it."""
import sys
import threading
from pathlib import Path

import nbformat

from disaggregated_inference.grading import evidence
from disaggregated_inference.grading.evidence import check_criterion, check_rubric, collect_evidence
from disaggregated_inference.grading.notebook import load_submission
from disaggregated_inference.grading.rubric import load_rubric, rubric_from_dict

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def evidence_of(name):
    return collect_evidence(load_submission(EXAMPLES / "notebooks" / f"{name}.ipynb").notebook)


def failed(checks):
    return {c.rule: c.detail for c in checks if not c.passed}


def test_good_notebook():
    ev = evidence_of("good_sales_analysis")
    assert (ev.code_cells, ev.markdown_cells) == (4, 2)
    assert ev.markdown_words >= 40
    assert {"pandas", "matplotlib.pyplot"} <= set(ev.imports)
    assert {"pd.read_csv", "df.head", "plt.subplots"} <= set(ev.calls)
    assert {"read_csv", "groupby", "plot"} <= ev.call_names
    assert ev.defined_functions == ["revenue_by"]
    assert "function_def" in ev.constructs
    assert ev.chart_outputs == [{"cell": 5, "mime": "image/png"}]
    assert not ev.syntax_errors and not ev.error_outputs and not ev.unexecuted_cells and not ev.out_of_order
    checks = check_rubric(load_rubric(EXAMPLES / "rubric.yaml"), ev)
    assert all(c.passed for items in checks.values() for c in items), checks


class _Finalized:
    """An object in a reference cycle whose finalizer runs Python code: the garbage collector runs it in whatever
    thread allocates when a collection comes, in the middle of an ``ast.parse`` too."""

    def __init__(self):
        self.me = self

    def __del__(self):
        sum(range(50))


def test_evidence_is_collected_on_several_threads_at_once():
    """The grader collects evidence on ``--jobs`` threads. A garbage collection inside one thread's
    ``ast.parse`` let another move CPython's shared AST depth count, and a notebook came out invalid
    ("SystemError: AST constructor recursion depth mismatch", CI, 2026-11-28); parses now take turns."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # a thread switch at nearly every chance
    nb = load_submission(EXAMPLES / "notebooks" / "good_sales_analysis.ipynb").notebook
    code = "\n".join(f"x{i} = [{{'a': (i, [j for j in range({i})])}} for i in range(3)]" for i in range(40))
    errors, results = [], []

    def work():
        for _ in range(100):
            garbage = [_Finalized() for _ in range(50)]
            del garbage
            try:
                evidence.parse_python(code)
                results.append(collect_evidence(nb).code_cells)
            except SystemError as exc:
                errors.append(str(exc))

    try:
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == [] and results == [4] * 400


def test_notebook_with_errors():
    ev = evidence_of("errors_sales_analysis")
    assert ev.syntax_errors == [{"cell": 3, "line": 1, "message": "'(' was never closed"}]
    assert [(e["cell"], e["ename"]) for e in ev.error_outputs] == [(3, "SyntaxError"), (4, "NameError")]
    assert ev.unexecuted_cells == [5]
    assert ev.chart_outputs == [] and {p["cell"] for p in ev.plotting_calls} == {5}
    assert "groupby" in ev.call_names  # found by pattern in the cell that does not parse
    checks = check_rubric(load_rubric(EXAMPLES / "rubric.yaml"), ev)
    assert failed(checks["visualisation"]) == {
        "chart": "plotting code in cell 5 but no chart in the saved outputs (not run, or it failed)"}
    quality = failed(checks["code_quality"])
    assert quality["runs without errors"] == "cell 3: SyntaxError; cell 4: NameError"
    assert quality["all cells executed"] == "never run: cell 5"
    assert "has function_def" in quality
    assert not failed(checks["data_loading"]) and not failed(checks["aggregation"])
    assert any("cell 4: raised NameError" in line for line in ev.findings())


def test_incomplete_notebook():
    ev = evidence_of("incomplete_sales_analysis")
    checks = check_rubric(load_rubric(EXAMPLES / "rubric.yaml"), ev)
    assert failed(checks["aggregation"]) == {"uses groupby": "groupby is never called or defined"}
    assert failed(checks["visualisation"]) == {"imports matplotlib": "matplotlib is never imported",
                                               "chart": "no chart: no chart output and no plotting code"}
    assert "at least 40 words of explanation" in failed(checks["interpretation"])
    assert not failed(checks["data_loading"])


def notebook(*cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = list(cells)
    return nb


def test_magics_constructs_and_matching_rules():
    nb = notebook(
        nbformat.v4.new_code_cell("%matplotlib inline\n!pip install seaborn\nimport seaborn as sns\n"
                                  "from sklearn.linear_model import LinearRegression\n"
                                  "for i in range(3):\n    %time x = [j for j in range(i)]\n"
                                  "sns.barplot(x=[1], y=[2])", execution_count=2),
        nbformat.v4.new_code_cell("%%bash\nls -l", execution_count=1),
        nbformat.v4.new_code_cell("try:\n    y = f'{1}'\nexcept ValueError:\n    pass", execution_count=3,
                                  outputs=[nbformat.v4.new_output("display_data", data={
                                      "application/vnd.plotly.v1+json": {}, "text/plain": "fig"})]),
    )
    ev = collect_evidence(nb)
    assert not ev.syntax_errors  # magic and shell lines are not Python errors; %%bash cells are not Python
    assert {"seaborn", "sklearn.linear_model", "sklearn.linear_model.LinearRegression"} <= set(ev.imports)
    assert {"loop", "comprehension", "try", "fstring"} <= set(ev.constructs)
    assert ev.out_of_order  # run 2, then 1
    assert ev.chart_outputs == [{"cell": 3, "mime": "application/vnd.plotly.v1+json"}]
    assert any(p["call"] == "sns.barplot" for p in ev.plotting_calls)
    rubric = rubric_from_dict({"title": "t", "criteria": [{"id": "a", "title": "a", "points": 1, "evidence": {
        "imports": ["sklearn", "sklearn.linear_model", "skl"], "functions": ["sns.barplot", "pd.barplot", "barplot"],
        "constructs": ["loop", "class_def"], "chart": True}}]})
    results = {c.rule: c.passed for c in check_criterion(rubric.criteria[0], ev)}
    assert results == {"imports sklearn": True, "imports sklearn.linear_model": True, "imports skl": False,
                       "uses sns.barplot": True, "uses pd.barplot": False, "uses barplot": True,
                       "has loop": True, "has class_def": False, "chart": True}
