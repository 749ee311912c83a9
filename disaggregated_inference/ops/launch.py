"""How a server process is started: the gunicorn command line and its environment.

``disagg serve`` (what the systemd and launchd units run) and ``disagg up``
(the local cluster) both start servers through ``server_command``, so a server
runs the same way under either. The environment carries the process's tuning
(``tuning.py``): glibc's non-temporal copy threshold and OpenMP's wait policy (with the
cores shared between co-hosted llama.cpp servers: ``server/cores.py``),
both read by the libraries only when the process starts.
"""
from __future__ import annotations

import json
import os
import sys

from ..config import is_loopback
from ..errors import ConfigError
from ..server.settings import engine_threads
from ..tuning import openmp_environment, openmp_set_by_operator, openmp_wait, with_copy_tunable


def check_exposure(settings, bind: str, insecure: bool = False) -> None:
    """A server listening beyond loopback needs an API token, or an explicit ``--insecure``."""
    if bind.startswith(("fd://", "unix:")) or insecure or settings.api_token:
        return
    host = bind.rsplit(":", 1)[0] if bind.count(":") == 1 or bind.startswith("[") else bind
    if not is_loopback(host):
        raise ConfigError(f"server {settings.name!r} would listen on {bind} without an API token: anyone who can "
                          "reach it could use it (and make it fetch KV). Set server.api_token or DISAGG_API_TOKEN, "
                          "or pass --insecure on a network you trust", field="api_token")


def server_command(settings, bind: str, environ=None) -> tuple[list[str], dict]:
    """The command line and environment that run one server (``settings``: a ServerSettings) on ``bind``."""
    env = dict(os.environ if environ is None else environ)
    env.update(DISAGG_SERVER_SETTINGS=settings.to_json(), DISAGG_BIND=bind, DISAGG_PROC_NAME=f"disagg-{settings.name}",
               DISAGG_THREADS=str(settings.threads))
    env = with_copy_tunable(env, settings.non_temporal_copy_bytes)
    if not openmp_set_by_operator(env):
        shared = bool(settings.core_group)  # read by libgomp when llama.cpp (or torch) loads
        env.update(openmp_environment(openmp_wait(settings.openmp_wait, engine_threads(settings.model), shared=shared),
                                      shared))
    return [sys.executable, "-m", "gunicorn", "-c", "python:disaggregated_inference.server.gunicorn_conf"], env


def gateway_command(config: dict, bind: str, environ=None, threads: int = 32) -> tuple[list[str], dict]:
    """The command line and environment that run the gateway (``config``: the cluster's config as a dict)."""
    env = dict(os.environ if environ is None else environ)
    env.update(DISAGG_GATEWAY_CONFIG=json.dumps(config), DISAGG_BIND=bind, DISAGG_PROC_NAME="disagg-gateway",
               DISAGG_THREADS=str(threads))
    return [sys.executable, "-m", "gunicorn", "-c", "python:disaggregated_inference.gateway.gunicorn_conf"], env
