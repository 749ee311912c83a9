"""The bench's options: one typed object, checked once, and the ``disagg bench`` flags that fill it."""
from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass, field

from ..errors import ConfigError
from .endpoints import PeerSpec, parse_peer
from .table import parse_target


@dataclass
class BenchOptions:
    config: str | None = None
    local_cluster: bool = False
    via: str = "client"  # or "gateway"
    workload: str = "grader"
    concurrency: int | None = None
    rate: float | None = None
    sweep: bool = False
    sweep_rates: int = 3  # rates between one-at-a-time and the most the cluster takes
    duration_s: float | None = None
    requests: int | None = None
    max_tokens: int | None = None
    peers: list[PeerSpec] = field(default_factory=list)
    peer_models: dict = field(default_factory=dict)
    targets: dict = field(default_factory=dict)
    price_kwh: float | None = None
    out: str = "bench-report"
    chaos: bool = False
    chaos_server: str | None = None
    chaos_down_s: float = 5.0
    phases: int | None = None  # per side; default 2 with peers (ours, peer, ours, peer), else 1
    efficiency_groups: int = 2
    seed: int = 0
    grace_s: float = 30.0
    startup_timeout_s: float = 900.0
    notebooks: str | None = None
    rubric: str | None = None
    command: str = ""

    def check(self) -> None:
        """Refuse contradictory or impossible options, naming the flag."""
        if self.via not in ("client", "gateway"):
            raise ConfigError(f"--via must be client or gateway, not {self.via!r}", field="--via")
        if self.duration_s is not None and self.requests is not None:
            raise ConfigError("give --duration or --requests, not both", field="--duration")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ConfigError(f"--duration must be > 0 seconds, got {self.duration_s:g}", field="--duration")
        if self.requests is not None and self.requests < 1:
            raise ConfigError(f"--requests must be >= 1, got {self.requests}", field="--requests")
        if self.concurrency is not None and self.rate is not None:
            raise ConfigError("give --concurrency or --rate, not both", field="--rate")
        if self.sweep and self.rate is not None:
            raise ConfigError("--sweep chooses its own rates: drop --rate", field="--sweep")
        if self.concurrency is not None and self.concurrency < 1:
            raise ConfigError(f"--concurrency must be >= 1, got {self.concurrency}", field="--concurrency")
        if self.rate is not None and not self.rate > 0:
            raise ConfigError(f"--rate must be > 0 requests a second, got {self.rate:g}", field="--rate")
        if self.price_kwh is not None and not self.price_kwh >= 0:
            raise ConfigError(f"--price-kwh must be >= 0, got {self.price_kwh:g}", field="--price-kwh")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ConfigError(f"--max-tokens must be >= 1, got {self.max_tokens}", field="--max-tokens")
        if self.phases is not None and self.phases < 1:
            raise ConfigError(f"--phases must be >= 1, got {self.phases}", field="--phases")
        if self.chaos and not self.local_cluster:
            raise ConfigError("--chaos needs --local-cluster: the bench stops only servers it started itself, "
                              "never a running cluster's", field="--chaos")
        for flag, value, low in (("--sweep-rates", self.sweep_rates, 1), ("--efficiency-groups", self.efficiency_groups, 0),
                                 ("--grace", self.grace_s, 0), ("--chaos-down", self.chaos_down_s, 0)):
            if not value >= low:
                raise ConfigError(f"{flag} must be >= {low}, got {value:g}", field=flag)
        names = [p.name for p in self.peers]
        if len(set(names)) != len(names):
            raise ConfigError(f"two peers share a name: {', '.join(sorted(n for n in names if names.count(n) > 1))}",
                              field="--peer")


def _model_name(text: str) -> tuple[str, str]:
    key, sep, name = text.partition("=")
    if not sep or not key or not name:
        raise argparse.ArgumentTypeError(f"--peer-model is KEY=NAME (e.g. qwen=qwen3-coder:30b), not {text!r}")
    return key, name


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``disagg bench``'s flags (the config's ``--config`` is added by the CLI with the others' own)."""
    p.add_argument("--local-cluster", action="store_true",
                   help="start the config's servers on this machine on free ports (as disagg up does), then stop them")
    p.add_argument("--via", choices=("client", "gateway"), default="client",
                   help="through the client as the grader uses it, or through the OpenAI gateway")
    p.add_argument("--workload", default="grader", metavar="grader|chat|long|FILE.jsonl",
                   help="the grader's own requests for the example notebooks (pairs, in parallel), short chats, "
                        "prompts of a few thousand tokens, or a JSONL file (model, prompt or messages, max_tokens)")
    p.add_argument("--concurrency", type=int, help="requests (grader: pairs) in flight at once (default 1)")
    p.add_argument("--rate", type=float, help="Poisson arrivals, units a second")
    p.add_argument("--sweep", action="store_true", help="one at a time, then as fast as it takes them "
                   "(--concurrency, default 16), then --sweep-rates rates in between; finds the SLO knee")
    p.add_argument("--sweep-rates", type=int, default=3)
    p.add_argument("--duration", type=float, help="seconds of load per side (split over its phases)")
    p.add_argument("--requests", type=int, help="requests per side (default: one pass over the workload)")
    p.add_argument("--max-tokens", type=int, help="cap every request's max_tokens (shorter runs)")
    p.add_argument("--peer", action="append", type=parse_peer, default=[], metavar="NAME=URL",
                   help="an OpenAI- or Ollama-API endpoint sent the same requests (NAME=openai:URL or "
                        "NAME=ollama:URL to say which), e.g. mac-only=http://mac:11434; repeatable")
    p.add_argument("--peer-model", action="append", type=_model_name, default=[], metavar="KEY=NAME",
                   help="the name peers know a model by (default: its first alias, e.g. qwen3-coder:30b)")
    p.add_argument("--phases", type=int, help="phases per side, alternating ours/peer (default 2 with peers)")
    p.add_argument("--target", action="append", type=parse_target, default=[], metavar="NAME=VALUE",
                   help="override one of seed 004's targets, e.g. e2e_latency_p95_s=30")
    p.add_argument("--price-kwh", type=float, help="electricity price per kWh (cost per request)")
    p.add_argument("--out", default="bench-report", help="where bench.json, bench.md and the charts go")
    p.add_argument("--chaos", action="store_true", help="with --local-cluster: stop a server mid-load, start it "
                   "again, and measure the failover time and the error rate around it")
    p.add_argument("--chaos-server", help="which server --chaos stops (default: the first prefill server)")
    p.add_argument("--chaos-down", type=float, default=5.0, help="seconds the stopped server stays down")
    p.add_argument("--efficiency-groups", type=int, default=2,
                   help="request groups run in parallel and one after the other for parallel efficiency")
    p.add_argument("--grace", type=float, default=30.0,
                   help="seconds a phase waits for requests in flight before cutting them (failed)")
    p.add_argument("--seed", type=int, default=0, help="seeds the workload's requests and the Poisson arrivals")
    p.add_argument("--notebooks", help="the grader workload's notebooks (default: examples/notebooks)")
    p.add_argument("--rubric", help="the grader workload's rubric (default: examples/rubric.yaml)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for a local cluster's models")


def from_args(args) -> BenchOptions:
    return BenchOptions(
        config=args.config, local_cluster=args.local_cluster, via=args.via, workload=args.workload,
        concurrency=args.concurrency, rate=args.rate, sweep=args.sweep, sweep_rates=args.sweep_rates,
        duration_s=args.duration, requests=args.requests, max_tokens=args.max_tokens, peers=list(args.peer),
        peer_models=dict(args.peer_model), targets=dict(args.target), price_kwh=args.price_kwh, out=args.out,
        chaos=args.chaos, chaos_server=args.chaos_server, chaos_down_s=args.chaos_down, phases=args.phases,
        efficiency_groups=args.efficiency_groups, seed=args.seed, grace_s=args.grace,
        startup_timeout_s=args.timeout, notebooks=args.notebooks, rubric=args.rubric,
        command=" ".join(["disagg", *map(shlex.quote, sys.argv[1:])]))
