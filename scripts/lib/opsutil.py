"""Helpers the operations scripts (scripts/*.sh) call with the venv's Python.

    opsutil.py servers --config F [--role R] [--only NAME ...]
        one tab-separated line per server: role name host port model url data_url backend local
    opsutil.py spawn --pidfile P --log L [--bind HOST:PORT] -- COMMAND...
        start COMMAND in its own session, detached, output appended to L; write "PID CREATE_TIME" to P
        (with --bind: first check that HOST:PORT is free)
    opsutil.py pid-status --pidfile P
        "running PID", "stale" (the process is gone or the PID was reused) or "absent"
    opsutil.py stop --pidfile P [--timeout S]
        stop the process recorded in P (and its children), only if it is still that process
    opsutil.py wait --url U --name N [--pidfile P] [--log L] [--timeout S]
        wait until U/health says the model is loaded

The pid file holds the process's creation time next to its PID, so a PID the
system has since given to another process is never signalled.
Exit codes: 0 ok, 1 failure, 2 configuration or usage error.
"""
from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # usable as a file name and a systemd instance


def fail(message: str, code: int = 1) -> None:
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(code)


# -- config -----------------------------------------------------------------------------------


def cmd_servers(args) -> int:
    from disaggregated_inference import config
    from disaggregated_inference.errors import ConfigError

    try:
        cfg = config.load(args.config)
    except ConfigError as exc:
        fail(f"configuration error: {exc.message}", 2)
    entries = [s for s in cfg.servers if not args.role or s.role == args.role]
    if args.only:
        known = {s.name for s in cfg.servers}
        unknown = sorted(set(args.only) - known)
        if unknown:
            fail(f"{cfg.source}: no server named {', '.join(unknown)} (have: {', '.join(sorted(known))})", 2)
        entries = [s for s in entries if s.name in args.only]
    for s in entries:
        if not SAFE_NAME.match(s.name):
            fail(f"{cfg.source}: server name {s.name!r} cannot be used as a pid file or service instance name "
                 "(use letters, digits, '.', '_' and '-')", 2)
        print("\t".join([s.role, s.name, s.host, str(s.port), s.model, s.url, s.data_url or "-",
                         s.settings.get("backend", "llama_cpp"), "1" if s.host in LOCAL_HOSTS else "0"]))
    return 0


# -- processes --------------------------------------------------------------------------------


def _read_pidfile(path: Path):
    try:
        pid_text, created_text = path.read_text().split()[:2]
        return int(pid_text), float(created_text)
    except (OSError, ValueError):
        return None


def _our_process(path: Path):
    """The process recorded in the pid file if it is still alive and still the same process."""
    import psutil

    recorded = _read_pidfile(path)
    if recorded is None:
        return None
    pid, created = recorded
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - created) > 0.05 or proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except psutil.Error:
        return None


def cmd_spawn(args) -> int:
    import psutil

    if not args.command:
        fail("spawn: no command given", 2)
    if args.bind:
        host, _, port = args.bind.rpartition(":")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gunicorn does
            try:
                probe.bind((host.strip("[]"), int(port)))
            except OSError as exc:
                fail(f"{args.bind} is not free ({exc.strerror}): another program listens there, "
                     "or a server started some other way")
    Path(args.log).parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    with open(args.log, "ab") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(args.command)}\n".encode())
        log.flush()
        proc = subprocess.Popen(args.command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    created = psutil.Process(proc.pid).create_time()
    tmp = Path(f"{args.pidfile}.tmp")
    tmp.write_text(f"{proc.pid} {created:.3f}\n")
    tmp.replace(args.pidfile)
    print(proc.pid)
    return 0


def cmd_pid_status(args) -> int:
    path = Path(args.pidfile)
    if not path.exists():
        print("absent")
    else:
        proc = _our_process(path)
        print(f"running {proc.pid}" if proc else "stale")
    return 0


def cmd_stop(args) -> int:
    import psutil

    path = Path(args.pidfile)
    if not path.exists():
        print("not running (no pid file)")
        return 0
    proc = _our_process(path)
    if proc is None:
        path.unlink(missing_ok=True)
        print("not running (stale pid file removed)")
        return 0
    try:
        family = [proc] + proc.children(recursive=True)
    except psutil.Error:
        family = [proc]
    proc.terminate()  # gunicorn: graceful shutdown of its worker

    def alive(procs):
        left = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(p)
            except psutil.Error:
                pass
        return left

    deadline = time.monotonic() + args.timeout
    while alive(family) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = alive(family)
    for p in left:  # only the process we started and the children it had
        try:
            p.kill()
        except psutil.Error:
            pass
    if left:
        time.sleep(0.5)
    if alive(family):
        fail(f"process {proc.pid} did not end; pid file kept: {path}")
    path.unlink(missing_ok=True)
    print(f"stopped pid {proc.pid}" + (" (killed after the grace period)" if left else ""))
    return 0


# -- health -----------------------------------------------------------------------------------


def _tail(path: str | None, lines: int = 20) -> str:
    if not path:
        return ""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def cmd_wait(args) -> int:
    import requests

    deadline = time.monotonic() + args.timeout
    last = None
    while True:
        if args.pidfile and _our_process(Path(args.pidfile)) is None:
            fail(f"server {args.name} exited while starting; last lines of {args.log}:\n{_tail(args.log)}")
        try:
            resp = requests.get(args.url.rstrip("/") + "/health", timeout=3)
            health = resp.json()
        except (requests.RequestException, ValueError) as exc:
            health = {"status": "unreachable", "progress": f"no answer yet ({type(exc).__name__})"}
        if health.get("loaded") is True:
            print(f"  [{args.name}] ready ({args.url})", file=sys.stderr, flush=True)
            return 0
        if health.get("status") == "unhealthy":
            fail(f"server {args.name} failed to load its model: {health.get('error')}"
                 + (f"\nlast lines of {args.log}:\n{_tail(args.log)}" if args.log else ""))
        message = health.get("progress") or health.get("status")
        if message != last:
            print(f"  [{args.name}] {message}", file=sys.stderr, flush=True)
            last = message
        if time.monotonic() > deadline:
            fail(f"server {args.name} ({args.url}) not healthy after {args.timeout:g}s (last state: {message})"
                 + (f"\nlast lines of {args.log}:\n{_tail(args.log)}" if args.log else ""))
        time.sleep(0.5)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="opsutil.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("servers")
    p.add_argument("--config", required=True)
    p.add_argument("--role", choices=("prefill", "decode"))
    p.add_argument("--only", nargs="*", default=[])
    p.set_defaults(func=cmd_servers)
    p = sub.add_parser("spawn")
    p.add_argument("--pidfile", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--bind", help="HOST:PORT the command will listen on: refuse to start if it is taken")
    p.add_argument("command", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_spawn)
    p = sub.add_parser("pid-status")
    p.add_argument("--pidfile", required=True)
    p.set_defaults(func=cmd_pid_status)
    p = sub.add_parser("stop")
    p.add_argument("--pidfile", required=True)
    p.add_argument("--timeout", type=float, default=30.0)
    p.set_defaults(func=cmd_stop)
    p = sub.add_parser("wait")
    p.add_argument("--url", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--pidfile")
    p.add_argument("--log")
    p.add_argument("--timeout", type=float, default=900.0)
    p.set_defaults(func=cmd_wait)
    args = parser.parse_args(argv)
    if args.verb == "spawn" and args.command[:1] == ["--"]:
        args.command = args.command[1:]
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
