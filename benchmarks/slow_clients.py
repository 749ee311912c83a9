"""Benchmark: what slow clients cost a server, under gunicorn's ``gthread`` worker and under ours.

A decode server of the tiny model is started per worker class (``DISAGG_WORKER_CLASS``:
``gthread``, gunicorn's own, and the default ``BufferedThreadWorker``, server/worker.py, which reads
a request's head and body on its poller before it gives the request a thread), both at once:

1. ``idle``: the latency of ``GET /health`` and of a short ``POST /generate`` (2 tokens) with
   no slow client, the two servers taking turns: what the buffering costs a normal request;
2. ``slow``: for each in turn, the same while ``--connections`` clients each send their request headers one byte
   every ``--gap`` seconds (slowloris); a probe that gets no answer within ``--probe-timeout``
   counts as a timeout; and how long after they started the server closed the slow connections.

    .venv/bin/python benchmarks/slow_clients.py --json
    .venv/bin/python benchmarks/slow_clients.py --quick --json   # seconds: fewer connections and probes
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import quick  # noqa: E402
from disaggregated_inference.ops.cluster import LocalCluster  # noqa: E402
from tests.faults import SlowClients  # noqa: E402

WORKERS = {"gthread": "gthread", "buffered": "disaggregated_inference.server.worker.BufferedThreadWorker"}


def cluster_config(header_timeout: float) -> dict:
    data = json.loads((ROOT / "config_current.json").read_text())
    data = quick.on_tiny_model(data)
    data["models"]["qwen"]["n_threads"] = 1
    data["prefill_servers"] = []
    data["decode_servers"] = [{"name": "d", "host": "127.0.0.1", "port": 1, "model": "qwen"}]
    data["client"]["health_check_interval"] = 0
    data["server"]["header_timeout"] = header_timeout
    return data


def probe(urls: list, n: int, timeout: float) -> list[dict]:
    """``n`` rounds of GET /health and a 2-token POST /generate on each server of ``urls``, taking turns
    (so that servers measured together see the same load): per server, latencies and failures."""
    seen = [{"health": [], "generate": [], "failed": 0} for _ in urls]
    for _ in range(n):
        for url, row in zip(urls, seen):
            for kind, send in (("health", lambda: requests.get(url + "/health", timeout=timeout)),
                               ("generate", lambda: requests.post(url + "/generate", timeout=timeout,
                                                                  json={"prompt": "Hi", "max_new_tokens": 2}))):
                started = time.perf_counter()
                try:
                    ok = send().status_code == 200
                except requests.RequestException:
                    ok = False
                if ok:
                    row[kind].append(time.perf_counter() - started)
                else:
                    row["failed"] += 1

    def summary(xs):
        return {"answered": len(xs), "p50_ms": round(statistics.median(xs) * 1000, 2) if xs else None,
                "max_ms": round(max(xs) * 1000, 2) if xs else None}
    return [{"health": summary(r["health"]), "generate": summary(r["generate"]), "failed_or_timed_out": r["failed"]}
            for r in seen]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--connections", type=int, default=200, help="slow connections")
    parser.add_argument("--gap", type=float, default=1.0, help="seconds between a slow client's bytes")
    parser.add_argument("--probes", type=int, default=10, help="rounds of /health + /generate beside slow clients")
    parser.add_argument("--idle-probes", type=int, default=50, help="rounds of them without slow clients")
    parser.add_argument("--probe-timeout", type=float, default=3.0, help="seconds a probe waits for its answer")
    parser.add_argument("--header-timeout", type=float, default=10.0, help="the servers' server.header_timeout")
    quick.add_argument(parser)
    args = parser.parse_args(argv)
    quick.apply(parser, args, connections=60, probes=4, idle_probes=4, probe_timeout=2.0, header_timeout=4.0)

    out = {"quick": args.quick, "connections": args.connections, "gap_s": args.gap,
           "header_timeout_s": args.header_timeout, "workers": {}}
    with contextlib.ExitStack() as stack:
        urls = {}
        for name, worker in WORKERS.items():
            quick.say(f"{name}: starting a decode server ...")
            cluster = stack.enter_context(LocalCluster(cluster_config(args.header_timeout), free_ports=True,
                                                       env={"DISAGG_WORKER_CLASS": worker}))
            cluster.wait_healthy(timeout=300)
            urls[name] = cluster.process("d").url
        quick.say("both servers without slow clients, taking turns ...")
        for name, idle in zip(urls, probe(list(urls.values()), args.idle_probes, args.probe_timeout)):
            out["workers"][name] = {"idle": idle}
        for name, url in urls.items():
            quick.say(f"{name}: {args.connections} slow connections ...")
            host, port = url.removeprefix("http://").split(":")
            with SlowClients((host, int(port)), args.connections, args.gap) as slow:
                time.sleep(min(2.0, args.gap * 2))
                row = probe([url], args.probes, args.probe_timeout)[0]
                deadline = time.perf_counter() + args.header_timeout + 5
                while len(slow.closed) < args.connections and time.perf_counter() < deadline:
                    time.sleep(0.2)
                closed = [at for at, _ in slow.closed.values()]
                row["closed_by_server"] = len(closed)
                row["closed_after_s"] = round(max(closed), 2) if closed else None
            out["workers"][name]["slow"] = row
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
