"""Reports, gradebook and summary of a batch of the example notebooks; resuming a batch; the command line.

Model answers come from FakeGradingClient (canned JSON); the real-model runs are separate tests.
"""
import csv
import dataclasses
import io
import json
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest

from disaggregated_inference.grading import grade_batch, load_rubric
from disaggregated_inference.grading import cli
from .fakes import FakeGradingClient
from disaggregated_inference.grading.report import read_result

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NAMES = ["errors_sales_analysis", "good_sales_analysis", "incomplete_sales_analysis", "not_a_notebook"]


@pytest.fixture(scope="module")
def rubric():
    return load_rubric(EXAMPLES / "rubric.yaml")


@pytest.fixture
def submissions(tmp_path):
    folder = tmp_path / "submissions"
    shutil.copytree(EXAMPLES / "notebooks", folder)
    return folder


def test_batch_writes_every_report(submissions, tmp_path, rubric):
    out = tmp_path / "out"
    events = []
    batch = grade_batch(submissions, rubric, FakeGradingClient(), out, progress=events.append)
    assert batch.graded == NAMES and batch.resumed == [] and not batch.stopped
    last = [e for e in events if e.name][-1]
    assert (last.done, last.total, last.name, last.status) == (4, 4, "not_a_notebook", "invalid")
    assert events[-1].final and events[-1].done == 4
    for name in NAMES:
        result = json.loads((out / f"{name}.json").read_text())
        assert result["format"] == "grading-result/1"
        assert result["submission"]["name"] == name
        assert (out / f"{name}.md").read_text().startswith(f"# {name}: Sales analysis (week 3)")
    good = read_result(out / "good_sales_analysis.json")
    assert set(good["layers"]) == {"submission", "evidence", "analysis", "validation", "execution"}
    assert good["inference"]["prefill_time"] == 0.75 and good["inference"]["decode_time"] == 1.75
    assert (good["inference"]["request_time"], good["inference"]["wall_time"]) == (2.5, 1.5)
    assert good["inference"]["overlap"] == pytest.approx(2.5 / 1.5, abs=1e-3) and "speedup" not in good["inference"]

    rows = list(csv.DictReader(io.StringIO((out / "gradebook.csv").read_text())))
    assert [r["submission"] for r in rows] == NAMES
    assert list(rows[0])[:11] == ["submission", "status", "total", "max_points", "percent", "needs_review",
                                  "data_loading", "aggregation", "visualisation", "interpretation", "code_quality"]
    by_name = {r["submission"]: r for r in rows}
    assert by_name["good_sales_analysis"]["total"] == "40.0"
    assert by_name["incomplete_sales_analysis"]["visualisation"] == "2.5"  # evidence 0 + the band (issue 18)
    assert by_name["not_a_notebook"]["status"] == "invalid" and by_name["not_a_notebook"]["total"] == ""
    assert "invalid JSON" in by_name["not_a_notebook"]["review_reasons"]

    summary = json.loads((out / "summary.json").read_text())
    totals = [float(by_name[n]["total"]) for n in NAMES[:3]]
    assert summary["graded"] == 3 and summary["mean"] == pytest.approx(sum(totals) / 3, abs=0.01)
    assert summary["min"] == min(totals) and summary["max"] == 40 and summary["stdev"] > 0
    assert summary["by_status"] == {"graded": 3, "invalid": 1}
    assert [f["submission"] for f in summary["flagged"]] == ["not_a_notebook"]
    inf, run = summary["inference"], summary["run"]
    assert inf["requests"] == 6 and inf["prefill_time"] == 2.25 and inf["decode_time"] == 5.25
    # the batch's figures against its own wall time, not the sum of the notebooks' (test_grading_batch.py)
    assert inf["request_time"] == 7.5 and inf["wall_time"] == run["wall_time_s"] and "speedup" not in inf
    assert run["graded"] == 4 and run["kept"] == 0 and run["stopped"] is False
    md = (out / "summary.md").read_text()
    assert f"7.50 s of request time in {run['wall_time_s']:.2f} s of wall time" in md
    assert "## Needs human review" in md and "**not_a_notebook** (invalid)" in md


def test_markdown_report_of_a_flawed_notebook(submissions, tmp_path, rubric):
    out = tmp_path / "out"
    grade_batch(submissions / "errors_sales_analysis.ipynb", rubric, FakeGradingClient(), out)
    md = (out / "errors_sales_analysis.md").read_text()
    for expected in ("**Score: 26 / 40**", "## Criteria", "### Why", "## Feedback",
                     "| Chart of revenue by region (`visualisation`) | 5 | 0 | 5 | 10 |",
                     "cell 3: SyntaxError at line 1", "| `visualisation` | chart | **no** |", "## Inference",
                     "2.50 s of request time in 1.50 s of wall time (1.67 requests in flight on average)"):
        assert expected in md, expected


def test_resume_skips_what_is_already_graded(submissions, tmp_path, rubric):
    out = tmp_path / "out"
    first = FakeGradingClient()
    grade_batch(submissions, rubric, first, out)
    assert len(first.rounds) == 3  # three notebooks reach the models; the invalid one does not

    again = FakeGradingClient()
    batch = grade_batch(submissions, rubric, again, out)
    assert again.calls == [] and batch.graded == [] and batch.resumed == NAMES
    assert batch.summary["resumed"] == 4 and batch.summary["graded"] == 3

    # a changed notebook is graded again; the others are kept
    good = submissions / "good_sales_analysis.ipynb"
    good.write_text(good.read_text().replace("Ada Lovelace", "Grace Hopper"))
    batch = grade_batch(submissions, rubric, FakeGradingClient(), out)
    assert batch.graded == ["good_sales_analysis"]

    # --force grades everything; a changed rubric too
    assert grade_batch(submissions, rubric, FakeGradingClient(), out, force=True).graded == NAMES
    other = dataclasses.replace(rubric, title="Sales analysis (week 4)")
    assert grade_batch(submissions, other, FakeGradingClient(), out).graded == NAMES


def test_error_results_are_graded_again(submissions, tmp_path, rubric):
    out = tmp_path / "out"
    down = RuntimeError("cluster down")
    grade_batch(submissions / "good_sales_analysis.ipynb", rubric,
                FakeGradingClient(code=[down, down], feedback=[down, down]), out)
    assert read_result(out / "good_sales_analysis.json")["status"] == "error"
    batch = grade_batch(submissions / "good_sales_analysis.ipynb", rubric, FakeGradingClient(), out)
    assert batch.graded == ["good_sales_analysis"] and batch.results[0]["status"] == "graded"


def test_command_line(submissions, tmp_path, monkeypatch, capsys):
    CONFIG = str(tmp_path / "cluster.json")  # the client is faked; the config is only loaded and validated
    Path(CONFIG).write_text(json.dumps({"prefill_servers": [], "decode_servers": []}))
    fake = FakeGradingClient()
    opened = {}

    @contextmanager
    def fake_open_client(config=None, **kwargs):
        opened.update(kwargs)
        yield fake

    monkeypatch.setattr(cli, "open_client", fake_open_client)
    out = tmp_path / "grades"
    code = cli.main([str(submissions), "--rubric", str(EXAMPLES / "rubric.yaml"), "--out", str(out),
                     "--local-cluster", "--no-progress", "--seed", "5", "--config", CONFIG])
    assert code == 0
    assert opened["local_cluster"] is True and opened["models"] == ("qwen", "gpt-oss")
    assert {c["seed"] for c in fake.calls} == {5}
    assert (out / "gradebook.csv").is_file()
    printed = capsys.readouterr().out
    assert "4 submissions (4 graded now, 0 kept" in printed and "needs review: not_a_notebook" in printed

    # nothing left to grade: no cluster is started or asked, the reports are rebuilt
    opened.clear()
    assert cli.main([str(submissions), "--rubric", str(EXAMPLES / "rubric.yaml"), "--out", str(out),
                     "--local-cluster", "--no-progress", "--config", CONFIG]) == 0
    assert opened == {} and len(fake.calls) == 6
    assert "4 submissions (0 graded now, 4 kept" in capsys.readouterr().out

    assert cli.main([str(submissions), "--rubric", str(EXAMPLES / "notebooks" / "sales.csv"),
                     "--config", CONFIG]) == 2
    assert "a rubric must be a mapping" in capsys.readouterr().err
    assert cli.main([str(tmp_path / "nowhere"), "--rubric", str(EXAMPLES / "rubric.yaml"), "--out", str(out),
                     "--config", CONFIG]) == 1
    assert "no such file or folder" in capsys.readouterr().err


def test_progress_lines_on_a_pipe():
    from disaggregated_inference.grading import StderrProgress
    from disaggregated_inference.grading.batch import BatchProgress

    stream = io.StringIO()
    progress = StderrProgress(stream, width=4)
    progress(BatchProgress(total=2, waiting=1, grading=1, done=0, kept=0, elapsed_s=0.4, eta_s=None,
                           name="alice", status="grading"))
    progress(BatchProgress(total=2, waiting=1, grading=1, done=0, kept=0, elapsed_s=1.0, eta_s=None))  # a tick
    progress(BatchProgress(total=2, waiting=0, grading=1, done=1, kept=0, elapsed_s=75.0, eta_s=75.0,
                           name="alice", status="graded"))
    progress(BatchProgress(total=2, waiting=0, grading=0, done=2, kept=0, elapsed_s=150.0, eta_s=0.0,
                           name="bob", status="graded", final=True))
    lines = stream.getvalue().splitlines()
    assert lines == ["[----] 0/2 done, 1 grading, 1 waiting; 0s | alice: grading",  # not a line per tick
                     "[##--] 1/2 done, 1 grading, 0 waiting; 1m15s, about 1m15s left | alice: graded",
                     "[####] 2/2 done, 0 grading, 0 waiting; 2m30s | bob: graded"]
