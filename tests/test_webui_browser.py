"""The web interface end to end: a real Streamlit process, a real headless Chromium, real gunicorn servers
(the session's ``tiny_cluster``: what the page shows is tested, not what a model writes; the grading runs
the whole pipeline, KV handoffs included, in seconds). Upload a notebook, press Grade, read its grade on
the page; then open the cluster dashboard and find that grading's requests in its charts. Screenshots of both pages are saved
under the test's tmp dir (the paths are printed). Then upload two notebooks, press Grade, and Stop while
both models are generating: the page says so within seconds and the servers' slots are free again.

Needs Chromium at /usr/bin/chromium (Debian: ``apt-get install chromium``; ``.ci/run`` installs it) and the
``playwright`` Python package (the ``test`` extra; no ``playwright install``: it drives that Chromium).
Outside CI a missing browser skips the test; in CI (``$CI`` set) it fails.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests

from .conftest import CALIBRATION

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "notebooks" / "good_sales_analysis.ipynb"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
START_TIMEOUT = 120  # s: streamlit's first page on a busy 2-core machine
GRADE_TIMEOUT = 360  # s: one notebook through both models (seconds on the tiny ones; room for a busy machine)


def _unavailable(what: str) -> None:
    """Skip on a developer's machine, fail in CI: the browser test must not vanish from CI silently."""
    message = f"{what}; the browser test of the web interface needs it (Debian/Ubuntu: `sudo apt-get install " \
              "chromium`; the Python package: `.venv/bin/python -m pip install -e '.[test]'`)"
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@pytest.fixture
def sync_playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("the Python package playwright is not installed")
    if not os.access(CHROMIUM, os.X_OK):
        _unavailable(f"Chromium is not installed at {CHROMIUM}")
    return sync_playwright


@pytest.fixture(scope="module")
def webui(tiny_cluster, tmp_path_factory):
    """``python -m disaggregated_inference.webui`` on the tiny session cluster's config; yields (its URL, its --out folder)."""
    tmp_path = tmp_path_factory.mktemp("webui")
    config_file = tmp_path / "cluster.json"
    config_file.write_text(json.dumps(tiny_cluster.config, indent=2))
    log_path = tmp_path / "webui.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    with open(log_path, "wb") as log:
        # its own session: the launcher and the streamlit it starts form one process group, ours to stop
        proc = subprocess.Popen([sys.executable, "-m", "disaggregated_inference.webui", "--config", str(config_file),
                                 "--host", "127.0.0.1", "--out", str(tmp_path / "out"),
                                 "--bench-out", str(tmp_path / "bench")],
                                cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = _wait_for_url(proc, log_path)
        yield url, tmp_path / "out"
    finally:
        _stop(proc)
        print(f"--- web interface log ({log_path}) ---\n" + log_path.read_text(errors="replace")[-4000:])


def _wait_for_url(proc: subprocess.Popen, log_path: Path) -> str:
    deadline = time.monotonic() + START_TIMEOUT
    url = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the web interface exited with {proc.returncode}:\n{log_path.read_text(errors='replace')}")
        if url is None:
            found = re.search(r"grader web interface: (http://127\.0\.0\.1:\d+)", log_path.read_text(errors="replace"))
            url = found and found.group(1)
        if url:
            try:
                if requests.get(f"{url}/_stcore/health", timeout=5).ok:
                    return url
            except requests.RequestException:
                pass
        time.sleep(0.5)
    pytest.fail(f"the web interface did not answer within {START_TIMEOUT} s:\n{log_path.read_text(errors='replace')}")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the launcher (it stops its streamlit); then whatever is left of that process group."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group the launcher leads: only processes this test started
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.wait(10)


@contextmanager
def browser_page(sync_playwright, tmp_path):
    """A page of a headless Chromium; a screenshot in ``tmp_path`` if the test fails."""
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile, sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(profile, executable_path=str(CHROMIUM), headless=True,
                                                        args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 1000})
        page = context.new_page()
        try:
            yield page
        except BaseException:
            shot = tmp_path / "webui-failure.png"
            try:
                page.screenshot(path=str(shot), full_page=True)
                print(f"screenshot of the page: {shot}")
            except Exception as exc:  # the page itself may be gone
                print(f"no screenshot: {exc}")
            raise
        finally:
            context.close()


def upload_and_grade(page, url: str, notebooks: list[Path]) -> None:
    """Open the grader, upload ``notebooks``, press Grade."""
    page.goto(url, timeout=START_TIMEOUT * 1000)
    page.get_by_text("Business analytics notebook grader").wait_for(timeout=START_TIMEOUT * 1000)
    page.get_by_text("Upload notebooks", exact=True).click()
    uploader = page.locator('[data-testid="stFileUploader"] input[type="file"]')
    uploader.wait_for(state="attached", timeout=60_000)
    uploader.set_input_files([str(p) for p in notebooks])
    for notebook in notebooks:  # listed under the uploader (the chip shows a shortened name; its title the whole)
        page.locator(f'[data-testid="stFileChipName"][title="{notebook.name}"]').wait_for(timeout=60_000)
    grade = page.get_by_role("button", name="Grade", exact=True)
    deadline = time.monotonic() + 60
    while not grade.is_enabled():  # enabled once the rerun after the upload has drawn the page
        assert time.monotonic() < deadline, "the Grade button stayed disabled after the upload"
        page.wait_for_timeout(500)
    grade.click()


def test_grade_a_notebook_then_read_its_requests_on_the_dashboard(sync_playwright, webui, tmp_path):
    url, out = webui
    with browser_page(sync_playwright, tmp_path) as page:
        page.goto(url, timeout=START_TIMEOUT * 1000)
        page.get_by_text("Business analytics notebook grader").wait_for(timeout=START_TIMEOUT * 1000)
        # the pages by name; the sidebar's health catches up by itself (no click); no Deploy menu
        nav = page.get_by_test_id("stSidebarNav").inner_text()
        assert "Grade notebooks" in nav and "Cluster dashboard" in nav and "app" not in nav.split()
        _wait_for_sidebar_health(page, "4/4")
        assert not page.get_by_text("Deploy", exact=True).count()

        upload_and_grade(page, url, [NOTEBOOK])
        detail = _wait_for_result(page)
        text = detail.inner_text()
        assert "good_sales_analysis" in text
        score = re.search(r"Score: (\d+(?:\.\d+)?) / (\d+(?:\.\d+)?)", text)
        assert score, f"no score in the report:\n{text[:2000]}"
        assert 0 <= float(score.group(1)) <= float(score.group(2))
        status = re.search(r"Status: (\w+)", text)
        assert status and status.group(1) in ("graded", "needs_review"), text[:2000]
        # and in the results' header: one submission graded
        assert page.get_by_test_id("stMetric").filter(has_text="Submissions").inner_text().split()[-1] == "1"
        _screenshot(page, tmp_path / "grade-page.png")

        bench = _run_bench(out.parent)  # disagg bench's last report, shown on the dashboard
        page.get_by_role("link", name="Cluster dashboard").click()
        _check_dashboard(page, out / "good_sales_analysis.json")
        _check_bench_report(page, bench)
        _screenshot(page, tmp_path / "dashboard.png")


def test_stop_grading_cancels_the_requests_in_a_browser(sync_playwright, webui, tiny_cluster, tmp_path):
    """Stop while both notebooks' answers are being generated: the page says what was not graded within
    seconds, and the decode servers drop the cancelled jobs (their slots are free again)."""
    servers = {p.entry.name: p.url for p in tiny_cluster.processes}

    def busy() -> dict:
        return {name: requests.get(url + "/health", timeout=10).json()["slots"]["busy"]
                for name, url in servers.items()}

    notebooks = [CALIBRATION / "decent.ipynb", CALIBRATION / "weak.ipynb"]
    with browser_page(sync_playwright, tmp_path) as page:
        upload_and_grade(page, webui[0], notebooks)
        stop = page.get_by_role("button", name="Stop grading", exact=True)
        stop.wait_for(timeout=60_000)
        deadline = time.monotonic() + GRADE_TIMEOUT
        while True:  # decoding on both models, no prompt in prefill (a /prefill runs to its end)
            now = busy()
            if all(now[f"local-decode-{m}"] for m in ("qwen", "gpt-oss")) and not any(
                    now[f"local-prefill-{m}"] for m in ("qwen", "gpt-oss")):
                break
            assert time.monotonic() < deadline, f"the servers never decoded both notebooks' requests: {now}"
            page.wait_for_timeout(300)
        stop.click()
        pressed = time.monotonic()
        page.get_by_text("Grading was stopped").wait_for(timeout=30_000)
        shown = time.monotonic() - pressed
        text = page.inner_text("body")
        freed = None
        while time.monotonic() - pressed < 30:
            if not any(busy().values()):
                freed = time.monotonic() - pressed
                break
            time.sleep(0.2)
    assert shown < 10, f"the page said it had stopped {shown:.1f} s after Stop"
    assert freed is not None and freed < 10, f"slots still busy 30 s after Stop: {busy()}"
    assert "not graded" in text and "Press Grade to grade the rest" in text


def _screenshot(page, path: Path) -> None:
    """The whole page: Streamlit scrolls inside its own container, so the window is made as tall as it."""
    height = page.evaluate("() => document.querySelector('[data-testid=\"stMain\"]')?.scrollHeight || 1000")
    page.set_viewport_size({"width": 1400, "height": min(max(1000, height + 100), 6000)})
    page.wait_for_timeout(1000)
    page.screenshot(path=str(path), full_page=True)
    page.set_viewport_size({"width": 1400, "height": 1000})
    print(f"screenshot: {path}")


def _wait_for_sidebar_health(page, expected: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    metric = page.get_by_test_id("stSidebar").get_by_test_id("stMetric").filter(has_text="Servers healthy")
    while time.monotonic() < deadline:
        if metric.count() and metric.first.inner_text().split()[-1] == expected:
            return
        page.wait_for_timeout(1000)
    pytest.fail(f"the sidebar never showed {expected} servers healthy: {metric.first.inner_text()!r}")


def _chart_points(page, title: str) -> list[dict]:
    """The marks of the chart titled ``title``, each as its ARIA label's fields ({"model": "qwen", ...})."""
    labels = page.evaluate("""(title) => {
        for (const chart of document.querySelectorAll('[data-testid="stVegaLiteChart"]')) {
            const svg = chart.querySelector('svg');
            if (svg && svg.textContent.includes(title))
                return [...svg.querySelectorAll('[aria-label][aria-roledescription]')]
                    .map(e => e.getAttribute('aria-label'));
        }
        return null;
    }""", title)
    if labels is None:
        return []
    points = []
    for label in labels:  # a mark's label is "field: value; field: value"; a legend's or an axis's is prose
        parts = label.split("; ")
        if all(": " in part for part in parts):
            points.append(dict(part.split(": ", 1) for part in parts))
    return points


def _run_bench(folder: Path) -> dict:
    """A short ``disagg bench`` on the cluster the web interface uses, into the launcher's --bench-out."""
    from disaggregated_inference import cli

    assert cli.main(["bench", "--config", str(folder / "cluster.json"), "--workload", "chat", "--requests", "4",
                     "--max-tokens", "4", "--efficiency-groups", "0", "--out", str(folder / "bench")]) == 0
    return json.loads((folder / "bench" / "bench.json").read_text())


def _check_bench_report(page, report: dict) -> None:
    """The dashboard's "Last bench report": every success metric with the value bench.json has."""
    from disaggregated_inference.bench.table import fmt

    page.get_by_text("Last bench report").wait_for(timeout=60_000)
    table = page.get_by_test_id("stTable").filter(has_text="e2e_latency_p95_s")
    table.wait_for(timeout=60_000)
    text = table.inner_text()
    for row in report["success_metrics"]:
        assert row["name"] in text, text
    throughput = next(r for r in report["success_metrics"] if r["name"] == "throughput_req_s")
    assert fmt(throughput["value"], throughput["unit"]) in text, text


def _check_dashboard(page, report_path: Path) -> None:
    """Every request of the grading (from its report) is a point in the dashboard's timing chart; the
    server charts have points; the sidebar says 4/4 here too."""
    page.get_by_text("Disaggregated inference: cluster dashboard").wait_for(timeout=60_000)
    requests_ = [r for r in json.loads(report_path.read_text())["inference"]["requests"] if not r["error"]]
    assert requests_, "the grading made no successful request"
    wanted = {(r["model"], phase, round(r[f"{phase}_time"], 3)) for r in requests_ for phase in ("prefill", "decode")}
    deadline = time.monotonic() + 60
    while True:
        points = _chart_points(page, "Prefill and decode time per request")
        seen = {(p.get("model"), p.get("phase"), round(float(p.get("seconds", "nan")), 3)) for p in points}
        if wanted <= seen or time.monotonic() > deadline:
            break
        page.wait_for_timeout(2000)
    assert wanted <= seen, f"grading requests {sorted(wanted - seen)} not in the chart's points {sorted(seen)}"
    throughput = _chart_points(page, "Decode tokens/s, all decode servers")
    assert any(p.get("model") == "all models" and float(p["tokens_per_second"]) > 0
               for p in throughput), throughput[-5:]
    slots = _chart_points(page, "Slots busy and queue depth per server")
    assert {p["server"] for p in slots if "server" in p} == {"local-prefill-qwen", "local-prefill-gpt-oss",
                                                             "local-decode-qwen", "local-decode-gpt-oss"}
    links = _chart_points(page, "KV link throughput against capacity")
    assert any(p.get("figure") == "handoffs, this interface" and float(p["gbps"]) > 0 for p in links), links
    _wait_for_sidebar_health(page, "4/4")

    # the links' capacity, measured on demand (what disagg doctor measures; the decode servers keep it)
    page.get_by_role("button", name="Measure link capacity now").click()
    deadline = time.monotonic() + 60
    while True:
        capacity = {p["link"]: float(p["gbps"]) for p in _chart_points(page, "KV link throughput against capacity")
                    if p.get("figure") == "capacity (doctor's probe)"}
        if len(capacity) == 2 or time.monotonic() > deadline:
            break
        page.wait_for_timeout(2000)
    assert set(capacity) == {"local-prefill-qwen -> local-decode-qwen",
                             "local-prefill-gpt-oss -> local-decode-gpt-oss"}
    assert all(gbps > 0 for gbps in capacity.values()), capacity


def _wait_for_result(page):
    """The Student detail report once grading is done; fail fast on an error shown by the page."""
    deadline = time.monotonic() + GRADE_TIMEOUT
    report = page.get_by_test_id("stMarkdown").filter(has_text=re.compile(r"good_sales_analysis: .*Score:", re.S))
    while time.monotonic() < deadline:
        if report.count():
            return report.first
        problems = page.locator('[data-testid="stException"], [data-testid="stAlertContentError"]')
        if problems.count():
            pytest.fail("the web interface shows an error: " + " / ".join(problems.all_inner_texts()))
        page.wait_for_timeout(2000)
    pytest.fail(f"no grade on the page after {GRADE_TIMEOUT} s; the page says:\n{page.inner_text('body')[-3000:]}")
