"""Command line of the grader (``business_analytics_grader_v2.py``): parse arguments, call the package.

Ctrl-C (or SIGTERM, or SIGHUP) while grading stops the batch within seconds: no other notebook is
started, the requests in flight are cancelled, the local cluster is stopped, and a line says
what was graded; the same command continues. A second Ctrl-C exits at once (the local
cluster's servers are killed). Before grading has begun, Ctrl-C aborts.

Exit codes: 0 graded (flagged submissions included), 1 some submissions could
not be graded (the cluster did not answer) or another error, 2 a bad rubric,
config or argument, 130 stopped by Ctrl-C, SIGTERM or SIGHUP.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from contextlib import contextmanager

from .. import config as cluster_config
from ..client import describe_overlap
from ..errors import ConfigError, DisaggError, RubricError
from ..ops.lifetime import STOP_SIGNALS, guarded
from .batch import StderrProgress, grade_batch, pending
from .connect import default_jobs, hurry_local_clusters, kill_local_clusters, open_client
from .options import DEFAULT_SEED, GradingOptions
from .rubric import load_rubric
from .sandbox import find_sandbox


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="business_analytics_grader_v2.py",
        description="Grade business-analytics Jupyter notebooks against a rubric: deterministic checks, then a "
                    "code-analysis model and a feedback model in parallel on the disaggregated cluster.")
    p.add_argument("target", help="a notebook (.ipynb) or a folder of notebooks")
    p.add_argument("--rubric", required=True, help="rubric file (.yaml, .yml or .json)")
    p.add_argument("--out", default="grades", metavar="DIR",
                   help="where the per-submission JSON/Markdown, gradebook.csv and summary go (default: grades)")
    p.add_argument("--config", default=None,
                   help="cluster config file (default: $DISAGG_CONFIG or config_current.json)")
    p.add_argument("--local-cluster", action="store_true",
                   help="start the config's servers on this machine (free ports) for this run, stop them after")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the local cluster's models")
    p.add_argument("--force", action="store_true", help="grade again submissions already graded")
    p.add_argument("--code-model", default="qwen", help="model that analyses the code and scores (default: qwen)")
    p.add_argument("--code-speculation", choices=("ngram", "off"), default="ngram",
                   help="prompt-lookup speculation on the code model's answers (default: ngram; the server drafts "
                        "only where it pays)")
    p.add_argument("--feedback-model", default="gpt-oss", help="model that writes feedback (default: gpt-oss)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="sampling seed (temperature is 0)")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="notebooks graded at once (default: the decode slots of the model with the fewest, as the "
                        "cluster's /health reports them, else 2); the requests to each model are paced to its "
                        "servers whatever this is")
    p.add_argument("--execute", choices=("on", "off"), default="on",
                   help="re-run each notebook in a sandbox (bubblewrap: no network, its own folder only, limits on "
                        "time, memory and processes) and run the rubric's hidden tests (default: on where a sandbox "
                        "works here; without one the grader says so and grades from the saved outputs)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    return p


class Interrupts:
    """SIGINT, SIGTERM and SIGHUP: while grading, the first sets ``stop`` (the batch ends cleanly); before, it
    aborts (KeyboardInterrupt); the second exits at once, killing the local cluster's servers."""

    def __init__(self):
        self.stop = threading.Event()
        self.count = 0
        self.phase = "starting"  # then "grading", then "finishing"

    def __call__(self, signum, frame):
        self.count += 1
        if self.count > 1:
            _line("grader: stopped at once (second interrupt); the local cluster's servers are killed; notebooks "
                  "graded so far are kept, and the same command continues")
            kill_local_clusters()
            os._exit(130)
        if self.phase != "grading":
            raise KeyboardInterrupt
        self.stop.set()
        _line("grader: stopping: no other notebook is started and the requests in flight are cancelled "
              "(Ctrl-C again to quit at once)")

    @contextmanager
    def during_grading(self):
        self.phase = "grading"
        try:
            yield self.stop
        finally:
            self.phase = "finishing"

    @contextmanager
    def installed(self):
        # guarded: held back while a server of the local cluster is being started (ops/lifetime.py)
        previous = {sig: signal.signal(sig, guarded(self)) for sig in STOP_SIGNALS
                    if signal.getsignal(sig) is not signal.SIG_IGN}  # nohup's SIGHUP stays ignored
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


@contextmanager
def _level_kept(logger: logging.Logger):
    level = logger.level
    try:
        yield logger
    finally:
        logger.setLevel(level)


def _line(message: str) -> None:
    """A message on a line of its own, also when a progress line is being redrawn on the terminal."""
    start = "\n" if sys.stderr.isatty() else ""
    _say(start + message)


def run(args, interrupts: Interrupts | None = None) -> int:
    interrupts = interrupts or Interrupts()
    if args.jobs is not None and args.jobs < 1:
        raise ConfigError(f"--jobs must be at least 1, got {args.jobs}", field="jobs")
    rubric = load_rubric(args.rubric)  # a bad rubric fails before any server starts
    cfg = cluster_config.load(args.config)
    execute = args.execute == "on" and rubric.execution.enabled
    if execute:
        sandbox, why = find_sandbox()  # decided once; said once
        if sandbox is None:
            _say(f"grader: {why}")
    progress_bar = None if args.no_progress else StderrProgress()
    if not args.force and not pending(args.target, rubric, args.out):
        # everything is graded already: rebuild the reports without starting or asking any server
        return report(grade_batch(args.target, rubric, None, args.out, progress=progress_bar), args)
    if args.local_cluster:
        _say(f"starting the local cluster of {cfg.source} (free ports); loading models...")

    def progress(name, message):
        _say(f"  [{name}] {message}")

    with _level_kept(logging.getLogger("disaggregated_inference.client")) as client_log, \
            open_client(cfg, local_cluster=args.local_cluster, timeout=args.timeout, progress=progress,
                        models=(args.code_model, args.feedback_model)) as client:
        options = GradingOptions.for_cluster(client.config, code_model=args.code_model,
                                             feedback_model=args.feedback_model, seed=args.seed, execute=execute,
                                             code_speculation=None if args.code_speculation == "off" else args.code_speculation)
        jobs = args.jobs or default_jobs(client, (args.code_model, args.feedback_model))
        with interrupts.during_grading() as stop:
            batch = grade_batch(args.target, rubric, client, args.out, options, force=args.force,
                                progress=progress_bar, jobs=jobs, stop=stop)
        if batch.stopped:
            # a request the stop abandoned in its prefill fails as its server goes: not news any more
            client_log.setLevel(logging.ERROR)
            if args.local_cluster:
                _say("grader: stopping the local cluster...")
                hurry_local_clusters()
    return report(batch, args)


def report(batch, args) -> int:
    summary = batch.summary
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        inf, run = summary["inference"], summary["run"]
        print(f"{summary['submissions']} submissions ({len(batch.graded)} graded now, {len(batch.resumed)} kept from "
              f"an earlier run); mean {summary['mean']} / {summary['max_points']}, stdev {summary['stdev']}")
        for flag in summary["flagged"]:
            print(f"  needs review: {flag['submission']} ({flag['status']}): {'; '.join(flag['reasons'])}")
        if batch.graded:
            print(f"this run: {run['wall_time_s']:.1f} s, {run['notebooks_per_minute']:.2f} notebooks per minute "
                  f"(--jobs {run['jobs']}); prefill {inf['prefill_time']} s, decode {inf['decode_time']} s; "
                  f"{describe_overlap(inf)}")
        for event in run.get("servers_marked_down") or []:
            print(f"  server marked down: {event['server']} at {event['at_s']} s: {event['error']}")
        print(f"reports in {batch.out_dir}/ (gradebook.csv, summary.md, one .json and .md per submission)")
    if batch.stopped:
        _say("grader: " + batch.describe_stop())
        return 130
    return 1 if summary["by_status"].get("error") else 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    interrupts = Interrupts()
    with interrupts.installed():
        try:
            return run(args, interrupts)
        except (ConfigError, RubricError) as exc:
            _say(f"grader: {exc.message}")
            return 2
        except DisaggError as exc:
            _say(f"grader: {exc.message}")
            return 1
        except KeyboardInterrupt:
            kill_local_clusters()  # one whose stop was interrupted
            _line("grader: interrupted " + ("before grading began; nothing was graded" if interrupts.phase == "starting"
                                             else "after grading; the reports are written"))
            return 130
