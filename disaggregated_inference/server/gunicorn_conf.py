"""Gunicorn settings for a prefill or decode server (``-c python:disaggregated_inference.server.gunicorn_conf``).

One worker process per server: the model lives in that process, owned by one
thread, and the KV leases live in its memory. The worker is gunicorn's
``gthread`` with each request buffered before it gets a thread
(``server/worker.py``: a slow client holds no request thread, and one that does
not send its headers within ``server.header_timeout`` is closed); its request
threads queue work for the model thread; long generations do not trip the
worker timeout because the worker's heartbeat runs on its own thread.
"""
import os

bind = os.environ.get("DISAGG_BIND", "127.0.0.1:8000")
workers = 1
# DISAGG_WORKER_CLASS=gthread: gunicorn's own, without the buffering (benchmarks/slow_clients.py compares them)
worker_class = os.environ.get("DISAGG_WORKER_CLASS", "disaggregated_inference.server.worker.BufferedThreadWorker")
threads = int(os.environ.get("DISAGG_THREADS", "32"))
timeout = int(os.environ.get("DISAGG_WORKER_TIMEOUT", "120"))
graceful_timeout = 20
keepalive = 75
accesslog = os.environ.get("DISAGG_ACCESS_LOG") or None  # quiet by default; "-" for stdout
errorlog = "-"
loglevel = os.environ.get("DISAGG_GUNICORN_LOG_LEVEL", "warning")
proc_name = os.environ.get("DISAGG_PROC_NAME", "disagg-server")
wsgi_app = "disaggregated_inference.server.wsgi:create_app()"


def worker_exit(server, worker):
    """The worker's last act (gunicorn calls it in the worker, as the worker's exit propagates): run
    the exit handlers, which stop each model owner and free its model on its own thread, then end
    the process without C++ static destructors. An MLX server has torch loaded (mlx-lm imports
    transformers), whose destructors took seconds at exit and made the launcher's 15 s wait end in
    SIGKILL. The exit status gunicorn's arbiter reads (boot and load errors) is kept."""
    import atexit
    import sys

    leaving = sys.exc_info()[1]
    code = leaving.code if isinstance(leaving, SystemExit) else (1 if leaving is not None else 0)
    code = 0 if code is None else code if isinstance(code, int) else 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code & 0xFF)
