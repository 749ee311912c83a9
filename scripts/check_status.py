#!/usr/bin/env python3
"""Health table of every server of the cluster config.

For each server: name, role, model, URL, up/loading/DOWN, latency of GET /health, whether
the model is loaded, the backend, what it hands over (llama_seq_state: the KV cache;
token_ids: the prompt is recomputed), KV leases held (prefill servers) and memory.

Exit status: 0 when every server is up with its model loaded, 1 when one is not (each
named on stderr), 2 for a bad config.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _use_repo_venv() -> None:
    """Run under the repository's .venv when started with another Python."""
    try:
        import disaggregated_inference  # noqa: F401
    except ImportError:
        venv = REPO / ".venv"
        if (venv / "bin" / "python").exists() and Path(sys.prefix).resolve() != venv.resolve():
            os.execv(str(venv / "bin" / "python"), [str(venv / "bin" / "python"), *sys.argv])
        sys.exit(f"{Path(sys.argv[0]).name}: the disaggregated_inference package is not installed; "
                 "run scripts/install.sh first")


def default_config() -> str:
    """$DISAGG_CONFIG, else ./config_current.json, else the repository's."""
    if os.environ.get("DISAGG_CONFIG"):
        return os.environ["DISAGG_CONFIG"]
    return "config_current.json" if Path("config_current.json").is_file() else str(REPO / "config_current.json")


HINTS = {  # what the client's health-check errors usually mean
    "ConnectionError": "nothing listens there, or the host is unreachable",
    "ConnectTimeout": "no answer in time: host down or port filtered by a firewall?",
    "ReadTimeout": "connected, but no answer in time: server overloaded or hung?",
    "JSONDecodeError": "the answer is not JSON: another program (or a proxy) answers on that port",
}


def _with_hint(error):
    if not error:
        return error
    for key, hint in HINTS.items():
        if error.endswith(key):
            return f"{error} ({hint})"
    return error


def _size(n) -> str:
    if n is None:
        return "-"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"


def describe(state) -> dict:
    """One server's row, from the client's view of it after one health check."""
    health = state.health or {}
    entry = state.entry
    if state.last_error is None and health.get("loaded") is True:
        status = "up"
    elif health.get("status") == "loading":
        status = "loading"
    else:
        status = "DOWN"
    resources = health.get("resources") or {}
    gpu = resources.get("gpu") or {}
    gpu_used = gpu.get("memory_used_bytes")
    if gpu.get("devices"):
        gpu_used = sum(d.get("memory_used_bytes", 0) for d in gpu["devices"])
    leases = health.get("leases")
    return {
        "name": entry.name, "role": entry.role, "model": entry.model, "url": entry.url,
        "data_url": entry.data_url, "status": status, "up": status == "up",
        "latency_s": state.latency_s, "loaded": health.get("loaded"), "backend": health.get("backend"),
        "handoff": health.get("handoff"), "progress": health.get("progress"),
        "leases_held": leases.get("held") if leases else None,
        "leases_bytes": leases.get("bytes") if leases else None,
        "rss_bytes": resources.get("process_rss_bytes"), "gpu_kind": gpu.get("kind"),
        "gpu_memory_used_bytes": gpu_used, "uptime_s": health.get("uptime_s"),
        "version": health.get("version"), "error": _with_hint(state.last_error),
        "library_version": (health.get("model_info") or {}).get("library_version"),
        "model_file": (health.get("model_info") or {}).get("model_file"),
    }


def pair_problems(rows: list[dict]) -> tuple[list[str], list[str]]:
    """Differences between the servers of one model that break (errors) or may break (warnings)
    the KV handoff: the state format has no version field, so both sides must run the same
    llama-cpp-python and the same model file (the decode side refuses a mismatched bundle)."""
    errors, warnings = [], []
    by_model: dict = {}
    for r in rows:
        if r["up"]:
            by_model.setdefault(r["model"], []).append(r)
    for model, group in sorted(by_model.items()):
        versions = {r["library_version"] for r in group if r["library_version"]}
        if len(versions) > 1:
            errors.append(f"model {model}: servers run different llama-cpp-python versions ("
                          + ", ".join(f"{r['name']}: {r['library_version']}" for r in group)
                          + "); the decode side will refuse the KV bundles")
        files = {Path(r["model_file"]).name for r in group if r["model_file"]}
        if len(files) > 1:
            warnings.append(f"model {model}: servers load differently named model files ("
                            + ", ".join(f"{r['name']}: {Path(r['model_file']).name}" for r in group if r["model_file"])
                            + "); the handoff needs the same file (same sha256) on both sides")
    return errors, warnings


def check(config) -> list[dict]:
    from disaggregated_inference.client import DisaggregatedClient

    with DisaggregatedClient(config, health_check=False) as client:
        client.check_health()
        return [describe(state) for state in client.servers.values()]


def print_table(rows: list[dict]) -> None:
    head = ("server", "role", "model", "url", "state", "latency", "loaded", "backend", "handoff", "leases",
            "memory", "detail")
    table = [head]
    for r in rows:
        latency = f"{r['latency_s'] * 1000:.0f} ms" if r["latency_s"] is not None else "-"
        leases = "-" if r["leases_held"] is None else f"{r['leases_held']} ({_size(r['leases_bytes'])})"
        memory = "-" if r["rss_bytes"] is None else f"rss {_size(r['rss_bytes'])}"
        if r["gpu_memory_used_bytes"] is not None:
            memory += f", gpu {_size(r['gpu_memory_used_bytes'])}"
        detail = r["error"] or (r["progress"] if r["status"] != "up" else "") or ""
        table.append((r["name"], r["role"], r["model"], r["url"], r["status"], latency,
                      {True: "yes", False: "no"}.get(r["loaded"], "-"), r["backend"] or "-", r["handoff"] or "-",
                      leases, memory, detail))
    widths = [max(len(str(row[i])) for row in table) for i in range(len(head) - 1)]
    for row in table:
        cells = [str(c).ljust(w) for c, w in zip(row, widths)]
        print("  ".join(cells + [str(row[-1])]).rstrip())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="check_status.py", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None,
                        help="cluster config (default: $DISAGG_CONFIG, else ./config_current.json, "
                             "else the repository's)")
    parser.add_argument("--only", action="append", metavar="NAME", help="only this server (repeatable)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--doctor", action="store_true",
                        help="also run `disagg doctor`: pair fingerprints, data paths, tokens (exit 1 on a problem)")
    args = parser.parse_args(argv)
    _use_repo_venv()
    from disaggregated_inference import config as cluster_config
    from disaggregated_inference.errors import ConfigError

    try:
        cfg = cluster_config.load(args.config or default_config())
    except ConfigError as exc:
        print(f"check_status.py: configuration error: {exc.message}", file=sys.stderr)
        return 2
    if args.only:
        unknown = sorted(set(args.only) - {s.name for s in cfg.servers})
        if unknown:
            print(f"check_status.py: {cfg.source}: no server named {', '.join(unknown)}", file=sys.stderr)
            return 2
        cfg = replace(cfg, prefill_servers=[s for s in cfg.prefill_servers if s.name in args.only],
                      decode_servers=[s for s in cfg.decode_servers if s.name in args.only])
    rows = check(cfg)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_table(rows)
    bad = [r for r in rows if not r["up"]]
    for r in bad:
        reason = r["error"] or r["status"]
        print(f"check_status.py: {r['status']}: {r['role']} server {r['name']} ({r['url']}): {reason}",
              file=sys.stderr)
    if bad:
        print(f"check_status.py: {len(bad)} of {len(rows)} servers not ready", file=sys.stderr)
    errors, warnings = pair_problems(rows)
    for line in warnings:
        print(f"check_status.py: warning: {line}", file=sys.stderr)
    for line in errors:
        print(f"check_status.py: MISMATCH: {line}", file=sys.stderr)
    doctor_problems = run_doctor(cfg) if args.doctor else 0
    return 1 if bad or errors or doctor_problems else 0


def run_doctor(cfg) -> int:
    """``disagg doctor`` on the same config: prints its report, returns the number of problems."""
    from disaggregated_inference.ops.doctor import Doctor, format_report

    report = Doctor(cfg, api_token=os.environ.get("DISAGG_API_TOKEN")).run()
    print()
    print(format_report(report))
    return len(report.problems)


if __name__ == "__main__":
    raise SystemExit(main())
