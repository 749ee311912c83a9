"""Benchmark: error rate under sustained load, and how fast the client routes around a dead server.

On a local cluster of its own (two SmolLM2 prefill servers, one decode server):

1. ``sustained``: ``--seconds`` of requests from ``--threads`` threads with no
   fault injected; reports requests, errors and the error rate (target < 0.1%);
2. ``failover``: a prefill server is killed (SIGKILL) while requests flow;
   reports the time from the kill to the first request answered through the
   other prefill server, and the slowest request that straddled the kill
   (target < 5 s);
3. ``fallback``: the last prefill server is killed; reports the time to the
   first answer served decode-only.

    .venv/bin/python benchmarks/failover.py --json
    .venv/bin/python benchmarks/failover.py --quick --json   # seconds: tiny model, 3 s of load, short windows
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import quick  # noqa: E402
from disaggregated_inference.client import DisaggregatedClient, FallbackWarning  # noqa: E402
from disaggregated_inference.ops.cluster import LocalCluster  # noqa: E402


def cluster_config(threads: int, tiny: bool = False) -> dict:
    data = json.loads((ROOT / "config_current.json").read_text())
    qwen = data["models"]["qwen"]
    qwen["n_threads"] = threads
    if tiny:
        qwen["model"] = quick.tiny_model()
    return {
        "models": {"qwen": qwen},
        "prefill_servers": [{"name": n, "host": "127.0.0.1", "port": 1, "model": "qwen"} for n in ("pa", "pb")],
        "decode_servers": [{"name": "da", "host": "127.0.0.1", "port": 1, "model": "qwen"}],
        "client": {"health_check_interval": 1, "failures_before_down": 1, "connect_timeout": 1},
    }


class Load:
    """Requests from several threads until stopped; every outcome recorded with its time."""

    def __init__(self, client, threads: int):
        self.client, self.n = client, threads
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.outcomes = []  # (start, end, ok, method, prefill_server, error)

    def _worker(self, k: int):
        i = 0
        while not self.stop.is_set():
            started = time.perf_counter()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FallbackWarning)
                    _, m = self.client.generate(model="qwen", prompt=f"Worker {k} request {i}: say OK.", max_tokens=2)
                row = (started, time.perf_counter(), True, m["method"], m["prefill_server"], None)
            except Exception as exc:  # counted, never lost
                row = (started, time.perf_counter(), False, None, None, f"{type(exc).__name__}: {exc}")
            with self.lock:
                self.outcomes.append(row)
            i += 1

    def __enter__(self):
        self.threads = [threading.Thread(target=self._worker, args=(k,)) for k in range(self.n)]
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--seconds", type=float, default=60, help="length of the sustained run")
    parser.add_argument("--threads", type=int, default=4, help="client threads")
    parser.add_argument("--model-threads", type=int, default=1, help="llama.cpp threads per server")
    parser.add_argument("--after-kill", type=float, default=6, help="seconds of load after each kill")
    quick.add_argument(parser)
    args = parser.parse_args(argv)
    quick.apply(parser, args, seconds=3, after_kill=3)

    out = {"quick": args.quick, "seconds_after_kill": args.after_kill, "client_threads": args.threads}
    with LocalCluster(cluster_config(args.model_threads, args.quick), free_ports=True) as cluster:
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

            pa, pb = cluster.process("pa"), cluster.process("pb")
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
