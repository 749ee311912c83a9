"""Issue 43: every notebook re-run in the bubblewrap sandbox, evidence from the run, hidden tests, hostile
notebooks contained. These run the real sandbox (bwrap, a real Jupyter kernel through nbclient); they skip
only where bubblewrap cannot be (not Linux, no bwrap): CI installs it (.ci/run)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import nbformat
import pytest

from disaggregated_inference.grading import GradingOptions, grade_batch, grade_notebook, load_rubric, rubric_from_dict
from disaggregated_inference.grading import cli, rerun as rerun_module
from .fakes import FakeGradingClient
from disaggregated_inference.grading.report import render_markdown
from disaggregated_inference.grading.rerun import Execution, text_difference
from disaggregated_inference.grading.sandbox import ExecutionLimits, find_sandbox

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOKS = EXAMPLES / "notebooks"
GOOD = NOTEBOOKS / "good_sales_analysis.ipynb"
SALES = NOTEBOOKS / "sales.csv"
LIMITS = ExecutionLimits(cell_timeout_s=5, notebook_timeout_s=25, cpu_s=20, memory_mb=1536, processes=32)

needs_bwrap = pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("bwrap") is None,
                                 reason="bubblewrap (Linux only) is not installed here")


@pytest.fixture(scope="module")
def sandbox():
    box, why = find_sandbox()
    assert box is not None, why  # bwrap is installed: a sandbox that does not work is a failure, not a skip
    return box


def notebook(path: Path, *sources: str, saved: list | None = None) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# A submission")] + [nbformat.v4.new_code_cell(s) for s in sources]
    path.write_text(nbformat.writes(nb), encoding="utf-8")
    return path


def rerun(path: Path, rubric=None, limits: ExecutionLimits | None = None, name: str = "student"):
    """The re-run's evidence; limits by default the rubric's (a cell may take 30 s: a busy machine imports slowly)."""
    rubric = rubric or rubric_from_dict({"title": "t", "criteria": [{"id": "a", "title": "A", "points": 1}]})
    limits = limits or ExecutionLimits(cell_timeout_s=rubric.execution.cell_timeout_s,
                                       notebook_timeout_s=rubric.execution.notebook_timeout_s)
    nb = nbformat.read(path, as_version=4)
    return Execution(path, nb, rubric, limits, None, name).result()


def test_text_is_compared_word_for_word_and_numbers_within_a_tolerance():
    assert text_difference("South    825.0\nNorth 755.0", "South 825.00001\nNorth    755.0") is None
    assert text_difference("<Figure at 0x7f3a>", "<Figure at 0x55aa>") is None
    assert text_difference("South 825.0", "South 925.0") == "saved '825.0', re-run '925.0'"
    assert text_difference("South 825.0", "North 825.0") == "saved 'South', re-run 'North'"
    assert "goes on with" in text_difference("a b", "a")


@needs_bwrap
def test_a_good_notebook_re_runs_and_matches_its_saved_outputs(sandbox):
    rubric = load_rubric(EXAMPLES / "rubric.yaml")
    assert rubric.execution.data == (str(SALES),)
    run = rerun(GOOD, rubric)
    assert run.ran and run.top_to_bottom, run.findings()
    assert run.differs == [] and run.matched == 4 and run.incidents == []
    assert 0 < run.seconds < rubric.execution.notebook_timeout_s
    assert run.findings()[0].startswith("re-run in the sandbox in ")


@needs_bwrap
def test_outputs_pasted_or_left_over_from_older_code_are_found(sandbox, tmp_path):
    nb = nbformat.read(GOOD, as_version=4)
    nb.cells[2].source = nb.cells[2].source.replace('"region"', '"product"')  # code changed after its output
    edited = tmp_path / "edited.ipynb"
    nbformat.write(nb, edited)
    rubric = load_rubric(EXAMPLES / "rubric.yaml")
    result = grade_notebook(edited, rubric, FakeGradingClient(), GradingOptions(execute=True))
    execution = result["layers"]["execution"]
    assert [d["cell"] for d in execution["differs"]] == [3] and execution["top_to_bottom"]
    assert "cell 3: saved output differs from the re-run (result: saved 'region', re-run 'product')" in \
        execution["findings"]
    executed = next(k for k in result["layers"]["evidence"]["checks"]["code_quality"] if k["key"] == "executed")
    assert not executed["passed"] and executed["detail"] == "saved outputs differ from a re-run: cell 3"


@needs_bwrap
def test_typed_in_outputs_are_found(sandbox):
    # the incomplete example's describe() output was typed in: its standard deviation is not the data's
    run = rerun(NOTEBOOKS / "incomplete_sales_analysis.ipynb", load_rubric(EXAMPLES / "rubric.yaml"))
    assert run.differs == [{"cell": 3, "what": "result: saved '3.822183', re-run '3.915780'"}]


@needs_bwrap
def test_cells_that_fail_now_are_numbered_as_a_teacher_counts_them(sandbox):
    rubric = load_rubric(EXAMPLES / "rubric.yaml")
    result = grade_notebook(NOTEBOOKS / "errors_sales_analysis.ipynb", rubric, FakeGradingClient(),
                            GradingOptions(execute=True))
    execution = result["layers"]["execution"]
    assert [(f["cell"], f["ename"]) for f in execution["failing"]] == [
        (3, "SyntaxError"), (4, "NameError"), (5, "NameError")]  # cell 5 was never run: it fails now too
    assert not execution["top_to_bottom"]
    runs_clean = next(k for k in result["layers"]["evidence"]["checks"]["code_quality"] if k["key"] == "runs_clean")
    assert runs_clean["detail"] == "cell 3: SyntaxError; cell 4: NameError when re-run; cell 5: NameError when re-run"
    report = render_markdown(result)
    assert "**Re-run in the sandbox:** **did not run top to bottom**" in report
    assert "cell 5 fails when re-run: NameError: name 'region_totals' is not defined" in report


TESTED_RUBRIC = {
    "title": "Sales with hidden tests",
    "execution": {"data": [str(SALES)], "cell_timeout": 10, "timeout": 60},
    "criteria": [
        {"id": "aggregation", "title": "Revenue by region", "points": 10, "evidence": {"functions": ["groupby"]},
         "tests": [
             {"title": "South leads", "points": 4, "code": "assert by_region.index[0] == 'South', 'South should lead'"},
             {"title": "South's total", "points": 3,
              "code": "SECRET_MARKER = 1\nassert by_region['South'] == 900, 'South should total 900'"},
             {"title": "Monthly totals", "points": 2, "code": "assert len(by_month_missing) == 3"}]},
        {"id": "loading", "title": "Loading", "points": 5, "tests": [
            {"title": "Twelve rows", "points": 2, "code": "assert len(df) == 12"}]},
    ],
}


@needs_bwrap
def test_hidden_tests_earn_and_lose_their_points_and_reports_name_them_by_title_only(sandbox, tmp_path):
    rubric = rubric_from_dict(TESTED_RUBRIC, str(tmp_path / "rubric.yaml"))
    fake = FakeGradingClient(score=lambda cid, points: 0)  # the model says 0: the band, not the tests, moves it
    result = grade_notebook(GOOD, rubric, fake, GradingOptions(execute=True))
    tests = {t["title"]: t for t in result["layers"]["execution"]["tests"]}
    assert tests["South leads"]["status"] == "passed"
    assert tests["South's total"] == {"id": "aggregation-2", "title": "South's total", "points": 3.0,
                                      "status": "failed", "message": "South should total 900"}
    assert tests["Monthly totals"]["status"] == "failed"
    assert tests["Monthly totals"]["message"] == "NameError: name 'by_month_missing' is not defined"
    aggregation, loading = result["criteria"]
    # groupby (the rest, 1 point) + South leads (4) = 5 of 10; the failed tests' 5 points are lost, no more
    assert aggregation["evidence_score"] == 5
    assert "hidden test: South leads (+4)" in aggregation["evidence_reason"]
    # no rules: 2 test points earned, the other 3 start at half
    assert loading["evidence_score"] == 2 + 1.5
    text = json.dumps(result) + render_markdown(result)
    assert "SECRET_MARKER" not in text and "== 900" not in text  # the tests' code is never shown
    assert "| South's total | 3 | **failed**: South should total 900 |" in render_markdown(result)
    assert all("SECRET_MARKER" not in call["prompt"] for call in fake.calls)  # nor sent to the models
    student = " ".join(result["feedback"]["improvements"])
    assert "South should total 900" in student and "SECRET_MARKER" not in student


def test_a_python_installed_under_tmp_is_bound_inside_the_sandbox_s_own_tmp(tmp_path, monkeypatch):
    """A checkout under /tmp (a CI clone there) has its .venv there. bubblewrap applies its arguments in order: the
    sandbox's own /tmp is mounted first and the interpreter bound inside it, where a /tmp mounted after the bind hid
    it (every probe run failed: setpriv could not find the .venv's python, and no notebook was re-run)."""
    from disaggregated_inference.grading.sandbox import Sandbox

    monkeypatch.setattr(sys, "prefix", "/tmp/clone/.venv")
    cmd = Sandbox("bwrap", "prlimit", None).command(tmp_path / "home", tmp_path / "audit", ExecutionLimits(), None)
    tmpfs = cmd.index("--tmpfs")
    assert cmd[tmpfs + 1] == "/tmp" and cmd.count("--tmpfs") == 1
    bind = next(i for i in range(len(cmd) - 2) if cmd[i] == "--ro-bind" and cmd[i + 2] == "/tmp/clone/.venv")
    assert tmpfs < cmd.index("/tmp/clone") < bind  # its parent made inside the sandbox's /tmp, then the bind


def test_without_a_sandbox_nothing_runs_and_the_grader_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(rerun_module, "find_sandbox", lambda: (None, "no sandbox: bwrap missing; not re-run"))
    monkeypatch.setattr(cli, "find_sandbox", lambda: (None, "no sandbox: bwrap missing; not re-run"))
    rubric = rubric_from_dict(TESTED_RUBRIC, str(tmp_path / "rubric.yaml"))
    result = grade_notebook(GOOD, rubric, FakeGradingClient(), GradingOptions(execute=True))
    execution = result["layers"]["execution"]
    assert execution["status"] == "unavailable" and execution["findings"] == [
        "not re-run: no sandbox: bwrap missing; not re-run"]
    assert {t["status"] for t in execution["tests"]} == {"not_run"}
    assert result["needs_review"] and "4 hidden tests not run (11 points not awarded)" in result["review_reasons"][0]
    assert not any("hidden test" in line for line in result["feedback"]["improvements"])  # not the student's doing
    off = grade_notebook(GOOD, load_rubric(EXAMPLES / "rubric.yaml"), FakeGradingClient(), GradingOptions())
    assert off["layers"]["execution"]["reason"] == "execution is off (--execute off)"
    assert off["total"] == 40  # from the saved outputs, as before

    from contextlib import contextmanager

    @contextmanager
    def fake_cluster(config=None, **kwargs):
        yield FakeGradingClient()

    monkeypatch.setattr(cli, "open_client", fake_cluster)
    args = [str(GOOD), "--rubric", str(EXAMPLES / "rubric.yaml"), "--out", str(tmp_path / "out"), "--no-progress"]
    assert cli.main(args) == 0
    assert capsys.readouterr().err.count("no sandbox: bwrap missing") == 1  # said once


# -- hostile notebooks: each stopped, reported, and nothing outside the sandbox changes -------------------------

@pytest.fixture
def outside(tmp_path):
    """Things outside the sandbox a notebook must not reach: another student's notebook, a config with an API
    token, a home's SSH key, a folder anyone may write to, a listening socket, a process to signal."""
    class Outside:
        pass

    o = Outside()
    o.folder = tmp_path / "outside"
    o.folder.mkdir()
    o.other = o.folder / "other_student.ipynb"
    o.other.write_text('{"cells": [], "note": "OTHER-STUDENT-WORK"}')
    o.config = o.folder / "config_current.json"
    o.config.write_text('{"api_token": "TOKEN-4f9a"}')
    o.key = o.folder / ".ssh" / "id_ed25519"
    o.key.parent.mkdir()
    o.key.write_text("PRIVATE-KEY-77")
    o.open_dir = o.folder / "open"
    o.open_dir.mkdir()
    o.open_dir.chmod(0o777)  # only the sandbox can stop a write here
    o.listener = socket.socket()
    o.listener.bind(("127.0.0.1", 0))
    o.listener.listen(8)
    o.listener.setblocking(False)
    o.port = o.listener.getsockname()[1]
    o.victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    o.before = sorted(p.name for p in o.folder.rglob("*"))
    yield o
    o.victim.kill()
    o.victim.wait()
    o.listener.close()


HOSTILE = {
    "fork_bomb": ("import os\nwhile True:\n    os.fork()", "tried to start more processes than the limit of 32"),
    "memory_hog": ("chunks = []\nwhile True:\n    chunks.append(bytearray(100_000_000))",
                   "allocated memory past the limit of 1536 MB"),
    "endless_loop": ("while True:\n    pass", "ran longer than its time limit of 5 s and was interrupted"),
    "output_flood": ("for i in range(10**7):\n    print('x' * 1000)", "flooded its output"),
    "network": ("import socket\nfor address in [('127.0.0.1', {port}), ('1.1.1.1', 443)]:\n    try:\n"
                "        socket.create_connection(address, timeout=2)\n    except OSError as exc:\n"
                "        print('refused', exc)", "tried to open a network connection"),
    "reads_outside": ("for path in [{other!r}, {config!r}, {key!r}]:\n    try:\n        print(open(path).read())\n"
                      "    except OSError as exc:\n        print('no', exc)", "tried to read"),
    "writes_outside": ("import os\nfor path in [{open_dir!r} + '/pwned', '/usr/pwned', os.path.expanduser('~/../pwned')]:\n"
                       "    try:\n        open(path, 'w').write('x')\n    except OSError as exc:\n        print('no', exc)",
                       "tried to write"),
    "signals": ("import os, signal, subprocess\nfor pid in [{victim}, {grader}, 1, -1]:\n    try:\n"
                "        os.kill(pid, signal.SIGKILL)\n    except OSError as exc:\n        print('no', exc)\n"
                "subprocess.run(['pkill', '-9', '-f', 'sleep'])", "tried to signal other processes"),
}


def hostile_notebook(folder: Path, kind: str, o) -> Path:
    code, _ = HOSTILE[kind]
    code = code.format(port=o.port, other=str(o.other), config=str(o.config), key=str(o.key),
                       open_dir=str(o.open_dir), victim=o.victim.pid, grader=os.getpid())
    return notebook(folder / f"{kind}.ipynb", "print('before')", code, "print('after')")


def assert_nothing_outside_changed(o) -> None:
    assert sorted(p.name for p in o.folder.rglob("*")) == o.before  # nothing written outside
    assert not Path("/usr/pwned").exists()
    assert o.victim.poll() is None  # the process outside was not signalled
    with pytest.raises(BlockingIOError):
        o.listener.accept()  # no connection reached the grader's machine


@needs_bwrap
@pytest.mark.parametrize("kind", list(HOSTILE))
def test_a_hostile_notebook_is_stopped_and_reported(sandbox, outside, tmp_path, kind):
    path = hostile_notebook(tmp_path, kind, outside)
    started = time.monotonic()
    run = rerun(path, limits=LIMITS)
    took = time.monotonic() - started
    assert took < LIMITS.notebook_timeout_s + 10  # the grader's time stays bounded by the limits
    expected = HOSTILE[kind][1]
    assert any(expected in incident for incident in run.incidents), run.findings()
    assert_nothing_outside_changed(outside)
    text = json.dumps(run.to_dict())
    for secret in ("OTHER-STUDENT-WORK", "TOKEN-4f9a", "PRIVATE-KEY-77"):
        assert secret not in text


@needs_bwrap
def test_the_sandbox_shows_the_notebook_its_own_folder_and_nothing_of_the_grader(sandbox, tmp_path, monkeypatch):
    monkeypatch.setenv("DISAGG_API_TOKEN", "TOKEN-IN-ENV")
    (tmp_path / "neighbour.ipynb").write_text("{}")  # another submission in the same folder
    root = Path(__file__).resolve().parents[1]
    private = [root / "config_current.json", root / "examples", Path.home() / ".ssh", Path.home() / ".cache",
               tmp_path / "neighbour.ipynb", tmp_path]
    probe = (f"import os, json\nPATHS = {[str(p) for p in private]!r}\n"
             "print(json.dumps({'cwd': os.getcwd(), 'files': sorted(os.listdir('.')), 'root': sorted(os.listdir('/')),"
             " 'uid': os.getuid(), 'env': sorted(os.environ), 'token': 'TOKEN-IN-ENV' in str(os.environ),"
             " 'caps': [l for l in open('/proc/self/status') if l.startswith('CapEff')][0].split()[1],"
             " 'pids': len([p for p in os.listdir('/proc') if p.isdigit()]),"
             " 'visible': [p for p in PATHS if os.path.exists(p)]}))")
    path = notebook(tmp_path / "probe.ipynb", probe)
    rubric = load_rubric(EXAMPLES / "rubric.yaml")
    box_run = sandbox.run(path, rubric.execution.data, limits=LIMITS, name="probe.ipynb")
    cell = next(r for r in box_run.records if r.get("kind") == "cell")
    seen = json.loads(cell["stdout"])
    assert seen["cwd"] == "/home/student" and seen["files"] == ["probe.ipynb", "sales.csv"]
    assert seen["visible"] == []  # the grader's checkout and config, its home, the other submissions
    assert not seen["token"] and "DISAGG_API_TOKEN" not in seen["env"]
    assert seen["uid"] != 0 and int(seen["caps"], 16) == 0
    assert seen["pids"] < 10  # its own processes only: the runner, the kernel, bwrap's init


@needs_bwrap
@pytest.mark.slow  # eight notebooks in sandboxes, some of them up to their limits: about 30 s
def test_a_class_with_hostile_notebooks_is_graded_in_one_run(sandbox, outside, tmp_path):
    folder = tmp_path / "class"
    folder.mkdir()
    shutil.copy(GOOD, folder / "a_good.ipynb")
    shutil.copy(NOTEBOOKS / "errors_sales_analysis.ipynb", folder / "b_errors.ipynb")
    kinds = ["fork_bomb", "endless_loop", "network", "reads_outside", "writes_outside", "signals"]
    for kind in kinds:
        hostile_notebook(folder, kind, outside)
    rubric_file = tmp_path / "rubric.yaml"
    text = (EXAMPLES / "rubric.yaml").read_text().replace("notebooks/sales.csv", str(SALES))
    rubric_file.write_text(text.replace("cell_timeout: 30", "cell_timeout: 10").replace("timeout: 120", "timeout: 30"))
    rubric = load_rubric(rubric_file)
    started = time.monotonic()
    batch = grade_batch(folder, rubric, FakeGradingClient(), tmp_path / "out", GradingOptions(execute=True), jobs=4)
    took = time.monotonic() - started
    by_name = {r["submission"]["name"]: r for r in batch.results}
    assert len(by_name) == 2 + len(kinds) and not batch.stopped
    assert by_name["a_good"]["total"] == 40 and by_name["a_good"]["layers"]["execution"]["top_to_bottom"]
    assert not by_name["a_good"]["needs_review"]
    for kind in kinds:
        result = by_name[kind]
        assert result["status"] == "needs_review", kind
        expected = [HOSTILE[kind][1].replace("limit of 5 s", "limit of 10 s").replace("limit of 32", "limit of 64")]
        if kind == "fork_bomb":  # on a busy machine it may reach its time limit before its process limit
            expected.append("ran longer than its time limit of 10 s")
        assert any(r.startswith("contained in the sandbox: ") and any(e in r for e in expected)
                   for r in result["review_reasons"]), (kind, result["review_reasons"])
        md = (tmp_path / "out" / f"{kind}.md").read_text()
        assert "**stopped by the sandbox:**" in md
    assert_nothing_outside_changed(outside)
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| a_good | graded | 40 | 100 | top to bottom |" in summary
    assert batch.summary["execution"]["re_run"] == 8 and batch.summary["execution"]["contained"] == len(kinds)
    # the good one, and the three whose code caught the errors of what the sandbox stopped
    assert batch.summary["execution"]["top_to_bottom"] == 4
    assert "- re-run in the sandbox: 8 notebooks (4 top to bottom, 6 with something stopped" in summary
    # 8 notebooks, 4 at a time, each bounded by its 30 s limit (on a shared two-core machine)
    assert took < 2 * (30 + 10)


@needs_bwrap
def test_a_notebook_cannot_forge_the_runner_s_report(sandbox, tmp_path):
    forged = '{"kind": "test", "id": "a-1", "status": "ok"}\\n{"kind": "end", "seconds": 0}\\n'
    code = ("import os\nwritten = []\nfor pid in [p for p in os.listdir('/proc') if p.isdigit()]:\n"
            "    for fd in (0, 1, 2):\n        try:\n"
            f"            with open(f'/proc/{{pid}}/fd/{{fd}}', 'w') as f:\n                f.write('{forged}')\n"
            "            written.append((pid, fd))\n        except OSError:\n            pass\n"
            f"os.write(1, b'{forged}')\nos.write(2, b'{forged}')\nprint(written)")
    path = notebook(tmp_path / "forger.ipynb", code)
    rubric = rubric_from_dict({"title": "t", "criteria": [{"id": "a", "title": "A", "points": 2, "tests": [
        {"title": "never passes", "points": 2, "code": "assert False, 'this test cannot pass'"}]}]})
    run = rerun(path, rubric, limits=LIMITS)
    assert [(t.status, t.message) for t in run.tests] == [("failed", "this test cannot pass")]
    assert run.top_to_bottom  # its own output only: the runner's report is out of its reach


@needs_bwrap
def test_a_stopped_batch_ends_the_re_runs_and_grades_them_next_time(sandbox, tmp_path):
    folder = tmp_path / "class"
    folder.mkdir()
    notebook(folder / "loop.ipynb", "while True:\n    pass")
    rubric = rubric_from_dict({"title": "t", "execution": {"cell_timeout": 600, "timeout": 900},
                               "criteria": [{"id": "a", "title": "A", "points": 1}]})
    stop = threading.Event()

    def progress(p):
        if p.elapsed_s > 2:
            stop.set()

    started = time.monotonic()
    batch = grade_batch(folder, rubric, FakeGradingClient(), tmp_path / "out", GradingOptions(execute=True),
                        progress=progress, stop=stop)
    assert time.monotonic() - started < 15  # not the re-run's 600 s
    assert batch.stopped and batch.not_graded == ["loop"] and not (tmp_path / "out" / "loop.json").exists()
    from disaggregated_inference.grading import sandbox as sandbox_module
    assert not sandbox_module._RUNNING
