"""``python -m disaggregated_inference.webui``: start the web interface (and, if asked, the cluster).

    python -m disaggregated_inference.webui                       # a cluster already running (config)
    python -m disaggregated_inference.webui --local-cluster       # start the config's servers here too

It runs ``streamlit run navigation.py`` (the grading page and the cluster dashboard) on 127.0.0.1 and
a free port (or ``--port``), with the viewer's toolbar (no Deploy or developer menu);
with ``--local-cluster`` the servers get free ports and are stopped when the
interface stops.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

from .. import config as cluster_config
from ..errors import ConfigError, DisaggError
from ..ops.lifetime import critical, spawn, stop_on_signals
from . import state

APP = Path(__file__).with_name("navigation.py")


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def streamlit_command(host: str, port: int) -> list[str]:
    return [sys.executable, "-m", "streamlit", "run", str(APP), "--server.address", host, "--server.port", str(port),
            "--server.headless", "true", "--browser.gatherUsageStats", "false", "--client.toolbarMode", "viewer"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m disaggregated_inference.webui",
                                description="Web interface of the notebook grader (Streamlit).")
    p.add_argument("--config", default=None, help="cluster config (default: $DISAGG_CONFIG or config_current.json)")
    p.add_argument("--local-cluster", action="store_true", help="start the config's servers on this machine first")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the local cluster's models")
    p.add_argument("--host", default="127.0.0.1", help="address of the web interface (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port of the web interface (default: a free one)")
    p.add_argument("--out", default=None, help="folder for reports and uploads (default: grades/webui)")
    p.add_argument("--bench-out", default=None, help="the --out folder of disagg bench: the dashboard shows its last "
                                                    "report (default: bench-report)")
    return p


@stop_on_signals()  # SIGTERM, SIGHUP, Ctrl-C: stop streamlit and the local cluster on the way out
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    cluster, cluster_file = None, None
    try:
        cfg = cluster_config.load(args.config)
        config_file = cfg.source
        if args.local_cluster:
            from ..grading.connect import start_local_cluster

            print(f"starting the local cluster of {cfg.source}; loading models...", file=sys.stderr, flush=True)
            cluster = start_local_cluster(cfg, args.timeout,
                                          lambda name, msg: print(f"  [{name}] {msg}", file=sys.stderr, flush=True))
            fd, cluster_file = tempfile.mkstemp(prefix="grader-cluster-", suffix=".json")
            with os.fdopen(fd, "w") as fh:  # the servers' actual (free) ports, for the app's client
                json.dump(cluster.config, fh, indent=2)
            config_file = cluster_file
        env = dict(os.environ)
        env[state.CONFIG_ENV] = str(Path(config_file).resolve())
        if args.out:
            env[state.OUT_ENV] = args.out
        if args.bench_out:
            env[state.BENCH_ENV] = str(Path(args.bench_out).resolve())
        # `streamlit run` executes app.py as a script: make this package importable from it
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        port = args.port or free_port(args.host)
        print(f"grader web interface: http://{args.host}:{port}  (Ctrl-C stops it"
              + (" and the local cluster)" if cluster else ")"), file=sys.stderr, flush=True)
        with critical():
            proc = spawn(streamlit_command(args.host, port), env=env)
        try:
            return proc.wait()
        except KeyboardInterrupt as exc:
            proc.terminate()
            proc.wait(10)
            return getattr(exc, "exit_code", 130)
    except ConfigError as exc:
        print(f"grader web interface: configuration error: {exc.message}", file=sys.stderr)
        return 2
    except DisaggError as exc:
        print(f"grader web interface: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        return getattr(exc, "exit_code", 130)
    finally:
        if cluster is not None:
            cluster.stop()
        if cluster_file:
            Path(cluster_file).unlink(missing_ok=True)
