"""The web interface end to end: a real Streamlit process, a real headless Chromium, the session cluster's
REAL servers and models. Upload a notebook, press Grade, read its grade on the page; upload two, press Grade, then Stop.

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

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "notebooks" / "good_sales_analysis.ipynb"
CALIBRATION = ROOT / "examples" / "notebooks" / "calibration"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
START_TIMEOUT = 120  # s: streamlit's first page on a busy 2-core machine
GRADE_TIMEOUT = 360  # s: one notebook through both real models (about 1-2 minutes on 2 cores)


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
def webui(cluster, tmp_path_factory):
    """``python -m disaggregated_inference.webui`` on the session cluster's config; yields its URL."""
    tmp_path = tmp_path_factory.mktemp("webui")
    config_file = tmp_path / "cluster.json"
    config_file.write_text(json.dumps(cluster.config, indent=2))
    log_path = tmp_path / "webui.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    with open(log_path, "wb") as log:
        # its own session: the launcher and the streamlit it starts form one process group, ours to stop
        proc = subprocess.Popen([sys.executable, "-m", "disaggregated_inference.webui", "--config", str(config_file),
                                 "--host", "127.0.0.1", "--out", str(tmp_path / "out")],
                                cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = _wait_for_url(proc, log_path)
        yield url
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


def test_upload_and_grade_a_notebook_in_a_browser(sync_playwright, webui, tmp_path):
    with browser_page(sync_playwright, tmp_path) as page:
        upload_and_grade(page, webui, [NOTEBOOK])
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


def test_stop_grading_cancels_the_requests_in_a_browser(sync_playwright, webui, cluster, tmp_path):
    """Stop while both notebooks' answers are being generated: the page says what was not graded within
    seconds, and the decode servers drop the cancelled jobs (their slots are free again)."""
    servers = {p.entry.name: p.url for p in cluster.processes}

    def busy() -> dict:
        return {name: requests.get(url + "/health", timeout=10).json()["slots"]["busy"]
                for name, url in servers.items()}

    notebooks = [CALIBRATION / "decent.ipynb", CALIBRATION / "weak.ipynb"]
    with browser_page(sync_playwright, tmp_path) as page:
        upload_and_grade(page, webui, notebooks)
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
