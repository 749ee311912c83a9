"""The web interface through Streamlit's own test runner (AppTest), with a FAKE client in the session.

FakeGradingClient returns canned JSON; the pages, the grading flow and the dashboard are what is tested.
"""
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from streamlit.testing.v1 import AppTest

from disaggregated_inference.grading import grade_batch, load_rubric
from .fakes import FakeGradingClient
from disaggregated_inference.grading.sandbox import find_sandbox
from disaggregated_inference.observe.sampler import Sweep
from disaggregated_inference.ops import lifetime
from disaggregated_inference.webui import launcher, state
from disaggregated_inference.metrics import ServerFigures

WEBUI = Path(state.__file__).parent
APP, DASHBOARD, NAVIGATION = (str(WEBUI / name) for name in ("app.py", "dashboard.py", "navigation.py"))
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
    # what the re-run in the sandbox found, per notebook (where this machine has bubblewrap; else why not)
    if find_sandbox()[0] is None:
        assert "Notebooks will be graded from their saved outputs" in "\n".join(c.value for c in at.caption)
    else:
        reruns = at.dataframe[1].value
        assert list(reruns["submission"]) == ["errors_sales_analysis", "good_sales_analysis",
                                              "incomplete_sales_analysis"]
        assert list(reruns["re-run"]) == ["fails in 3, 4, 5", "top to bottom", "top to bottom; 1 saved output differs"]
    assert "not_a_notebook" in at.warning[0].value
    assert [b.label for b in at.get("download_button")][:3] == [
        "Download gradebook (CSV)", "Download summary (Markdown)", "Download all reports (zip)"]
    assert (out_dir / "gradebook.csv").is_file() and (out_dir / "good_sales_analysis.md").is_file()

    at.selectbox(key="detail").select("good_sales_analysis").run()
    report = "\n".join(m.value for m in at.markdown)
    assert "**Score: 40 / 40**" in report and "Fake feedback" in report
    # the same breakdown as the report: evidence score, bounded model adjustment, final score, the reasons
    at.selectbox(key="detail").select("incomplete_sales_analysis").run()
    breakdown = at.dataframe[2].value
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


class FakeSampler:
    """The sampler's surface the pages use, over sweeps of real ``ServerMetrics`` output (tests/test_observe.py)."""

    def __init__(self, sweeps, names=None):
        self._sweeps, self.names = sweeps, names or {}

    def sweeps(self):
        return list(self._sweeps)

    def latest(self):
        return self._sweeps[-1] if self._sweeps else None

    def baseline(self, window):
        return self._sweeps[0] if len(self._sweeps) > 1 else None


def server_sweeps():
    from disaggregated_inference.server.metrics import ServerMetrics

    from .test_observe import owner, reading

    readers = {}
    for role in ("prefill", "decode"):
        for model in ("qwen", "gpt-oss"):
            m = ServerMetrics(role, name=f"fake-{role}-{model}", model=model)
            m.watch_owner(owner(busy=1 if role == "decode" else 0))
            readers[(role, model)] = m

    def sweep(at):
        return Sweep(at, [reading(f"fake-{role}-{model}", role, model, m, at) for (role, model), m in readers.items()])

    now = time.time()
    first = sweep(now - 10)
    dec = readers[("decode", "qwen")]
    dec.observe_decode(ServerFigures.of(decode_time=0.75, decode_speed=50.0, method="kv_handoff", completion_tokens=40,
                        canary="passed"))
    dec.observe_canary_failure(0.9)
    dec.observe_pull("http://fake-prefill-qwen/kv/x", 4_000_000, 0.004)
    dec.observe_probe("http://fake-prefill-qwen/kv/probe", {"bytes_per_second": 1.25e9})
    return [first, sweep(now)]


def chart_frames(at) -> dict:
    """{chart title: its data as a DataFrame} of every Altair chart on the page."""
    import pyarrow as pa

    frames = {}
    for chart in at.get("vega_lite_chart"):
        spec = json.loads(chart.proto.spec)
        data = chart.proto.datasets[0].data.data if chart.proto.datasets else chart.proto.data.data
        frames[spec["title"]] = pa.ipc.open_stream(data).read_pandas()
    return frames


def test_dashboard():
    fake = FakeGradingClient()
    fake.generate(model="qwen", prompt="p", json_schema={"properties": {"scores": {"properties": {}}}})
    fake.generate(model="gpt-oss", prompt="p")
    fake.history.append({"time": time.time(), "model": "gpt-oss", "error": "upstream_timeout",
                         "error_message": "timed out after 180s", "total_time": 180.0})
    at = AppTest.from_file(DASHBOARD, default_timeout=60)
    at.session_state["client"] = fake
    at.session_state["sampler"] = FakeSampler(server_sweeps(), {"fake-prefill-qwen": "fake-prefill-qwen"})
    at.session_state["batch"] = {"summary": {"inference": {"overlap": 1.8, "wall_time": 10.0,
                                                           "request_time": 18.0, "prefill_time": 3.0,
                                                           "decode_time": 15.0}}}
    at.run()
    assert not at.exception
    metrics = [(m.label, m.value) for m in at.metric]
    assert ("Servers healthy", "4/4") in metrics  # the sidebar, from the sampler's sweep
    assert ("Requests in flight, mean (last grading)", "1.80") in metrics
    assert not any("speedup" in label.lower() for label, _ in metrics)
    per_model = [(label, value) for label, value in metrics if label in ("Prefill p50", "Decode p50")]
    assert per_model == [("Prefill p50", "500 ms"), ("Decode p50", "1.00 s"),   # gpt-oss
                         ("Prefill p50", "250 ms"), ("Decode p50", "750 ms")]   # qwen
    assert ("Canaries passed", "1") in metrics and ("Handoffs refused", "1") in metrics
    assert any("1 requests answered, **1 failed**" in c.value for c in at.caption)

    charts = chart_frames(at)
    times = charts["Prefill and decode time per request (s)"]
    assert sorted(zip(times["model"], times["phase"], times["seconds"])) == [
        ("gpt-oss", "decode", 1.0), ("gpt-oss", "prefill", 0.5), ("qwen", "decode", 0.75), ("qwen", "prefill", 0.25)]
    throughput = charts["Decode tokens/s, all decode servers (30 s average)"]
    assert dict(zip(throughput["model"], throughput["tokens_per_second"])) == {"gpt-oss": 0.0, "qwen": 4.0,
                                                                               "all models": 4.0}
    slots = charts["Slots busy and queue depth per server"]
    assert set(slots["server"]) == {"fake-prefill-qwen", "fake-prefill-gpt-oss", "fake-decode-qwen",
                                    "fake-decode-gpt-oss"} and slots["requests"].max() == 1
    mix = charts["How requests were served"]
    served = {(v, m): n for v, m, n in zip(mix["view"], mix["method"], mix["requests"]) if n}
    # the fake client's requests are handoffs (metrics.Method), as the decode servers count theirs
    assert served == {("this interface", "kv_handoff"): 2, ("decode servers (every client)", "kv_handoff"): 1}
    link = charts["KV link throughput against capacity (Gb/s)"]
    assert dict(zip(link["figure"], link["gbps"])) == {"pulls, every client": 8.0, "capacity (doctor's probe)": 10.0}

    servers, requests = at.dataframe[-2].value, at.dataframe[-1].value
    assert len(servers) == 4 and set(servers["role"]) == {"prefill", "decode"}
    assert list(servers["state"]) == ["● healthy"] * 4  # no emoji: a glyph every font has
    assert list(requests["model"]) == ["gpt-oss", "gpt-oss", "qwen"]  # newest first
    assert list(requests["result"]) == ["✕ upstream_timeout", "✓ ok", "✓ ok"]


def test_dashboard_without_a_sampler_shows_the_client_s_view():
    fake = FakeGradingClient()
    at = AppTest.from_file(DASHBOARD, default_timeout=60)
    at.session_state["client"] = fake
    at.run()
    assert not at.exception
    assert ("Servers healthy", "4/4") in [(m.label, m.value) for m in at.metric]
    assert "No requests from this interface" in at.info[0].value
    assert len(at.dataframe[-1].value) == 4  # the servers, as the client sees them


def test_the_pages_by_name():
    at = AppTest.from_file(NAVIGATION, default_timeout=60)
    at.session_state["client"] = FakeGradingClient()
    at.run()
    assert not at.exception and at.title[0].value == "Business analytics notebook grader"
    at.switch_page(DASHBOARD).run()
    assert not at.exception and at.title[0].value == "Disaggregated inference: cluster dashboard"


def test_launcher_runs_streamlit_on_loopback(monkeypatch, tmp_path):
    started = {}

    class FakePopen:
        def __init__(self, cmd, env, **popen):
            started.update(cmd=cmd, env=env)

        def wait(self, timeout=None):
            return 0

    config = tmp_path / "cluster.json"
    config.write_text(json.dumps({"prefill_servers": [], "decode_servers": []}))
    monkeypatch.setattr(lifetime.subprocess, "Popen", FakePopen)
    assert launcher.main(["--config", str(config), "--out", str(tmp_path / "o")]) == 0
    cmd = started["cmd"]
    assert cmd[1:4] == ["-m", "streamlit", "run"] and cmd[4] == NAVIGATION
    assert cmd[cmd.index("--server.address") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--client.toolbarMode") + 1] == "viewer"  # no Deploy menu
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
