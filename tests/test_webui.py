"""The web interface through Streamlit's own test runner (AppTest), with a FAKE client in the session.

FakeGradingClient returns canned JSON; the pages, the grading flow and the dashboard are what is tested.
"""
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from streamlit.testing.v1 import AppTest

from disaggregated_inference.grading import grade_batch, load_rubric
from disaggregated_inference.grading.fakes import FakeGradingClient
from disaggregated_inference.webui import launcher, state

WEBUI = Path(state.__file__).parent
APP, DASHBOARD = str(WEBUI / "app.py"), str(WEBUI / "pages" / "1_Dashboard.py")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOKS = EXAMPLES / "notebooks"


@pytest.fixture(autouse=True)
def out_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(state.OUT_ENV, str(tmp_path / "out"))
    return tmp_path / "out"


def grade_page(fake):
    at = AppTest.from_file(APP, default_timeout=60)
    at.session_state["client"] = fake
    return at.run()


def test_grade_the_examples(out_dir):
    fake = FakeGradingClient()
    at = grade_page(fake)
    assert not at.exception
    assert at.multiselect(key="examples").value == [p.name for p in sorted(NOTEBOOKS.glob("*.ipynb"))]
    at.button(key="grade").click().run()
    assert not at.exception
    assert len(fake.rounds) == 3  # the invalid notebook never reaches the models
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Submissions"] == "4" and metrics["Needs review"] == "1"
    summary = json.loads((out_dir / "summary.json").read_text())  # request time over this run's wall time
    assert metrics["Requests in flight (mean)"] == f"{summary['inference']['overlap']:.2f}"
    assert metrics["Servers healthy"] == "4/4"
    table = at.dataframe[0].value
    assert list(table["submission"]) == ["errors_sales_analysis", "good_sales_analysis",
                                         "incomplete_sales_analysis", "not_a_notebook"]
    assert list(table["status"]) == ["graded", "graded", "graded", "invalid"]
    assert "not_a_notebook" in at.warning[0].value
    assert [b.label for b in at.get("download_button")][:3] == [
        "Download gradebook (CSV)", "Download summary (Markdown)", "Download all reports (zip)"]
    assert (out_dir / "gradebook.csv").is_file() and (out_dir / "good_sales_analysis.md").is_file()

    at.selectbox(key="detail").select("good_sales_analysis").run()
    report = "\n".join(m.value for m in at.markdown)
    assert "**Score: 40 / 40**" in report and "Fake feedback" in report
    # the same breakdown as the report: evidence score, bounded model adjustment, final score, the reasons
    at.selectbox(key="detail").select("incomplete_sales_analysis").run()
    breakdown = at.dataframe[1].value
    assert list(breakdown["criterion"]) == ["data_loading", "aggregation", "visualisation", "interpretation",
                                            "code_quality"]
    assert list(breakdown["evidence"]) == [8, 0, 0, 0, 1.5]
    assert list(breakdown["model adjustment"]) == [0, 2.5, 2.5, 1.5, 0]
    assert list(breakdown["score"]) == [8, 2.5, 2.5, 1.5, 1.5]
    assert "limited by the band of ±2.5" in breakdown["adjustment: why"][1]
    assert "groupby is never called" in breakdown["evidence: why"][1]

    # graded again without "force": every result comes from the earlier run
    at.button(key="grade").click().run()
    assert len(fake.rounds) == 3
    assert "4 kept from an earlier run" in "\n".join(c.value for c in at.caption)


def test_upload_notebooks():
    fake = FakeGradingClient()
    at = grade_page(fake)
    at.radio(key="source").set_value("Upload notebooks").run()
    assert at.button(key="grade").disabled  # nothing to grade yet
    at.file_uploader(key="uploads").set_value([
        ("alice.ipynb", (NOTEBOOKS / "good_sales_analysis.ipynb").read_bytes(), "application/json"),
        ("bob.ipynb", b"{not json", "application/json")]).run()
    at.button(key="grade").click().run()
    assert not at.exception
    assert list(at.dataframe[0].value["submission"]) == ["alice", "bob"]
    assert list(at.dataframe[0].value["status"]) == ["graded", "invalid"]
    assert len(fake.rounds) == 1


def test_a_grading_stopped_by_an_earlier_run_of_the_page_is_shown(out_dir):
    """Stop (test_webui_browser.py presses it) makes Streamlit start a new run of the page and stop the one
    grading; that run leaves its outcome in the session's GradingJob, which the new run shows."""
    stop = threading.Event()

    def stop_after_the_first(p):
        if p.done == 1:
            stop.set()

    batch = grade_batch(sorted(NOTEBOOKS.glob("*.ipynb")), load_rubric(EXAMPLES / "rubric.yaml"),
                        FakeGradingClient(), out_dir, progress=stop_after_the_first, stop=stop)
    assert batch.stopped and len(batch.graded) == 1
    job = SimpleNamespace(stop=threading.Event(), done=threading.Event(), error=None, batch={
        "results": batch.results, "summary": batch.summary, "out_dir": str(out_dir), "graded": batch.graded,
        "resumed": [], "not_graded": batch.not_graded, "stopped": True})
    job.done.set()
    at = AppTest.from_file(APP, default_timeout=60)
    at.session_state["client"] = FakeGradingClient()
    at.session_state["grading"] = job
    at.run()
    assert not at.exception and job.stop.is_set() and "grading" not in at.session_state
    assert at.warning[0].value.startswith("Grading was stopped: 1 graded, 3 not graded (good_sales_analysis, "
                                          "incomplete_sales_analysis, not_a_notebook). Press Grade")
    assert {m.label: m.value for m in at.metric}["Submissions"] == "1"


def test_invalid_rubric_is_reported():
    at = grade_page(FakeGradingClient())
    at.selectbox(key="rubric_choice").select("Upload a rubric file...").run()
    at.file_uploader(key="rubric_upload").set_value(("mine.yaml", b"title: x\ncriteria: []\n", "text/yaml")).run()
    assert "mine.yaml: criteria must be a non-empty list" in at.error[0].value
    assert not at.button  # grading is not offered with a broken rubric


def test_bad_cluster_config_is_reported(tmp_path, monkeypatch):
    bad = tmp_path / "cluster.json"
    bad.write_text('{"prefill_servers": [], "decode_servers": [], "oops": 1}')
    monkeypatch.setenv(state.CONFIG_ENV, str(bad))
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert "unknown key config.oops" in at.error[0].value


def test_dashboard():
    fake = FakeGradingClient()
    fake.generate(model="qwen", prompt="p", json_schema={"properties": {"scores": {"properties": {}}}})
    fake.generate(model="gpt-oss", prompt="p")
    at = AppTest.from_file(DASHBOARD, default_timeout=60)
    at.session_state["client"] = fake
    at.session_state["batch"] = {"summary": {"inference": {"overlap": 1.8, "wall_time": 10.0,
                                                           "request_time": 18.0, "prefill_time": 3.0,
                                                           "decode_time": 15.0}}}
    at.run()
    assert not at.exception
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Healthy"] == "4/4" and metrics["Requests in flight, mean (last grading)"] == "1.80"
    assert metrics["Request time (sum)"] == "18.00 s" and not any("speedup" in label.lower() for label in metrics)
    per_model = [(m.label, m.value) for m in at.metric if m.label in ("Prefill (last)", "Decode (last)")]
    assert per_model == [("Prefill (last)", "0.50 s"), ("Decode (last)", "1.00 s"),   # gpt-oss
                         ("Prefill (last)", "0.25 s"), ("Decode (last)", "0.75 s")]   # qwen
    servers, requests = at.dataframe[0].value, at.dataframe[1].value
    assert len(servers) == 4 and set(servers["role"]) == {"prefill", "decode"}
    assert list(requests["model"]) == ["gpt-oss", "qwen"]  # newest first
    assert list(requests["method"]) == ["disaggregated", "disaggregated"]
    assert list(requests["decode tok/s"]) == [50.0, 50.0]
    at.button(key="check").click().run()
    assert fake.health_checks == 1


def test_launcher_runs_streamlit_on_loopback(monkeypatch, tmp_path):
    started = {}

    class FakePopen:
        def __init__(self, cmd, env):
            started.update(cmd=cmd, env=env)

        def wait(self, timeout=None):
            return 0

    config = tmp_path / "cluster.json"
    config.write_text(json.dumps({"prefill_servers": [], "decode_servers": []}))
    monkeypatch.setattr(launcher.subprocess, "Popen", FakePopen)
    assert launcher.main(["--config", str(config), "--out", str(tmp_path / "o")]) == 0
    cmd = started["cmd"]
    assert cmd[1:4] == ["-m", "streamlit", "run"] and cmd[4] == APP
    assert cmd[cmd.index("--server.address") + 1] == "127.0.0.1"
    assert int(cmd[cmd.index("--server.port") + 1]) > 0
    assert started["env"][state.CONFIG_ENV] == str(config.resolve())
    assert started["env"][state.OUT_ENV] == str(tmp_path / "o")
    assert launcher.main(["--config", str(tmp_path / "missing.json")]) == 2


def test_grading_refused_when_no_decode_server_answers():
    servers = [{"name": "d-qwen", "role": "decode", "model": "qwen", "url": "http://x", "up": False,
                "loaded": False, "last_error": "health check failed: ConnectionError"}]
    fake = FakeGradingClient(servers=servers)
    at = grade_page(fake)
    at.button(key="grade").click().run()
    assert "no decode server answers for model gpt-oss, qwen" in at.error[0].value
    assert fake.calls == [] and fake.health_checks == 1
    assert "batch" not in at.session_state
