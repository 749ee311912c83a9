"""Grading a folder of notebooks one at a time and several at a time, on one embedded cluster.

    .venv/bin/python benchmarks/grading.py --json                 # examples/notebooks, --jobs 1 then 4
    .venv/bin/python benchmarks/grading.py --json --autogroup-nice -20   # on a shared Linux machine, as root
    .venv/bin/python benchmarks/grading.py --quick --json         # two notebooks, --jobs 2, tiny model

Starts the embedded local cluster once (both models, the config's slots), warms both models, then
grades the same notebooks with ``jobs`` = 1 and ``jobs`` = N (``--jobs``), alternating
(``--rounds`` times each, 1, N, 1, N, ...), into fresh output folders, and prints per run the wall
time and the notebooks graded, and the ratio of the medians: ``jobs_1_s / jobs_N_s`` (the issue's
target on this machine: at least 2). Each run also reports the CPU seconds the servers and this
process used and the cores' busy share; ``jobs_1_over_jobs_N_ceiling`` is the ratio the work
measured at ``jobs`` N would give with every core busy (what this machine allows). It also says whether the two settings gave the same scores
(greedy decoding; under batching llama.cpp's CPU kernels are not batch-invariant, see
docs/benchmarks.md, so a score can differ - reported, not hidden).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import quick  # noqa: E402
from disaggregated_inference import config as cluster_config  # noqa: E402
from disaggregated_inference.grading.batch import grade_batch  # noqa: E402
from disaggregated_inference.grading.connect import decode_slots, open_client  # noqa: E402
from disaggregated_inference.grading.options import GradingOptions  # noqa: E402
from disaggregated_inference.grading.rubric import load_rubric  # noqa: E402


# --quick grades these two (one clean, one with errors), with both roles on the tiny model: the
# grades are meaningless, the batch's work (requests, scheduling, reports) is the real one
QUICK_NOTEBOOKS = ("good_sales_analysis.ipynb", "errors_sales_analysis.ipynb", "sales.csv")


def quick_setup(folder: Path) -> tuple[str, dict]:
    """(a target folder holding QUICK_NOTEBOOKS, the embedded config with every model on the tiny model)."""
    import shutil

    for name in QUICK_NOTEBOOKS:
        shutil.copy(ROOT / "examples" / "notebooks" / name, folder / name)
    data = json.loads((ROOT / "config_current.json").read_text())
    data = quick.on_tiny_model(data, keep=tuple(data["models"]))
    return str(folder), data


def run_once(target, rubric, client, options, jobs: int) -> dict:
    import psutil
    from throughput import cpu_clock  # the servers' CPU seconds

    servers = cpu_clock([p.pid for p in psutil.Process().children()])  # the embedded cluster's servers
    with tempfile.TemporaryDirectory(prefix="grading-bench-") as out:
        before, mine, started = servers(), time.process_time(), time.perf_counter()
        batch = grade_batch(target, rubric, client, out, options, force=True, jobs=jobs)
        wall = time.perf_counter() - started
        used = servers() - before + time.process_time() - mine
    scores = {r["submission"]["name"]: r.get("total") for r in batch.results if r}
    statuses = sorted({r["status"] for r in batch.results if r})
    return {"jobs": jobs, "wall_s": round(wall, 2), "notebooks": len(batch.results), "statuses": statuses,
            "cpu_s": round(used, 1), "cores_busy": round(used / (wall * (os.cpu_count() or 1)), 3),
            "scores": scores}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--target", default=str(ROOT / "examples" / "notebooks"))
    parser.add_argument("--rubric", default=str(ROOT / "examples" / "rubric.yaml"))
    parser.add_argument("--config", default=str(ROOT / "config_current.json"))
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--autogroup-nice", type=int,
                        help="Linux: niceness of this run's sessions (see throughput.prioritise)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="both models' answer budget (default: the grader's own, GradingOptions)")
    quick.add_argument(parser)
    args = parser.parse_args(argv)
    quick.apply(parser, args, jobs=2, max_tokens=64)
    import psutil
    import throughput

    throughput.AUTOGROUP_NICE = args.autogroup_nice
    throughput.prioritise()

    say = quick.say
    rubric = load_rubric(args.rubric)
    scratch = tempfile.TemporaryDirectory(prefix="grading-quick-") if args.quick else None
    if scratch:
        args.target, data = quick_setup(Path(scratch.name))
        cfg = cluster_config.coerce(data)
    else:
        cfg = cluster_config.load(args.config)
    runs = []
    with open_client(cfg, local_cluster=True, progress=lambda name, message: say(f"  [{name}] {message}")) as client:
        for server in psutil.Process().children():
            throughput.prioritise(server.pid)
        budget = {"code_max_tokens": args.max_tokens, "feedback_max_tokens": args.max_tokens} if args.max_tokens else {}
        options = GradingOptions.for_cluster(client.config, **budget)
        slots = decode_slots(client)
        say("warming up both models ...")
        for model in ("qwen", "gpt-oss"):
            client.generate(model=model, prompt="Say hello.", max_tokens=4)
        for r in range(args.rounds):
            for jobs in (1, args.jobs):
                row = run_once(args.target, rubric, client, options, jobs)
                say(f"round {r + 1}, --jobs {jobs}: {row['wall_s']} s for {row['notebooks']} notebooks")
                runs.append(row)
    one = statistics.median(r["wall_s"] for r in runs if r["jobs"] == 1)
    many = statistics.median(r["wall_s"] for r in runs if r["jobs"] == args.jobs)
    first = {r["jobs"]: r["scores"] for r in runs[:2]}
    differing = sorted(name for name in first.get(1, {}) if first[1][name] != first.get(args.jobs, {}).get(name))
    cpu_many = statistics.median(r["cpu_s"] for r in runs if r["jobs"] == args.jobs)
    result = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        # --jobs 1's wall time over the shortest --jobs N could take with the CPU work it measured
        # done on every core at once: the 2x target is out of reach where this is below 2
        f"jobs_1_over_jobs_{args.jobs}_ceiling": round(one / (cpu_many / (os.cpu_count() or 1)), 3),
        "target": "two example notebooks (--quick)" if args.quick else os.path.relpath(args.target, ROOT),
        "quick": args.quick, "max_tokens": {"code": options.code_max_tokens, "feedback": options.feedback_max_tokens},
        "decode_slots": slots, "runs": runs,
        f"jobs_1_over_jobs_{args.jobs}": round(one / many, 3) if many else None,
        "scores_differing_between_settings": differing,
    }
    print(json.dumps(result, indent=2) if args.json else json.dumps({k: v for k, v in result.items() if k != "runs"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
