"""Benchmark: an hour's worth of faults with nothing lost: a soak of the whole cluster.

A local cluster of its own, on free ports (two prefill and two decode servers per model, and the gateway),
takes a steady load of both models through the client and through the gateway (its OpenAI and its Ollama
API, streamed) for ``--duration`` seconds
(default 1800), while faults are injected one at a time, every ``--fault-every`` seconds after the warm-up,
the kinds in turn: SIGKILL of a prefill server, a decode server and the gateway (each restarted by the
cluster's supervisor); SIGSTOP of each (SIGCONT after ``--stop-seconds``); the prefill→decode link cut in the
middle of a KV transfer, and slowed to 100 Mbit/s (one prefill server in a network namespace of its own: root
and iproute2, else these are skipped and the JSON says why); a prefill server's lease store filled by
prefills that are never decoded; the gateway restarted under load. Every few seconds it samples each
server's RSS, open files, threads and leases.

It reports (``--json``: one JSON object on stdout; definitions in
``disaggregated_inference/bench/soak_figures.py``): requests sent, answered, failed, lost (goal 0) and
duplicated (goal 0); the error rate outside the fault windows (goal 0) and inside them; the failover time
per kind of fault (p50, max; goal under 5 s); the leases held at the end (goal 0); the growth of RSS, open
files and threads per 1,000 requests after the warm-up; each request's outcome and each fault's window. A
PNG of the resources over time with the fault windows shaded goes to ``--png``.

    .venv/bin/python benchmarks/soak.py --json > soak.json            # 30 minutes
    .venv/bin/python benchmarks/soak.py --quick --json                # a minute or two: tiny models
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import quick  # noqa: E402
from disaggregated_inference import config as cluster_config  # noqa: E402
from disaggregated_inference.bench import soak, soak_figures  # noqa: E402
from disaggregated_inference.bench.faults import KINDS  # noqa: E402
from disaggregated_inference.errors import ConfigError  # noqa: E402


def soak_config(path: str | None, tiny: bool, lease_limit_mib: float = 64.0) -> dict:
    """The cluster's models and settings (from ``--config``, else the embedded config), with a client that notices
    a dead or silent server within seconds and a prefill server's lease store ``lease_limit_mib`` large (what a
    lease fill fills); ``tiny``: both models generated tiny llamas, one compute thread each."""
    source = Path(path) if path else ROOT / "config_current.json"
    data = json.loads(source.read_text())
    data["client"] = {**data.get("client", {}), "health_check_interval": 1, "failures_before_down": 1,
                      "connect_timeout": 1, "progress_timeout": 3.0}
    for entry in data["models"].values():  # the same steps whatever the batch: an answer moved between
        if entry.get("backend", "llama_cpp") == "llama_cpp":  # decode servers can go on with the same text
            entry.setdefault("deterministic", True)
    data["server"] = {**data.get("server", {}), "openmp_wait": "sleep",
                      "max_lease_bytes": max(1, int(lease_limit_mib * (1 << 20)))}
    if tiny:
        from dataclasses import replace

        from tests.tiny_models import LLAMA, tiny_gguf

        shapes = {0: LLAMA, 1: replace(LLAMA, n_layer=3, seed=1)}  # two models, two fingerprints
        for i, (name, entry) in enumerate(data["models"].items()):
            data["models"][name] = {**entry, "backend": "llama_cpp", "model": str(tiny_gguf(shapes[i % 2])),
                                    "n_threads": 1, "n_ctx": 1024, "flash_attn": True}
        data["server"].update(share_cores=False, lease_seconds=10.0)  # a cut transfer's lease gone in seconds
    return data


def parse_faults(text: str) -> tuple:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip()) if text not in ("", "none") else ()
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown fault {unknown[0]!r}: one of {', '.join(KINDS)}, or none")
    return kinds


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _stop(signum, frame):
    """The first stop signal ends the run (the cluster and the namespace are removed on the way out); the
    ones after it wait for that to finish instead of cutting it short."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="cluster config whose models and settings the soak runs "
                                         "(default: the embedded one); its servers are the soak's own")
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of load")
    parser.add_argument("--rate", type=float, default=0.5,
                        help="requests a second per model and path (Poisson; three paths: client, gateway's OpenAI "
                             "and Ollama APIs)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens each answer may take")
    parser.add_argument("--faults", type=parse_faults, default=KINDS, metavar="KIND,...",
                        help=f"the fault kinds, in turn (default all: {','.join(KINDS)}; 'none': no fault)")
    parser.add_argument("--fault-every", type=float, default=60.0, help="seconds between faults' starts")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds before the first fault (and the growth)")
    parser.add_argument("--settle", type=float, default=5.0,
                        help="seconds after a fault's end still counted inside its window")
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between resource samples")
    parser.add_argument("--stop-seconds", type=float, default=10.0, help="how long a SIGSTOP lasts")
    parser.add_argument("--link-seconds", type=float, default=10.0, help="how long a link fault lasts")
    parser.add_argument("--lease-seconds", type=float, default=15.0, help="the lease of a lease fill's prefills")
    parser.add_argument("--lease-limit-mib", type=float, default=64.0,
                        help="KV a prefill server holds under leases at most (server.max_lease_bytes): a lease fill "
                             "fills it")
    parser.add_argument("--slow-mbit", type=float, default=100.0, help="the slowed link's rate")
    parser.add_argument("--no-link", action="store_true", help="no namespaced prefill server: the link faults skip")
    parser.add_argument("--png", default="soak.png", help="where the resources chart goes ('' for none)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    quick.add_argument(parser)
    args = quick.apply(parser, parser.parse_args(argv), duration=45.0, rate=1.0, max_tokens=8, fault_every=6.0,
                       warmup=4.0, settle=3.0, sample_every=1.0, stop_seconds=3.0, link_seconds=2.0,
                       lease_seconds=4.0, lease_limit_mib=1.0)
    try:
        options = soak.SoakOptions(
            config=cluster_config.coerce(soak_config(args.config, args.quick, args.lease_limit_mib)),
            duration_s=args.duration,
            rate=args.rate, max_tokens=args.max_tokens, faults=args.faults, fault_every_s=args.fault_every,
            warmup_s=args.warmup, settle_s=args.settle, sample_every_s=args.sample_every, stop_s=args.stop_seconds,
            link_s=args.link_seconds, lease_s=args.lease_seconds, slow_mbit=args.slow_mbit,
            use_link=not args.no_link, grace_s=30.0 if args.quick else 120.0, fill_max=50 if args.quick else 200,
            progress_every_s=10.0 if args.quick else 30.0)
        soak.check_options(options)
    except (ConfigError, OSError) as exc:
        parser.error(getattr(exc, "message", None) or str(exc))
    for sig in STOP_SIGNALS:  # the cluster and the namespace go on each of these too
        signal.signal(sig, _stop)
    try:
        run = soak.run(options, quick.say)
    except KeyboardInterrupt:  # before the load began: the cluster is already stopped
        quick.say("interrupted while the cluster started: nothing measured")
        return 130
    report = soak_figures.build(run)
    given = argv if argv is not None else sys.argv[1:]
    report.update(quick=args.quick, command=" ".join(["benchmarks/soak.py", *given]),
                  schedule=[{"at_s": at, "kind": kind} for at, kind in soak.schedule(options)])
    report["png"] = None
    if args.png:
        why = soak_figures.draw(report, args.png)
        report["png"] = None if why else args.png
        if why:
            quick.say(why)
    if args.json:
        print(json.dumps(report))
    else:
        shown = {k: report[k] for k in ("requests", "error_rate", "failover_s", "leases_held_at_end", "growth_max",
                                         "faults_skipped", "link", "png")}
        print(json.dumps(shown, indent=2))
    return 0 if report["complete"] else 130


if __name__ == "__main__":
    raise SystemExit(main())
