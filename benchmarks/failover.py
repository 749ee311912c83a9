"""Benchmark: error rate under sustained load, and how fast the client routes around a dead server.

On a local cluster of its own (two SmolLM2 prefill servers, one decode server):

1. ``sustained``: ``--seconds`` of requests from ``--threads`` threads with no
   fault injected; reports requests, errors and the error rate (target < 0.1%);
2. ``hang_prefill``: a prefill server is frozen (SIGSTOP: a hung machine that keeps its
   connections open) while requests flow, then thawed; reports the slowest request that
   straddled the freeze (the client gives a silent server up after ``progress_timeout``), the
   time to the first answer through the other prefill server, and the time from the thaw to
   the first answer through the thawed one again (no restart: the client probes it);
   ``hang_decode``: the same with the only decode server: the time from the freeze to the first
   request that fails (no decode server left), and from the thaw to the first answer;
3. ``failover``: a prefill server is killed (SIGKILL) while requests flow;
   reports the time from the kill to the first request answered through the
   other prefill server, and the slowest request that straddled the kill
   (target < 5 s);
4. ``fallback``: the last prefill server is killed; reports the time to the
   first answer served decode-only.

The load is ``disagg bench``'s (``BackgroundLoad`` of disaggregated_inference/bench/load.py: streamed requests
through the client, each timed by bench/measure.py), around the faults injected here.

    .venv/bin/python benchmarks/failover.py --json
    .venv/bin/python benchmarks/failover.py --quick --json   # seconds: tiny model, 3 s of load, short windows
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import quick  # noqa: E402
from disaggregated_inference.bench.endpoints import ClientEndpoint  # noqa: E402
from disaggregated_inference.bench.load import BackgroundLoad  # noqa: E402
from disaggregated_inference.bench.workloads import BenchRequest, Unit  # noqa: E402
from disaggregated_inference.client import DisaggregatedClient, FallbackWarning  # noqa: E402
from disaggregated_inference.ops.cluster import LocalCluster  # noqa: E402
from tests.faults import freeze, thaw  # noqa: E402


def cluster_config(threads: int, tiny: bool = False, progress_timeout: float = 5.0) -> dict:
    data = json.loads((ROOT / "config_current.json").read_text())
    qwen = data["models"]["qwen"]
    qwen["n_threads"] = threads
    if tiny:
        qwen["model"] = quick.tiny_model()
    return {
        "models": {"qwen": qwen},
        "prefill_servers": [{"name": n, "host": "127.0.0.1", "port": 1, "model": "qwen"} for n in ("pa", "pb")],
        "decode_servers": [{"name": "da", "host": "127.0.0.1", "port": 1, "model": "qwen"}],
        "client": {"health_check_interval": 1, "failures_before_down": 1, "connect_timeout": 1,
                   "progress_timeout": progress_timeout},
    }


def _requests():
    """Requests of two tokens, each with its own prompt, for as long as the load runs."""
    i = 0
    while True:
        yield Unit((BenchRequest(i, "qwen", {"model": "qwen", "prompt": f"Request {i}: say OK.", "max_tokens": 2}),))
        i += 1


class Load(BackgroundLoad):
    """The bench's load (disaggregated_inference/bench/load.py) through this client from several threads until
    the ``with`` block ends (a sender pauses after a failure); every outcome recorded with its times."""

    def __init__(self, client, threads: int):
        super().__init__(ClientEndpoint(client=client), _requests(), threads, stage="failover")

    def __enter__(self):
        self._quiet = warnings.catch_warnings()  # the fallbacks are what is measured: no warning for each
        self._quiet.__enter__()
        warnings.simplefilter("ignore", FallbackWarning)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            super().__exit__(*exc)
        finally:
            self._quiet.__exit__(*exc)

    @property
    def outcomes(self) -> list:
        """(start, end, ok, method, prefill_server, error) of every request answered or failed."""
        return [(s.sent_at, s.finished, s.ok, s.timing.metrics.get("method"), s.timing.metrics.get("prefill_server"),
                 s.timing.error) for s in self.samples]


def load_of(client, threads: int) -> Load:
    return Load(client, threads)


def hang(load: Load, proc, seconds: float, through, back) -> dict:
    """Freeze ``proc`` for ``seconds`` under ``load``, then thaw it and keep the load on for ``seconds``
    more: the slowest request across the freeze, the first answer ``through`` another server after
    it (None: the first request that failed, the time to notice), the first answer ``back`` after
    the thaw."""
    with load:
        time.sleep(1)
        frozen_at = time.perf_counter()
        freeze(proc)
        try:
            time.sleep(seconds)
        finally:
            thaw(proc)
        thawed_at = time.perf_counter()
        time.sleep(seconds)
    rows = load.outcomes
    straddling = [r for r in rows if r[0] < frozen_at < r[1]]
    during = [r for r in rows if frozen_at < r[1] <= thawed_at]
    if through is None:
        first = min((r[1] for r in during if not r[2]), default=None)
        key = "time_to_first_failure_s"
    else:
        first = min((r[1] for r in during if r[2] and through(r) and r[0] >= frozen_at), default=None)
        key = "time_to_first_answer_via_other_server_s"
    back_at = min((r[1] for r in rows if r[2] and r[0] >= thawed_at and back(r)), default=None)
    return {
        "frozen_s": seconds,
        "slowest_request_across_the_freeze_s": round(max((r[1] - r[0] for r in straddling), default=0.0), 3),
        key: None if first is None else round(first - frozen_at, 3),
        "time_from_thaw_to_first_answer_through_it_s": None if back_at is None else round(back_at - thawed_at, 3),
        "errors_while_frozen": sum(1 for r in during if not r[2]),
        "requests_while_frozen": len(during),
        "errors_after_thaw": sum(1 for r in rows if r[0] >= thawed_at and not r[2]),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--seconds", type=float, default=60, help="length of the sustained run")
    parser.add_argument("--threads", type=int, default=4, help="client threads")
    parser.add_argument("--model-threads", type=int, default=1, help="llama.cpp threads per server")
    parser.add_argument("--after-kill", type=float, default=8,
                        help="seconds of load after each kill, and each freeze's length (more than --progress-timeout)")
    parser.add_argument("--progress-timeout", type=float, default=5.0,
                        help="the client's progress_timeout: silence after which a server is taken as hung")
    quick.add_argument(parser)
    args = parser.parse_args(argv)
    quick.apply(parser, args, seconds=3, after_kill=3, progress_timeout=2.0)

    out = {"quick": args.quick, "seconds_after_kill": args.after_kill, "client_threads": args.threads,
           "progress_timeout_s": args.progress_timeout}
    with LocalCluster(cluster_config(args.model_threads, args.quick, args.progress_timeout),
                      free_ports=True) as cluster:
        cluster.wait_healthy(timeout=300)
        quick.say(f"{args.seconds:g} s of sustained load ...")
        with DisaggregatedClient(cluster.config) as client:
            with Load(client, args.threads) as load:
                time.sleep(args.seconds)
            rows = load.outcomes
            errors = [r for r in rows if not r[2]]
            out["sustained"] = {"seconds": args.seconds, "requests": len(rows), "errors": len(errors),
                                "error_rate": len(errors) / max(1, len(rows)),
                                "requests_per_s": round(len(rows) / args.seconds, 2),
                                "first_errors": [r[5] for r in errors[:3]]}

            pa, pb, da = cluster.process("pa"), cluster.process("pb"), cluster.process("da")
            quick.say("freezing one prefill server under load ...")
            out["hang_prefill"] = hang(load_of(client, args.threads), pa, args.after_kill,
                                       through=lambda r: r[4] == pb.entry.address,
                                       back=lambda r: r[4] == pa.entry.address)
            quick.say("freezing the decode server under load ...")
            out["hang_decode"] = hang(load_of(client, args.threads), da, args.after_kill,
                                      through=None, back=lambda r: True)

            quick.say("killing one prefill server under load ...")
            with Load(client, args.threads) as load:
                time.sleep(2)
                killed_at = time.perf_counter()
                pa.kill()
                time.sleep(args.after_kill)
            survivor = pb.entry.address
            after = [r for r in load.outcomes if r[1] > killed_at]
            first_ok = min((r[1] for r in after if r[2] and r[4] == survivor and r[0] >= killed_at), default=None)
            straddling = [r for r in load.outcomes if r[0] < killed_at < r[1]]
            out["failover"] = {
                "time_to_first_answer_via_other_prefill_s": None if first_ok is None else round(first_ok - killed_at, 3),
                "slowest_request_across_the_kill_s": round(max((r[1] - r[0] for r in straddling), default=0.0), 3),
                "errors": sum(1 for r in after if not r[2]),
                "requests_after_kill": len(after),
            }

            quick.say("killing the other prefill server under load ...")
            with Load(client, args.threads) as load:
                time.sleep(1)
                killed_at = time.perf_counter()
                pb.kill()
                time.sleep(args.after_kill)
            after = [r for r in load.outcomes if r[1] > killed_at]
            first_fallback = min((r[1] for r in after if r[2] and r[3] == "decode_only_fallback"), default=None)
            out["fallback"] = {
                "time_to_first_decode_only_answer_s": None if first_fallback is None
                else round(first_fallback - killed_at, 3),
                "errors": sum(1 for r in after if not r[2]),
                "requests_after_kill": len(after),
            }
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
