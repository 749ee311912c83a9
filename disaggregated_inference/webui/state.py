"""What the pages share: the client, the sampler, the examples, the last batch; no drawing here.

The client is the one in ``st.session_state["client"]`` if there is one (tests
put a fake there), else one ``DisaggregatedClient`` per config for the whole
server process, on the config named by ``$DISAGG_GRADER_CONFIG`` (the launcher
sets it; it points at the embedded cluster's ports when it started one),
``$DISAGG_CONFIG`` or ``config_current.json``. The sampler (``observe.Sampler``:
every server's ``/health`` and ``/metrics`` every few seconds) is likewise the
session's (a test's) or one per config for the process, started on first use.
"""
from __future__ import annotations

import io
import json
import os
import zipfile
from pathlib import Path

import streamlit as st

from .. import config as cluster_config
from ..grading.report import render_markdown

CONFIG_ENV = "DISAGG_GRADER_CONFIG"
EXAMPLES_ENV = "DISAGG_GRADER_EXAMPLES"
OUT_ENV = "DISAGG_GRADER_OUT"
BENCH_ENV = "DISAGG_BENCH_OUT"  # disagg bench's --out: the dashboard shows its last report


def config_path() -> str:
    return os.environ.get(CONFIG_ENV) or os.environ.get("DISAGG_CONFIG") or cluster_config.DEFAULT_CONFIG_FILE


def examples_dir() -> Path:
    """``examples/`` of the repository (or ``$DISAGG_GRADER_EXAMPLES``, or ./examples)."""
    if os.environ.get(EXAMPLES_ENV):
        return Path(os.environ[EXAMPLES_ENV])
    repo = Path(__file__).resolve().parents[2] / "examples"
    return repo if repo.is_dir() else Path("examples")


def example_notebooks() -> list[Path]:
    folder = examples_dir() / "notebooks"
    return sorted(folder.glob("*.ipynb")) if folder.is_dir() else []


def example_rubrics() -> list[Path]:
    folder = examples_dir()
    return sorted(p for ext in ("yaml", "yml", "json") for p in folder.glob(f"*.{ext}")) if folder.is_dir() else []


def out_dir() -> Path:
    return Path(os.environ.get(OUT_ENV) or "grades/webui")


def bench_report_file() -> Path:
    """The last ``disagg bench`` report: bench.json in ``$DISAGG_BENCH_OUT`` (the launcher's ``--bench-out``),
    else in ./bench-report (the bench's default ``--out``)."""
    return Path(os.environ.get(BENCH_ENV) or "bench-report") / "bench.json"


@st.cache_resource(show_spinner=False)
def _shared_client(path: str):
    from ..client import DisaggregatedClient

    return DisaggregatedClient(path)


def get_client():
    """The client of this session (a test's fake) or the process-wide one; the error, if none can be made."""
    client = st.session_state.get("client")
    if client is not None:
        return client
    return _shared_client(config_path())


SAMPLE_SECONDS = 5.0  # between the sampler's sweeps of every server (8 small GETs for 4 servers)


@st.cache_resource(show_spinner=False)
def _shared_sampler(path: str):
    from ..observe.sampler import Sampler

    return Sampler(_shared_client(path).config, interval=SAMPLE_SECONDS).start()


def get_sampler():
    """The sampler of this session (a test's) or the process-wide one for the client's config; None for
    a client without a config (a test's fake without a sampler)."""
    sampler = st.session_state.get("sampler")
    if sampler is not None:
        return sampler
    if st.session_state.get("client") is not None:
        return None
    return _shared_sampler(config_path())


def healthy(server: dict) -> bool:
    """Up and with its model loaded, as last checked (a server not checked yet is not counted)."""
    return bool(server.get("up") and server.get("loaded"))


def reports_zip(results: list[dict], gradebook: str, summary_md: str) -> bytes:
    """Every submission's JSON and Markdown report, the gradebook and the summary, in one zip."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("gradebook.csv", gradebook)
        zf.writestr("summary.md", summary_md)
        for r in results:
            name = r["submission"]["name"]
            zf.writestr(f"reports/{name}.json", json.dumps(r, indent=2, ensure_ascii=False))
            zf.writestr(f"reports/{name}.md", render_markdown(r))
    return buffer.getvalue()
