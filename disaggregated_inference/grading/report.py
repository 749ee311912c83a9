"""Reports: a JSON and a Markdown file per submission; a CSV gradebook and a summary per batch."""
from __future__ import annotations

import csv
import io
import json
import statistics
from pathlib import Path

from ..client import describe_overlap, overlap_figures


def _n(x, digits: int = 2) -> str:
    if x is None:
        return "-"
    return f"{x:.{digits}f}".rstrip("0").rstrip(".") if isinstance(x, float) else str(x)


def _md(text) -> str:
    return str(text or "").replace("|", "\\|").replace("\n", " ").rstrip(".")


def criteria_rows(result: dict) -> list[dict]:
    """One row per criterion: the evidence score, the model's adjustment, the final score, the reason for each."""
    return [{"criterion": c["id"], "evidence": c.get("evidence_score"), "model adjustment": c.get("model_adjustment"),
             "score": c["score"], "points": c["points"], "evidence: why": c.get("evidence_reason", ""),
             "adjustment: why": c.get("adjustment_reason", "")} for c in result["criteria"]]


# -- one submission ------------------------------------------------------------------------------

def result_paths(out_dir, name: str) -> tuple[Path, Path]:
    out_dir = Path(out_dir)
    return out_dir / f"{name}.json", out_dir / f"{name}.md"


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: a reader (or a run stopped
    half-way) sees the old file or the new one, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def write_result(result: dict, out_dir) -> tuple[Path, Path]:
    """Write ``NAME.json`` (everything) and ``NAME.md`` (for people); return their paths."""
    json_path, md_path = result_paths(out_dir, result["submission"]["name"])
    json_path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(md_path, render_markdown(result))
    # the JSON last: it is what a resumed batch trusts
    write_atomically(json_path, json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    return json_path, md_path


def read_result(path) -> dict | None:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def render_markdown(result: dict) -> str:
    sub = result["submission"]
    lines = [f"# {sub['name']}: {result['rubric']['title']}", ""]
    if result["total"] is not None:
        lines.append(f"**Score: {_n(result['total'])} / {_n(result['max_points'])}** ({_n(result['percent'], 1)}%)  ")
    else:
        lines.append(f"**Score: not graded** (out of {_n(result['max_points'])})  ")
    lines.append(f"Status: {result['status']}" + ("  \n**Needs human review.**" if result["needs_review"] else ""))
    lines.append("")
    for reason in result["review_reasons"]:
        lines.append(f"- {reason}")
    if result["review_reasons"]:
        lines.append("")

    if result["criteria"]:
        lines += ["## Criteria", "",
                  "| Criterion | Evidence | Model adjustment | Score | Points |", "|---|---:|---:|---:|---:|"]
        for c in result["criteria"]:
            adj = c.get("model_adjustment") or 0
            lines.append(f"| {c['title']} (`{c['id']}`) | {_n(c.get('evidence_score'))} | "
                         f"{'+' if adj > 0 else ''}{_n(adj)} | {_n(c['score'])} | {_n(c['points'])} |")
        lines += ["", "### Why", ""]
        for c in result["criteria"]:
            lines.append(f"- **`{c['id']}`**: evidence {_n(c.get('evidence_score'))}: {_md(c.get('evidence_reason'))}. "
                         f"Adjustment: {_md(c.get('adjustment_reason'))}."
                         + (f" The model's reason: \"{_md(c['rationale'])}\"" if c.get("rationale") else ""))
        lines.append("")
    not_used = result["layers"].get("validation", {}).get("model_not_used") or {}
    if not_used:
        lines += ["### Model answers not used", ""] + [f"- {role}: {_md(why)}" for role, why in not_used.items()] + [""]

    fb = result.get("feedback")
    if fb:
        lines += ["## Feedback", ""]
        if fb.get("summary"):
            lines += [fb["summary"], ""]
        sections = (("strengths", "Strengths"), ("improvements", "To improve"), ("issues", "Issues in the code"))
        sources = fb.get("sources", {})
        for key, title in sections:
            if fb.get(key):
                origin = sources.get(key) or []
                lines += [f"**{title}**", ""] + [
                    f"- {item}" + (f" _({origin[i]})_" if i < len(origin) else "") for i, item in enumerate(fb[key])
                ] + [""]

    layers = result["layers"]
    lines += ["## Checks", "", "**Submission:** " + ("valid notebook" if layers["submission"]["ok"]
                                                      else "; ".join(layers["submission"]["problems"])), ""]
    evidence = layers.get("evidence")
    if evidence:
        lines += ["**Evidence found:**", ""] + [f"- {f}" for f in evidence["findings"]] + [""]
        lines += ["| Criterion | Rule | Met | Detail |", "|---|---|---|---|"]
        for cid, checks in evidence["checks"].items():
            for k in checks:
                lines.append(f"| `{cid}` | {k['rule']} | {'yes' if k['passed'] else '**no**'} | {k['detail']} |")
        lines.append("")
    lines += execution_lines(layers.get("execution"))
    analysis = layers.get("analysis")
    if analysis and analysis["omitted"]:
        lines += ["**The models saw a shortened notebook:** " + "; ".join(analysis["omitted"]), ""]

    inf = result["inference"]
    if inf["requests"]:
        lines += ["## Inference", "",
                  "| Request | Model | Try | Method | Prefill s | Decode s | Tokens in/out | Decode tok/s |",
                  "|---|---|---:|---|---:|---:|---:|---:|"]
        for r in inf["requests"]:
            if r["error"]:
                lines.append(f"| {r['role']} | {r['model']} | {r['attempt']} | failed: {r['error']} | | | | |")
                continue
            lines.append(f"| {r['role']} | {r['model']} | {r['attempt']} | {r['method']} | {_n(r['prefill_time'], 3)} "
                         f"| {_n(r['decode_time'], 3)} | {r['prompt_tokens']}/{r['completion_tokens']} "
                         f"| {_n(r['decode_speed'], 1)} |")
        lines += ["", f"Concurrent requests: {describe_overlap(inf)}.", ""]
    return "\n".join(lines)


def rerun_verdict(result: dict) -> str:
    """The re-run in a few words, for a table row."""
    execution = result.get("layers", {}).get("execution")
    if not execution:
        return "-"
    if execution["status"] != "ran":
        return "not re-run"
    words = ["top to bottom" if execution["top_to_bottom"] else
             "fails in " + ", ".join(str(f["cell"]) for f in execution["failing"]) if execution["failing"]
             else "did not finish"]
    if execution["differs"]:
        n = len(execution["differs"])
        words.append(f"{n} saved output{'s differ' if n > 1 else ' differs'}")
    if execution["incidents"]:
        words.append(f"{len(execution['incidents'])} contained")
    tests = execution["tests"]
    if tests:
        words.append(f"tests {sum(t['status'] == 'passed' for t in tests)}/{len(tests)}")
    return "; ".join(words)


def execution_lines(execution: dict | None) -> list[str]:
    """The re-run in the sandbox: how it went, what it stopped, the hidden tests by title (never their code)."""
    if not execution:
        return []
    if execution["status"] != "ran":
        return ["**Re-run:** not re-run: " + _md(execution["reason"]) + ".", ""]
    verdict = "ran top to bottom without errors" if execution["top_to_bottom"] else "**did not run top to bottom**"
    lines = [f"**Re-run in the sandbox:** {verdict}, in {_n(execution['seconds'], 1)} s; "
             f"{execution['matched']} cells reproduced their saved outputs.", ""]
    lines += [f"- cell {f['cell']} fails when re-run: " + _md(f"{f['ename']}: {f['evalue']}" if f["ename"] else f["why"])
              for f in execution["failing"]]
    if execution["not_run"]:
        lines.append("- not reached: " + ", ".join(f"cell {n['cell']}" for n in execution["not_run"])
                     + f" ({_md(execution['not_run'][0]['why'])})")
    lines += [f"- cell {d['cell']}: the saved output differs from the re-run ({_md(d['what'])})"
              for d in execution["differs"]]
    lines += [f"- **stopped by the sandbox:** {_md(i)}" for i in execution["incidents"]]
    if lines[-1] != "":
        lines.append("")
    if execution["tests"]:
        lines += ["| Hidden test | Points | Result |", "|---|---:|---|"]
        for t in execution["tests"]:
            result = {"passed": "passed", "failed": "**failed**", "not_run": "not run"}.get(t["status"], t["status"])
            lines.append(f"| {_md(t['title'])} | {_n(t['points'])} | {result}"
                         + (f": {_md(t['message'])}" if t["message"] else "") + " |")
        lines.append("")
    return lines


# -- a batch -------------------------------------------------------------------------------------

def criterion_ids(results: list[dict]) -> list[str]:
    ids: list[str] = []
    for r in results:
        for c in r["criteria"]:
            if c["id"] not in ids:
                ids.append(c["id"])
    return ids


def gradebook_rows(results: list[dict]) -> list[dict]:
    ids = criterion_ids(results)
    rows = []
    for r in results:
        scores = {c["id"]: c["score"] for c in r["criteria"]}
        row = {"submission": r["submission"]["name"], "status": r["status"], "total": r["total"],
               "max_points": r["max_points"], "percent": r["percent"], "needs_review": r["needs_review"]}
        row.update({cid: scores.get(cid) for cid in ids})
        row.update({"review_reasons": " | ".join(r["review_reasons"]),
                    "prefill_time": r["inference"]["prefill_time"], "decode_time": r["inference"]["decode_time"],
                    "request_time": r["inference"]["request_time"], "wall_time": r["inference"]["wall_time"],
                    "overlap": r["inference"]["overlap"],
                    "file": r["submission"]["file"]})
        rows.append(row)
    return rows


def gradebook_csv(results: list[dict]) -> str:
    rows = gradebook_rows(results)
    buffer = io.StringIO()
    if rows:
        writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return buffer.getvalue()


def run_inference(graded_now: list[dict], wall_time: float | None) -> dict:
    """The requests of the notebooks graded in one run, against that run's wall time: their prefill and
    decode time, their own times summed (``request_time``), and ``overlap`` = request time / wall time,
    the mean number of requests in flight (``client.overlap_figures``)."""
    request_time = sum(r["inference"]["request_time"] or 0.0 for r in graded_now)
    return {
        "requests": sum(len(r["inference"]["requests"]) for r in graded_now),
        "prefill_time": round(sum(r["inference"]["prefill_time"] for r in graded_now), 3),
        "decode_time": round(sum(r["inference"]["decode_time"] for r in graded_now), 3),
        **overlap_figures(request_time, wall_time or 0.0),
        "fallbacks": sum(r["inference"]["fallbacks"] for r in graded_now),
    }


def summarize(results: list[dict], run: dict | None = None, graded_now: list[dict] | None = None) -> dict:
    """Mean and spread of the totals, who needs review; ``run`` (this run's clock figures, from
    ``batch.grade_batch``) and ``inference``: the requests of the notebooks graded in this run
    (``graded_now``; default all) against its wall time. Each notebook's own figures stay in its result."""
    totals = [r["total"] for r in results if r["total"] is not None]
    percents = [r["percent"] for r in results if r["percent"] is not None]
    graded_now = results if graded_now is None else graded_now
    inf = run_inference(graded_now, (run or {}).get("wall_time_s"))
    if run:
        run = {**run, "request_time_s": inf["request_time"], "requests_in_flight": inf["overlap"],
               "fallbacks": inf["fallbacks"]}
    return {
        "submissions": len(results),
        "graded": len(totals),
        "resumed": (run or {}).get("kept", 0),
        "by_status": {s: sum(1 for r in results if r["status"] == s)
                      for s in sorted({r["status"] for r in results})},
        "max_points": results[0]["max_points"] if results else None,
        "mean": round(statistics.fmean(totals), 2) if totals else None,
        "median": round(statistics.median(totals), 2) if totals else None,
        "stdev": round(statistics.stdev(totals), 2) if len(totals) > 1 else (0.0 if totals else None),
        "min": min(totals) if totals else None,
        "max": max(totals) if totals else None,
        "mean_percent": round(statistics.fmean(percents), 1) if percents else None,
        "flagged": [{"submission": r["submission"]["name"], "status": r["status"], "reasons": r["review_reasons"]}
                    for r in results if r["needs_review"]],
        "run": run or {},
        "inference": inf,
        "execution": execution_summary(results),
    }


def execution_summary(results: list[dict]) -> dict:
    """The re-runs of the class: how many ran, ran top to bottom, had something stopped; their time."""
    runs = [r["layers"]["execution"] for r in results if r.get("layers", {}).get("execution")]
    ran = [e for e in runs if e["status"] == "ran"]
    return {"re_run": len(ran), "not_re_run": len(runs) - len(ran),
            "top_to_bottom": sum(1 for e in ran if e["top_to_bottom"]),
            "contained": sum(1 for e in ran if e["incidents"]),
            "seconds": round(sum(e["seconds"] or 0.0 for e in ran), 3)}


def run_lines(run: dict, inf: dict) -> list[str]:
    """This run in words: when, how long, how fast, and what the cluster did."""
    if not run:
        return []
    lines = [f"- this run: {run['graded']} graded, {run['kept']} kept from an earlier run"
             + (f", {run['not_graded']} not graded (stopped; run again to continue)" if run.get("stopped") else "")
             + f"; {_n(run['wall_time_s'], 1)} s from {run['started_at']} to {run['ended_at']}"
             + (f" ({_n(run['notebooks_per_minute'], 2)} notebooks per minute, --jobs {run['jobs']})"
                if run.get("notebooks_per_minute") else "")]
    if inf["requests"]:
        lines.append(f"- its requests: {inf['requests']}, prefill {_n(inf['prefill_time'], 2)} s, decode "
                     f"{_n(inf['decode_time'], 2)} s; {describe_overlap(inf)}"
                     + (f"; {inf['fallbacks']} decode-only fallbacks" if inf["fallbacks"] else ""))
    for event in run.get("servers_marked_down") or []:
        lines.append(f"- server {event['server']} marked down at {event['at_s']} s: {event['error']}"
                     + (f" (up again at {event['up_again_at_s']} s)" if event.get("up_again_at_s") is not None else ""))
    return lines


def execution_summary_lines(ex: dict | None) -> list[str]:
    if not ex or not (ex["re_run"] or ex["not_re_run"]):
        return []
    return [f"- re-run in the sandbox: {ex['re_run']} notebooks ({ex['top_to_bottom']} top to bottom, "
            f"{ex['contained']} with something stopped by the sandbox; {_n(ex['seconds'], 1)} s of re-runs)"
            + (f", {ex['not_re_run']} not re-run" if ex["not_re_run"] else "")]


def render_summary_markdown(summary: dict, results: list[dict]) -> str:
    inf = summary["inference"]
    lines = ["# Grading summary", "",
             f"{summary['submissions']} submissions, {summary['graded']} with a score"
             + (f" ({summary['resumed']} from an earlier run)" if summary["resumed"] else "") + ".", "",
             f"- mean {_n(summary['mean'])} / {_n(summary['max_points'])} ({_n(summary['mean_percent'], 1)}%), "
             f"median {_n(summary['median'])}, standard deviation {_n(summary['stdev'])}, "
             f"range {_n(summary['min'])} to {_n(summary['max'])}",
             "- by status: " + ", ".join(f"{k} {v}" for k, v in summary["by_status"].items()),
             *run_lines(summary.get("run") or {}, inf), *execution_summary_lines(summary.get("execution")), ""]
    if summary["flagged"]:
        lines += ["## Needs human review", ""]
        for f in summary["flagged"]:
            lines.append(f"- **{f['submission']}** ({f['status']}): " + "; ".join(f["reasons"]))
        lines.append("")
    lines += ["## Gradebook", "", "| Submission | Status | Score | % | Re-run |", "|---|---|---:|---:|---|"]
    for r in results:
        lines.append(f"| {r['submission']['name']} | {r['status']} | {_n(r['total'])} | {_n(r['percent'], 1)} | "
                     f"{_md(rerun_verdict(r))} |")
    return "\n".join(lines) + "\n"


def write_batch_reports(results: list[dict], out_dir, run: dict | None = None,
                        graded_now: list[dict] | None = None) -> dict:
    """``gradebook.csv``, ``summary.json`` and ``summary.md`` in ``out_dir`` (each written whole or not at
    all); returns the summary (``summarize``)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(results, run, graded_now)
    write_atomically(out_dir / "gradebook.csv", gradebook_csv(results))
    write_atomically(out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    write_atomically(out_dir / "summary.md", render_summary_markdown(summary, results))
    return summary
