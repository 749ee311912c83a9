"""Gunicorn settings for the gateway (``-c python:disaggregated_inference.gateway.gunicorn_conf``).

The servers' settings, with the gateway's app: one worker process, so one
``DisaggregatedClient`` (its server states, its health monitor) shared by the
worker's ``gthread`` request threads; each thread holds one request, streams included.
"""
import os

from disaggregated_inference.server.gunicorn_conf import *  # noqa: F401,F403  (bind, workers, threads, ...)

proc_name = os.environ.get("DISAGG_PROC_NAME", "disagg-gateway")
threads = int(os.environ.get("DISAGG_THREADS", "32"))
timeout = int(os.environ.get("DISAGG_WORKER_TIMEOUT", "300"))
wsgi_app = "disaggregated_inference.gateway.wsgi:create_app()"
