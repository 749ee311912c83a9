"""Grade page: choose a rubric and notebooks, grade them with visible progress, read and download the results.

Run with ``python -m disaggregated_inference.webui`` (it calls ``streamlit run`` on navigation.py,
which names this page "Grade notebooks").
"""
from __future__ import annotations

import json
import tempfile
import threading
from pathlib import Path

import streamlit as st

from disaggregated_inference.client import describe_overlap
from disaggregated_inference.errors import DisaggError, RubricError
from disaggregated_inference.grading import GradingOptions, grade_batch, load_rubric
from disaggregated_inference.grading.connect import default_jobs, require_servers
from disaggregated_inference.grading.report import criteria_rows, gradebook_csv, gradebook_rows, render_markdown, \
    render_summary_markdown, rerun_verdict
from disaggregated_inference.grading.sandbox import find_sandbox
from disaggregated_inference.webui import health, state

UPLOAD_RUBRIC = "Upload a rubric file..."
EXAMPLES, UPLOADS = "Example notebooks", "Upload notebooks"


def _client():
    try:
        return state.get_client()
    except DisaggError as exc:
        st.error(f"Cannot use the cluster config {state.config_path()}: {exc.message}")
        st.stop()


def _save_uploads(files, folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for f in files:
        path = folder / Path(f.name).name
        path.write_bytes(f.getvalue())
        paths.append(path)
    return paths


def choose_rubric():
    choices = [str(p) for p in state.example_rubrics()] + [UPLOAD_RUBRIC]
    choice = st.selectbox("Rubric", choices, key="rubric_choice")
    if choice == UPLOAD_RUBRIC:
        upload = st.file_uploader("Rubric file (YAML or JSON)", type=["yaml", "yml", "json"], key="rubric_upload")
        if upload is None:
            st.info("Upload a rubric to continue.")
            st.stop()
        folder = Path(tempfile.gettempdir()) / "disagg-grader-rubrics"
        choice = str(_save_uploads([upload], folder)[0])
    try:
        rubric = load_rubric(choice)
    except RubricError as exc:
        st.error(f"The rubric is invalid: {exc.message}")
        st.stop()
    with st.expander(f"{rubric.title}: {len(rubric.criteria)} criteria, {rubric.max_points:g} points"):
        st.table([{"id": c.id, "criterion": c.title, "points": c.points,
                   "evidence required": ", ".join(k for k, v in vars(c.evidence).items() if v) or "-",
                   "hidden tests": len(c.tests)}
                  for c in rubric.criteria])
    return rubric


def choose_notebooks() -> list[Path]:
    source = st.radio("Submissions", [EXAMPLES, UPLOADS], horizontal=True, key="source")
    if source == EXAMPLES:
        examples = {p.name: p for p in state.example_notebooks()}
        chosen = st.multiselect("Example notebooks", list(examples), default=list(examples), key="examples")
        return [examples[name] for name in chosen]
    files = st.file_uploader("Jupyter notebooks (.ipynb)", type=["ipynb"], accept_multiple_files=True,
                             key="uploads")
    return _save_uploads(files or [], state.out_dir() / "uploads")


class GradingJob:
    """One press of Grade, shared with the page's later runs through the session.

    Pressing Stop (or anything else on the page, or Streamlit's own stop) while grading makes
    Streamlit start a new run of the page and stop this one at its next drawing call, the progress
    callback, after which this run may neither draw nor touch the session. So the callback sets
    ``stop`` (the batch then ends as the command line's Ctrl-C ends it: nothing more started,
    requests in flight cancelled, what was graded kept), the batch's outcome goes here, and the
    new run (``collect_stopped``) waits for ``done`` and shows it."""

    def __init__(self):
        self.stop, self.done = threading.Event(), threading.Event()
        self.batch: dict | None = None  # what show_results shows
        self.error: str | None = None


def grade(rubric, paths: list[Path], client, force: bool) -> None:
    """Grade with a progress bar and a stop button."""
    job = st.session_state["grading"] = GradingJob()
    st.button("Stop grading", key="stop", help="Stop after cancelling the requests in flight; the notebooks "
              "graded so far are kept, and Grade continues with the rest")
    bar = st.progress(0.0, text=f"grading {len(paths)} notebooks")
    interrupted = []

    def progress(p) -> None:
        if job.stop.is_set():
            return  # stopping: this run may not draw any more
        try:
            bar.progress(p.done / p.total if p.total else 1.0, text=p.describe())
        except BaseException as exc:  # Streamlit stops this run: end the batch cleanly first
            interrupted.append(exc)
            job.stop.set()

    options = GradingOptions.for_cluster(getattr(client, "config", None),
                                         execute=st.session_state.get("execute", True))
    try:
        require_servers(client, (options.code_model, options.feedback_model))
        batch = grade_batch(paths, rubric, client, state.out_dir(), options, force=force, progress=progress,
                            jobs=default_jobs(client, (options.code_model, options.feedback_model)), stop=job.stop)
        job.batch = {"results": batch.results, "summary": batch.summary, "out_dir": str(batch.out_dir),
                     "graded": batch.graded, "resumed": batch.resumed, "not_graded": batch.not_graded,
                     "stopped": batch.stopped}
    except DisaggError as exc:
        job.error = f"Grading stopped: {exc.message}"
    finally:
        job.done.set()
    if interrupted:
        raise interrupted[0]  # Streamlit's: another run of the page shows the outcome
    collect(job)


def collect(job: GradingJob) -> None:
    """The outcome of a grading, into the session (the results below show it)."""
    del st.session_state["grading"]
    if job.error:
        st.error(job.error)
    elif job.batch is not None:
        st.session_state["batch"] = job.batch


def collect_stopped() -> None:
    """A grading that an earlier run of the page left (it was stopped): wait for its end, then show it."""
    job = st.session_state.get("grading")
    if job is None:
        return
    job.stop.set()  # this run began while it graded: stop it, if its run has not seen that yet
    if not job.done.is_set():
        with st.spinner("Stopping: the requests in flight are being cancelled..."):
            job.done.wait(60)
    if job.done.is_set():
        collect(job)


def show_results(batch: dict) -> None:
    results, summary = batch["results"], batch["summary"]
    st.header("Results")
    inf = summary["inference"]
    cols = st.columns(5)
    cols[0].metric("Submissions", summary["submissions"])
    cols[1].metric("Mean score", "-" if summary["mean"] is None else f"{summary['mean']:g} / {summary['max_points']:g}")
    cols[2].metric("Std deviation", "-" if summary["stdev"] is None else f"{summary['stdev']:g}")
    cols[3].metric("Needs review", len(summary["flagged"]))
    cols[4].metric("Requests in flight (mean)", "-" if inf["overlap"] is None else f"{inf['overlap']:.2f}",
                   help=describe_overlap(inf) + "; requests queued on one server count as in flight: not a speedup")
    if batch.get("stopped"):
        st.warning(f"Grading was stopped: {len(batch['graded'])} graded, {len(batch['not_graded'])} not graded "
                   f"({', '.join(batch['not_graded'])}). Press Grade to grade the rest; the graded ones are kept.",
                   icon=":material/stop_circle:")
    if batch.get("resumed"):
        st.caption(f"{len(batch['resumed'])} kept from an earlier run (same notebook, same rubric): "
                   + ", ".join(batch["resumed"]))
    if not results:
        return
    st.dataframe(gradebook_rows(results), hide_index=True)
    show_reruns(results)
    for flag in summary["flagged"]:
        st.warning(f"**{flag['submission']}** needs review ({flag['status']}): " + "; ".join(flag["reasons"]))

    csv_text = gradebook_csv(results)
    summary_md = render_summary_markdown(summary, results)
    cols = st.columns(3)
    cols[0].download_button("Download gradebook (CSV)", csv_text, "gradebook.csv", "text/csv")
    cols[1].download_button("Download summary (Markdown)", summary_md, "summary.md", "text/markdown")
    cols[2].download_button("Download all reports (zip)", state.reports_zip(results, csv_text, summary_md),
                            "grading_reports.zip", "application/zip")

    st.header("Student detail")
    by_name = {r["submission"]["name"]: r for r in results}
    name = st.selectbox("Submission", list(by_name), key="detail")
    result = by_name[name]
    if result["criteria"]:
        st.subheader("Score breakdown: evidence, model adjustment (bounded), final")
        st.dataframe(criteria_rows(result), hide_index=True, key=f"breakdown-{name}")
    st.markdown(render_markdown(result))
    st.download_button(f"Download {name}.json", json.dumps(result, indent=2), f"{name}.json", "application/json",
                       key=f"json-{name}")
    with st.expander("Raw result (JSON)"):
        st.json(result, expanded=False)


def choose_execution() -> None:
    """Whether notebooks are re-run in the sandbox; where none works here, why not."""
    st.checkbox("Re-run each notebook in a sandbox (and run the rubric's hidden tests)", value=True, key="execute",
                help="bubblewrap: no network, only the notebook's own folder, limits on time, memory and processes")
    if st.session_state.get("execute", True):
        sandbox, why = find_sandbox()
        if sandbox is None:
            st.caption(f"Notebooks will be graded from their saved outputs: {why}.")


def show_reruns(results: list[dict]) -> None:
    """What the re-run found, per notebook: the verdict, the time, what the sandbox stopped."""
    rows = []
    for r in results:
        execution = r.get("layers", {}).get("execution")
        if not execution:
            continue
        rows.append({"submission": r["submission"]["name"], "re-run": rerun_verdict(r),
                     "seconds": execution.get("seconds"),
                     "stopped by the sandbox": "; ".join(execution.get("incidents") or []) or "-"})
    if rows:
        st.subheader("Re-run in the sandbox")
        st.dataframe(rows, hide_index=True, key="reruns")


def main() -> None:
    st.set_page_config(page_title="Notebook grader", layout="wide")
    st.title("Business analytics notebook grader")
    client = _client()
    with st.sidebar:
        health.sidebar_health(client)
        st.caption("The Cluster dashboard page shows timings, throughput, handoffs and KV links.")
    collect_stopped()
    rubric = choose_rubric()
    paths = choose_notebooks()
    force = st.checkbox("Grade again even if already graded", key="force")
    choose_execution()
    if st.button("Grade", type="primary", disabled=not paths, key="grade"):
        grade(rubric, paths, client, force)
    if "batch" in st.session_state:
        show_results(st.session_state["batch"])


main()
