"""``disagg``: run the local cluster, serve one server, send a prompt, check health.

Errors of the package become exit codes here: 2 for configuration or usage
problems, 1 for everything else; a stop signal before the cluster is up, 128 + its
number (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP), after its servers are stopped.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from dataclasses import replace

from .. import __version__
from .. import config as cluster_config
from ..errors import ConfigError, DisaggError
from .lifetime import StopRequested, stop_on_signals

DEMO_PROMPTS = {
    "qwen": "Explain in two sentences what this Python does:\n\nimport pandas as pd\n"
            "df = pd.read_csv('sales.csv')\nprint(df.groupby('region')['revenue'].sum().sort_values())",
    "gpt-oss": "Write two sentences of encouraging feedback for a student whose sales analysis notebook "
               "ran without errors but had no charts.",
}
# A base model (its GGUF has no chat template: not instruction-tuned, as the Gemma 3 270M stand-in for
# gpt-oss) answers an instruction with unrelated words; it continues text well. The demo gives it this.
DEMO_COMPLETION = {"prompt": "Pandas is an open-source Python library that", "raw": True, "stop": ["\n\n"]}


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _progress(name: str, message: str) -> None:
    _say(f"  [{name}] {message}")


def _start_cluster(args, free_ports: bool, gateway: bool = False):
    from .cluster import LocalCluster

    cfg = cluster_config.load(args.config)
    cluster = LocalCluster(cfg, names=args.only or None, free_ports=free_ports, log_dir=args.log_dir, gateway=gateway)
    _say(f"starting {len(cluster.entries)} servers from {cfg.source} (logs in {cluster.log_dir})")
    cluster.start()
    try:
        for proc in cluster.processes:
            _say(f"  {proc.entry.role:7} {proc.entry.name:24} {proc.url}  model={proc.entry.model} "
                 f"({proc.settings.model.backend}:{proc.settings.model.model})")
        if cluster.gateway is not None:
            _say(f"  gateway {'':24} {cluster.gateway.url}  OpenAI: {cluster.gateway.url}/v1  "
                 f"Ollama: {cluster.gateway.url}")
        started = time.monotonic()
        cluster.wait_healthy(timeout=args.timeout, progress=_progress)
        _say(f"all servers healthy in {time.monotonic() - started:.1f}s")
    except BaseException:
        cluster.stop()
        raise
    return cluster


@stop_on_signals()
def cmd_up(args) -> int:
    """Start the cluster and keep it running until a stop signal: 0 once it was up (the usual end),
    128 + the signal's number when it came during the start-up (the servers started so far are stopped)."""
    cluster = _start_cluster(args, free_ports=False, gateway=not args.no_gateway)
    _say("cluster running; a server that exits is restarted; Ctrl-C to stop")
    try:
        from .supervise import Supervisor

        Supervisor(cluster, _say).run(threading.Event())  # until a stop signal raises StopRequested
    except StopRequested as stop:
        _say(f"{stop.name}: stopping servers...")
    finally:
        cluster.stop()
        _say("stopped")
    return 0


def _print_result(model: str, text: str, metrics: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"model": model, "text": text, "metrics": metrics}, indent=2))
        return
    print(f"--- {model} ---")
    print(text.strip())
    print()
    _print_metrics(metrics)


def _print_metrics(metrics: dict) -> None:
    rows = [("method", metrics.get("method")),
            ("prefill server", metrics.get("prefill_server")), ("decode server", metrics.get("decode_server")),
            ("prompt tokens", metrics.get("prompt_tokens")), ("completion tokens", metrics.get("completion_tokens")),
            *([("of them reasoning", metrics["reasoning_tokens"])] if metrics.get("reasoning_tokens") else []),
            ("prefill", _fmt_phase(metrics.get("prefill_time"), metrics.get("prefill_speed"))),
            ("decode", _fmt_phase(metrics.get("decode_time"), metrics.get("decode_speed"))),
            ("KV handed over", _fmt_bytes(metrics.get("kv_bytes"), metrics.get("kv_transfer_time"))
             + (" (streamed during the prefill)" if metrics.get("handoff_mode") == "streamed" else "")),
            ("prompt tokens recomputed on decode", metrics.get("prompt_tokens_recomputed")),
            ("time to first token (decode server)", _fmt_s(metrics.get("ttft"))),
            ("total", _fmt_s(metrics.get("total_time")))]
    width = max(len(r[0]) for r in rows)
    for label, value in rows:
        print(f"  {label:<{width}}  {value}")
    for warning in metrics.get("warnings", []):
        print(f"  warning: {warning}")


def _fmt_s(value) -> str:
    return "-" if value is None else f"{value:.3f} s"


def _fmt_phase(seconds, speed) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.3f} s" + (f" @ {speed:.1f} tok/s" if speed else "")


def _fmt_bytes(n, seconds) -> str:
    if not n:
        return "none (token ids only)" if n == 0 else "-"
    text = f"{n / 1e6:.1f} MB"
    if seconds:
        text += f" in {seconds * 1000:.0f} ms ({n * 8 / seconds / 1e9:.1f} Gb/s)"
    return text


def cmd_generate(args) -> int:
    from ..client import DisaggregatedClient

    prompt = args.prompt if args.prompt != "-" else sys.stdin.read()
    with DisaggregatedClient(args.config, health_check=False) as client:
        text, metrics = client.generate(model=args.model, prompt=prompt, max_tokens=args.max_tokens,
                                        temperature=args.temperature, seed=args.seed,
                                        reasoning_effort=args.reasoning_effort)
    _print_result(args.model, text, metrics, args.json)
    return 0


def base_models(client) -> set:
    """Model keys whose decode servers run a GGUF without a chat template of its own (a base model:
    the server applies a built-in template, which does not make it follow instructions). A model the
    server renders in its own format (gpt-oss's harmony) is no base model."""
    client.check_health()
    infos = [(s.entry.model, s.health.get("model_info") or {}) for s in client.servers.values()
             if s.entry.role == "decode"]
    return {model for model, info in infos if "chat_template" in info and info["chat_template"] != "gguf"
            and info.get("chat_format") != "harmony"}


def demo_job(model: str, base: bool, max_tokens: int) -> dict:
    if base:
        return {"model": model, **DEMO_COMPLETION, "max_tokens": max_tokens, "seed": 0}
    return {"model": model, "prompt": DEMO_PROMPTS.get(model, "Say hello in one sentence."),
            "max_tokens": max_tokens, "seed": 0}


@stop_on_signals()
def cmd_demo(args) -> int:
    from ..client import DisaggregatedClient, describe_overlap

    cluster = _start_cluster(args, free_ports=True)
    try:
        with DisaggregatedClient(cluster.config, health_check=False) as client:
            models = args.models or list(client.config.models)
            base = base_models(client)
            jobs = [demo_job(m, m in base, args.max_tokens) for m in models]
            _say(f"sending {len(jobs)} prompts in parallel through prefill -> KV handoff -> decode ...")
            results, combined = client.generate_many(jobs)
        failed = 0
        for job, result in zip(jobs, results):
            if isinstance(result, Exception):
                failed += 1
                print(f"--- {job['model']} --- FAILED: {result}")
                continue
            if args.json:
                _print_result(job["model"], *result, as_json=True)
                continue
            print(f"--- {job['model']} ---" if not job.get("raw") else
                  f"--- {job['model']} (a base model, no chat template: it continues text rather than following "
                  "instructions) ---")
            text, metrics = result
            print("prompt:  " + job["prompt"].replace("\n", "\n         "))
            print("answer:  " + text.strip().replace("\n", "\n         "))
            print()
            _print_metrics(metrics)
            print()
        if not args.json:
            print("concurrent: " + describe_overlap(combined))
        return 1 if failed else 0
    finally:
        _say("stopping servers...")
        cluster.stop()


def cmd_serve(args) -> int:
    """Run one server in the foreground under gunicorn (what systemd units call)."""
    from ..server.settings import ServerSettings, from_cluster
    from ..backends.base import ModelSettings
    from .launch import check_exposure, server_command

    if args.server:
        cfg = cluster_config.load(args.config)
        settings = from_cluster(cfg, args.server)
        entry = cfg.find_server(args.server)
        bind = args.bind or f"{'0.0.0.0' if args.public else entry.host}:{entry.port}"
    else:
        if not (args.role and args.model):
            raise ConfigError("give --server NAME (with --config) or --role and --model", field="server")
        given = {"backend": args.backend, "model": args.model}
        if args.n_gpu_layers is not None:  # an option of llama_cpp: another engine leaves it
            given["n_gpu_layers"] = args.n_gpu_layers
        model = ModelSettings.from_dict(given, name=args.name or args.model)
        settings = ServerSettings(role=args.role, model=model, name=args.name or f"{args.role}-{args.model}")
        bind = args.bind or f"0.0.0.0:{8000 if args.role == 'prefill' else 8001}"
    if os.environ.get("DISAGG_API_TOKEN"):  # e.g. from a systemd EnvironmentFile; beats the config file
        settings = replace(settings, api_token=os.environ["DISAGG_API_TOKEN"])
    if args.kv_source:  # a decode server started without a config trusts only what it is told
        settings = replace(settings, kv_sources=(*settings.kv_sources, *args.kv_source))
    check_exposure(settings, bind, insecure=args.insecure)
    cmd, env = server_command(settings, bind)
    _say(f"serving {settings.role} '{settings.name}' ({settings.model.backend}:{settings.model.model}) on {bind}")
    os.execvpe(cmd[0], cmd, env)
    return 0  # not reached


def cmd_gateway(args) -> int:
    """Run the OpenAI/Ollama gateway in the foreground under gunicorn, in front of the configured servers."""
    from pathlib import Path

    from .launch import gateway_command

    cfg = cluster_config.load(args.config)
    data = json.loads(Path(cfg.source).read_text())
    host = "0.0.0.0" if args.public else cfg.gateway["host"]
    bind = args.bind or f"{host}:{cfg.gateway['port']}"
    cmd, env = gateway_command(data, bind, threads=args.threads)
    _say(f"gateway for {cfg.source} on {bind}: OpenAI at /v1, Ollama at /api")
    os.execvpe(cmd[0], cmd, env)
    return 0  # not reached


def cmd_status(args) -> int:
    from ..client import DisaggregatedClient

    with DisaggregatedClient(args.config, health_check=False) as client:
        rows = client.check_health()
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'server':26} {'role':8} {'model':10} {'url':28} {'state':6} {'latency':>8}  detail")
        for r in rows:
            state = "up" if r["up"] else "DOWN"
            latency = f"{r['latency_s'] * 1000:.0f} ms" if r["latency_s"] is not None else "-"
            detail = r["last_error"] or f"{r['backend']} handoff={r['handoff']}"
            print(f"{r['name']:26} {r['role']:8} {r['model']:10} {r['url']:28} {state:6} {latency:>8}  {detail}")
    return 0 if all(r["up"] for r in rows) else 1


def cmd_doctor(args) -> int:
    from .doctor import Doctor, format_report

    cfg = cluster_config.load(args.config)
    report = Doctor(cfg, api_token=os.environ.get("DISAGG_API_TOKEN"), probe_bytes=int(args.probe_mb * (1 << 20)),
                    timeout=args.timeout).run()
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return 0 if not report.problems else 1


def cmd_top(args) -> int:
    from ..observe import top

    cfg = cluster_config.load(args.config)
    return top.run(cfg, interval=args.interval, window=args.window, once=args.once)


def cmd_models(args) -> int:
    from ..backends.gguf import BUILTIN

    for name, spec in BUILTIN.items():
        print(f"{name:14} {spec['description']}")
    return 0


def build_parser(extra=()) -> argparse.ArgumentParser:
    """The ``disagg`` parser; ``extra``: functions ``(subparsers, with_config)`` that add the commands of the
    layers above this one (``disaggregated_inference/cli.py`` adds ``disagg bench``)."""
    parser = argparse.ArgumentParser(prog="disagg", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p):
        p.add_argument("--config", default=None, help="cluster config file (default: $DISAGG_CONFIG or "
                                                     "./config_current.json)")
        return p

    def with_cluster(p):
        with_config(p)
        p.add_argument("--only", nargs="*", metavar="NAME", help="start only these servers")
        p.add_argument("--log-dir", default=None, help="where server logs go (default: a temp dir)")
        p.add_argument("--timeout", type=float, default=900, help="seconds to wait for models to load")
        return p

    p = with_cluster(sub.add_parser("up", help="start every configured server on this machine; Ctrl-C stops"))
    p.add_argument("--no-gateway", action="store_true", help="do not start the OpenAI/Ollama gateway")
    p.set_defaults(func=cmd_up)

    p = with_config(sub.add_parser("generate", help="send a prompt through a running cluster"))
    p.add_argument("model", help="model name or alias (qwen, qwen3-coder:30b, gpt-oss, ...)")
    p.add_argument("prompt", help="the prompt ('-' reads standard input)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--reasoning-effort", choices=("low", "medium", "high"),
                   help="how long a reasoning model (gpt-oss) thinks; --json shows its reasoning")
    p.add_argument("--json", action="store_true", help="print the raw result as JSON")
    p.set_defaults(func=cmd_generate)

    p = with_cluster(sub.add_parser("demo", help="start a cluster on free ports, generate with both models "
                                                 "in parallel, stop"))
    p.add_argument("--models", nargs="*", help="model keys to try (default: all)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_demo)

    p = with_config(sub.add_parser("serve", help="run one server in the foreground (gunicorn)"))
    p.add_argument("--server", help="server name from the config")
    p.add_argument("--role", choices=("prefill", "decode"))
    p.add_argument("--backend", default="llama_cpp", help="llama_cpp or ollama (with --role/--model)")
    p.add_argument("--model", help="model (smollm2, gemma3-270m, a GGUF path, ollama:NAME, or an Ollama name)")
    p.add_argument("--name", help="public model name (with --role/--model)")
    p.add_argument("--n-gpu-layers", type=int, default=None, help="-1 offloads every layer (CUDA/Metal builds)")
    p.add_argument("--bind", help="host:port (default: from the config)")
    p.add_argument("--public", action="store_true", help="listen on 0.0.0.0 instead of the configured host")
    p.add_argument("--kv-source", action="append", default=[], metavar="HOST[:PORT]|URL",
                   help="a decode server may pull KV from here too (repeatable; adds to server.kv_sources)")
    p.add_argument("--insecure", action="store_true",
                   help="allow listening beyond loopback without an API token (a network you trust)")
    p.set_defaults(func=cmd_serve)

    p = with_config(sub.add_parser("gateway", help="run the OpenAI/Ollama-compatible gateway in the foreground"))
    p.add_argument("--bind", help="host:port (default: the config's gateway.host and gateway.port)")
    p.add_argument("--public", action="store_true", help="listen on 0.0.0.0 instead of gateway.host")
    p.add_argument("--threads", type=int, default=32, help="request threads (each holds one request or stream)")
    p.set_defaults(func=cmd_gateway)

    p = with_config(sub.add_parser("status", help="health table of every configured server"))
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = with_config(sub.add_parser("doctor", help="check a running cluster: servers, pairs, data paths, tokens"))
    p.add_argument("--probe-mb", type=float, default=4.0, help="test blob each decode server pulls (MiB, max 64)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_doctor)

    p = with_config(sub.add_parser("top", help="live view of a running cluster in the terminal: per-model "
                                               "timings, slots, queues, handoffs, canary, KV links"))
    p.add_argument("--interval", type=float, default=2.0, help="seconds between redraws")
    p.add_argument("--window", type=float, default=300.0, help="seconds the percentiles and rates cover")
    p.add_argument("--once", action="store_true", help="print one frame (figures since the servers started) "
                                                     "and exit; 1 when a server is not up")
    p.set_defaults(func=cmd_top)

    p = sub.add_parser("models", help="list the built-in (packaged) models")
    p.set_defaults(func=cmd_models)
    for add in extra:
        add(sub, with_config)
    return parser


def main(argv=None, extra=()) -> int:
    args = build_parser(extra).parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        _say(f"disagg: configuration error: {exc.message}")
        return 2
    except DisaggError as exc:
        _say(f"disagg: {exc.message}")
        return 1
    except KeyboardInterrupt as exc:  # StopRequested (SIGTERM, SIGHUP, SIGINT): its own code
        if isinstance(exc, StopRequested):
            _say(f"disagg: stopped by {exc.name}; the servers it started are stopped")
        return getattr(exc, "exit_code", 130)


if __name__ == "__main__":  # the cluster's commands only: the whole ``disagg`` is disaggregated_inference/cli.py
    raise SystemExit(main())
