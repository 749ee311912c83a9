"""Grading a class: a generated class of notebooks on one embedded cluster, at several ``--jobs``.

    .venv/bin/python benchmarks/grading.py --json                   # 30 notebooks, --jobs 4, 8, 2: hours here
    .venv/bin/python benchmarks/grading.py --quick --json           # 4 notebooks on tiny models, --jobs 2, 4, 1
    .venv/bin/python benchmarks/grading.py --json --jobs 1 2 4 8 --count 40
    .venv/bin/python benchmarks/grading.py --json --jobs 4 --execute on off  # the cost of the re-runs

The class is ``grading/classgen.py``'s (the calibration set, varied; the same every run). The
embedded cluster of ``--config`` (both models, its slots) is started once and warmed; then the
class is graded into a fresh folder once per ``--jobs`` value, as ``business_analytics_grader_v2.py``
grades it (``grade_batch``, paced to the cluster): by default at the grader's default ``--jobs``,
at twice it and at half it (the embedded cluster: 4, 8, 2). Per run (also on stderr as it ends):
the notebooks per minute, the wall time, the requests in flight (their own time over the wall
time), the servers the client marked down and the decode-only fallbacks, the statuses, and what
the servers saw: the most requests queued for a slot on any server (``/health`` polled every
0.5 s) and the decode servers' time spent waiting for a slot (``disagg_queue_seconds``).
``--execute`` says whether each notebook is also re-run in the sandbox (grading/sandbox.py), as
the command-line grader does by default (``on``, the default here too; ``off``: graded from the
saved outputs); given ``on off``, every ``--jobs`` value runs once each way, in that order, and the
JSON's ``execution_cost`` gives each pair's wall times and their ratio. A run with execution on
records the class's re-runs (``execution``: how many ran, top to bottom, contained, and the sum
of their seconds, which overlap the model requests). ``default_jobs`` is what the grader uses
when ``--jobs`` is not given, and ``default_vs_best`` its notebooks per minute over the best run's.

``--quick`` runs the same on a cluster of generated tiny models (random weights, tests/tiny_models.py;
answers cut at 48 tokens): real servers, real pacing and deadlines, answers that mean nothing (the
JSON says so), in about a minute. Figures on a machine shared with other work are noisy: say so
where they are recorded.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import quick  # noqa: E402
from disaggregated_inference import config as cluster_config  # noqa: E402
from disaggregated_inference.grading.batch import StderrProgress, grade_batch  # noqa: E402
from disaggregated_inference.grading.classgen import generate_class  # noqa: E402
from disaggregated_inference.grading.connect import default_jobs, open_client  # noqa: E402
from disaggregated_inference.grading.options import GradingOptions  # noqa: E402
from disaggregated_inference.grading.rubric import load_rubric  # noqa: E402

QUICK_PARALLEL = 2  # slots per server of the quick cluster: --jobs 4 is more than them
QUICK_TOKENS = 48  # the tiny models' answers are cut there (and retried): what they say is not the point
QUEUE_SECONDS = re.compile(r"^disagg_queue_seconds_sum (\S+)$", re.M)


class ServerSampler:
    """Polls every server's ``/health`` while a run lasts: the most requests queued for a slot and busy."""

    def __init__(self, urls: dict[str, str], interval: float = 0.5):
        self.urls, self.interval = urls, interval
        self.most_queued = {name: 0 for name in urls}
        self.most_busy = {name: 0 for name in urls}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with requests.Session() as http:
            while not self._stop.wait(self.interval):
                for name, url in self.urls.items():
                    try:
                        slots = http.get(url + "/health", timeout=5).json().get("slots") or {}
                    except (requests.RequestException, ValueError):
                        continue
                    self.most_queued[name] = max(self.most_queued[name], int(slots.get("queued") or 0))
                    self.most_busy[name] = max(self.most_busy[name], int(slots.get("busy") or 0))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def queue_seconds(urls: dict[str, str]) -> float:
    """Seconds the decode servers' requests have waited for a slot so far (their ``/metrics``)."""
    total = 0.0
    for url in urls.values():
        try:
            found = QUEUE_SECONDS.search(requests.get(url + "/metrics", timeout=5).text)
        except requests.RequestException:
            continue
        total += float(found.group(1)) if found else 0.0
    return total


def run_once(target: Path, rubric, client, options, jobs: int, urls: dict[str, str]) -> dict:
    """Grade the class once at ``jobs`` (into a fresh folder) and say what it took."""
    decode_urls = {name: url for name, url in urls.items() if "decode" in name}
    queued_before = queue_seconds(decode_urls)
    with tempfile.TemporaryDirectory(prefix="grading-bench-") as out, ServerSampler(urls) as sampler:
        clock = time.monotonic()
        batch = grade_batch(target, rubric, client, out, options, force=True, jobs=jobs,
                            progress=StderrProgress())  # a line per notebook on stderr
        clock = time.monotonic() - clock
    run, inf = batch.summary["run"], batch.summary["inference"]
    statuses: dict[str, int] = {}
    for r in batch.results:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    return {
        "jobs": jobs, "execute": options.execute, "execution": batch.summary.get("execution"),
        "notebooks": len(batch.results), "wall_s": run["wall_time_s"], "clock_s": round(clock, 2),
        "notebooks_per_minute": run["notebooks_per_minute"], "requests": inf["requests"],
        "requests_in_flight": run["requests_in_flight"], "servers_marked_down": len(run["servers_marked_down"]),
        "marked_down": run["servers_marked_down"], "fallbacks": run["fallbacks"], "statuses": statuses,
        "errors": sorted({q["error"] for r in batch.results for q in r["inference"]["requests"] if q["error"]}),
        "most_queued_on_a_server": max(sampler.most_queued.values(), default=0),
        "most_busy": sampler.most_busy,
        "decode_queue_s": round(queue_seconds(decode_urls) - queued_before, 3),
        "pace": run["pace"],
        "paced_wait_s": round(sum(a["metrics"].get("paced_wait") or 0.0 for r in batch.results
                                  for a in r["layers"].get("analysis", {}).get("answers", [])), 1),
        "scores": {r["submission"]["name"]: r.get("total") for r in batch.results},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print every run (default: without the scores)")
    quick.add_argument(parser)  # 4 notebooks on generated tiny models, answers cut at QUICK_TOKENS
    parser.add_argument("--count", type=int, help="notebooks in the class (default 30; --quick: 4)")
    parser.add_argument("--jobs", type=int, nargs="+",
                        help="--jobs values to run (default: half the grader's default, it, twice it; --quick: 1 "
                             "instead of the half)")
    parser.add_argument("--rubric", default=str(ROOT / "examples" / "rubric.yaml"))
    parser.add_argument("--config", default=str(ROOT / "config_current.json"))
    parser.add_argument("--execute", nargs="+", choices=("on", "off"), default=["on"],
                        help="re-run each notebook in the sandbox (on, as the grader's default) or grade from the "
                             "saved outputs (off); 'on off' runs each --jobs value both ways (default: on)")
    parser.add_argument("--autogroup-nice", type=int,
                        help="Linux: niceness of this run's sessions (see throughput.prioritise)")
    args = quick.apply(parser, parser.parse_args(argv))  # OpenMP threads that sleep at barriers under --quick
    import psutil
    import throughput

    throughput.AUTOGROUP_NICE = args.autogroup_nice
    throughput.prioritise()
    count = args.count or (4 if args.quick else 30)

    say = quick.say
    rubric = load_rubric(args.rubric)
    if args.quick:
        from tests.tiny_models import tiny_cluster_config

        cfg = cluster_config.from_dict(tiny_cluster_config(QUICK_PARALLEL), "tiny models (grading.py --quick)")
    else:
        cfg = cluster_config.load(args.config)
    runs = []
    with tempfile.TemporaryDirectory(prefix="grading-class-") as folder:
        generate_class(folder, count)
        started = time.monotonic()
        with open_client(cfg, local_cluster=True, progress=lambda name, message: say(f"  [{name}] {message}")) \
                as client:
            say(f"cluster ready in {time.monotonic() - started:.0f} s")
            for server in psutil.Process().children():
                throughput.prioritise(server.pid)
            options = GradingOptions.for_cluster(client.config, **(
                {"code_max_tokens": QUICK_TOKENS, "feedback_max_tokens": QUICK_TOKENS} if args.quick else {}))
            urls = {s["name"]: s["url"] for s in client.status()}
            say("warming up both models ...")
            for model in ("qwen", "gpt-oss"):
                client.generate(model=model, prompt="Say hello.", max_tokens=4)
            chosen = default_jobs(client)
            around = [chosen, 2 * chosen, 1 if args.quick else max(1, chosen // 2)]  # the default first
            if "on" in args.execute:
                from disaggregated_inference.grading.sandbox import find_sandbox

                sandbox, why_not = find_sandbox()
                say("sandbox: bubblewrap works here: every notebook is re-run" if sandbox else why_not)
            for jobs, execute in [(j, e) for j in args.jobs or list(dict.fromkeys(around))
                                  for e in dict.fromkeys(args.execute)]:
                row = run_once(Path(folder), rubric, client, replace(options, execute=execute == "on"), jobs, urls)
                say(f"--jobs {jobs} --execute {execute}: {row['notebooks']} notebooks in {row['wall_s']} s "
                    f"({row['notebooks_per_minute']} per minute), {row['servers_marked_down']} servers marked down, "
                    f"{row['fallbacks']} fallbacks\n{json.dumps(row)}")
                runs.append(row)
    pairs = {}
    for r in runs:
        pairs.setdefault(r["jobs"], {})["on" if r["execute"] else "off"] = r["wall_s"]
    cost = [{"jobs": j, "wall_s_on": p["on"], "wall_s_off": p["off"],
             "on_over_off": round(p["on"] / p["off"], 3) if p["off"] else None}
            for j, p in pairs.items() if "on" in p and "off" in p]
    best = max(runs, key=lambda r: r["notebooks_per_minute"] or 0)
    default_run = next((r for r in runs if r["jobs"] == chosen), None)
    result = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "models": (f"generated tiny models, random weights, answers cut at {QUICK_TOKENS} tokens: the answers "
                   "are meaningless, the servers, pacing and deadlines are real" if args.quick else
                   f"{cfg.source}: " + ", ".join(f"{k}={v.get('model')}" for k, v in cfg.models.items())),
        "class": f"{count} notebooks generated from examples/calibration (grading/classgen.py)",
        "default_jobs": chosen,
        "best_jobs": best["jobs"],
        "default_vs_best": (round(default_run["notebooks_per_minute"] / best["notebooks_per_minute"], 3)
                            if default_run and best["notebooks_per_minute"] else None),
        "execution_cost": cost,
        "runs": runs if args.json else [{k: v for k, v in r.items() if k not in ("scores", "marked_down")}
                                        for r in runs],
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
