"""Grade page: choose a rubric and notebooks, grade them with visible progress, read and download the results.

Run with ``python -m disaggregated_inference.webui`` (it calls ``streamlit run`` on navigation.py,
which names this page "Grade notebooks").
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import streamlit as st

from disaggregated_inference.client import describe_overlap
from disaggregated_inference.errors import DisaggError, RubricError
from disaggregated_inference.grading import GradingOptions, grade_batch, load_rubric
from disaggregated_inference.grading.connect import decode_slots, require_servers
from disaggregated_inference.grading.report import criteria_rows, gradebook_csv, gradebook_rows, render_markdown, \
    render_summary_markdown
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
                   "evidence required": ", ".join(k for k, v in vars(c.evidence).items() if v) or "-"}
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


def grade(rubric, paths: list[Path], client, force: bool) -> None:
    bar = st.progress(0.0, text=f"grading {len(paths)} notebooks")

    def progress(done: int, total: int, name: str, status: str) -> None:
        bar.progress(done / total if total else 1.0, text=f"{done}/{total} {name}: {status}")

    options = GradingOptions.for_cluster(getattr(client, "config", None))
    try:
        require_servers(client, (options.code_model, options.feedback_model))
        batch = grade_batch(paths, rubric, client, state.out_dir(), options, force=force, progress=progress,
                            jobs=decode_slots(client))
    except DisaggError as exc:
        st.error(f"Grading stopped: {exc.message}")
        return
    st.session_state["batch"] = {"results": batch.results, "summary": batch.summary,
                                 "out_dir": str(batch.out_dir), "graded": batch.graded, "resumed": batch.resumed}


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
    if batch.get("resumed"):
        st.caption(f"{len(batch['resumed'])} kept from an earlier run (same notebook, same rubric): "
                   + ", ".join(batch["resumed"]))
    st.dataframe(gradebook_rows(results), hide_index=True)
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


def main() -> None:
    st.set_page_config(page_title="Notebook grader", layout="wide")
    st.title("Business analytics notebook grader")
    client = _client()
    with st.sidebar:
        health.sidebar_health(client)
        st.caption("The Cluster dashboard page shows timings, throughput, handoffs and KV links.")
    rubric = choose_rubric()
    paths = choose_notebooks()
    force = st.checkbox("Grade again even if already graded", key="force")
    if st.button("Grade", type="primary", disabled=not paths, key="grade"):
        grade(rubric, paths, client, force)
    if "batch" in st.session_state:
        show_results(st.session_state["batch"])


main()
