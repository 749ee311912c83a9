"""What the prefill and decode servers share: the app skeleton, errors, health, auth.

Errors become JSON here and nowhere else. Long-lived objects (the model owner,
the lease table) live in ``app.extensions["disagg"]`` (``state()``). Handlers and
views are module functions, registered once by ``create_base_app`` (and the
prefill's and decode's by their ``create_app``); they read those objects from
``state()``, and pass them on as ``st`` to work that may run on a helper thread
with no app context (``progress.py``).
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field, replace

from flask import Flask, Response, current_app, request
from werkzeug.exceptions import HTTPException

from .. import __version__, backends
from ..backends import options
from ..backends.base import Prompt, check_fits
from ..kv.canary import CanaryPolicy
from ..errors import DisaggError, ModelNotFound, UnsupportedMediaType
from ..kv.receive import socket_buffer_in_effect
from ..tuning import copy_tunable_in_effect
from .. import http
from ..http import STREAM_HEADERS, arrival_limits, parse_json  # noqa: F401  (arrival_limits: gunicorn_conf)
from . import energy, resources  # psutil: imported with the app (metrics.py samples it for /metrics too)
from . import admission, cores
from .metrics import ServerMetrics
from ..request import Limits
from .owner import ModelOwner
from .settings import ServerSettings

log = logging.getLogger("disaggregated_inference.server")
OPEN_ENDPOINTS = {"health", "metrics", "static"}


@dataclass
class ServerContext:
    settings: ServerSettings
    owner: ModelOwner
    started_at: float = field(default_factory=time.time)
    leases: object = None  # LeaseTable, prefill servers only
    receive_buffers: object = None  # buffers.BufferPool, decode servers only
    metrics: object = None  # ServerMetrics

    @property
    def backend(self):
        return self.owner.backend


def state() -> ServerContext:
    return current_app.extensions["disagg"]


def configure_logging() -> None:
    """Structured (key=value) and quiet by default; DISAGG_LOG_LEVEL=INFO/DEBUG for more."""
    level = os.environ.get("DISAGG_LOG_LEVEL", "WARNING").upper()
    root = logging.getLogger("disaggregated_inference")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(
            "ts=%(asctime)s level=%(levelname)s logger=%(name)s pid=%(process)d msg=%(message)r"))
        root.addHandler(handler)
    root.setLevel(level)


def create_base_app(settings: ServerSettings, backend=None, leases=None) -> Flask:
    configure_logging()
    app = Flask(f"disaggregated_inference.{settings.role}")
    app.json.sort_keys = False
    backend = backend or backends.create(settings.engine_model)
    backend.canary = CanaryPolicy.from_settings(settings)
    owner = ModelOwner(backend, settings.queue_timeout, settings.max_queue, cores=cores.for_server(settings, backend))
    st = ServerContext(settings, owner, leases=leases,
                     metrics=ServerMetrics(settings.role, leases, name=settings.name, model=settings.model.name,
                                           backend=settings.model.backend, version=__version__))
    st.metrics.watch_owner(st.owner)
    app.extensions["disagg"] = st
    app.config["MAX_CONTENT_LENGTH"] = settings.max_request_bytes
    app.config["DISAGG_ARRIVAL"] = arrival_limits(settings.header_timeout, settings.body_timeout,
                                                  settings.max_request_bytes)
    admission.install(app, settings.threads)
    app.register_error_handler(DisaggError, _disagg_error)
    app.register_error_handler(HTTPException, _http_error)
    app.register_error_handler(Exception, _unexpected)
    app.before_request(_auth)
    app.after_request(_count)
    app.add_url_rule("/metrics", view_func=metrics, methods=["GET"])
    app.add_url_rule("/health", view_func=health, methods=["GET"])
    return app


def _disagg_error(exc: DisaggError):
    return error_response(exc)


def _http_error(exc: HTTPException):
    return json_response({"error": exc.description, "code": exc.name.lower().replace(" ", "_")}, exc.code)


def _unexpected(exc: Exception):
    log.exception("unhandled error in %s %s", request.method, request.path)
    return json_response({"error": f"internal error: {type(exc).__name__}: {exc}", "code": "internal_error"}, 500)


def _auth():
    """Every endpoint but the open ones wants the API token, when the server has one."""
    token = state().settings.api_token
    if not token or request.endpoint in OPEN_ENDPOINTS:
        return None
    http.check_bearer(token)
    return None


def _count(response):
    state().metrics.requests.labels(endpoint=request.endpoint or "unknown", status=str(response.status_code)).inc()
    return response


def metrics():
    """``GET /metrics``: Prometheus' text format."""
    return Response(state().metrics.render(), mimetype="text/plain; version=0.0.4; charset=utf-8")


def health():
    """``GET /health``: what this server is, serves and holds, and whether it is ready."""
    st = state()
    settings, owner = st.settings, st.owner
    body = {
        "status": "healthy" if owner.ready else ("loading" if owner.state == "loading" else "unhealthy"),
        "role": settings.role,
        "name": settings.name,
        "model": owner.backend.served_model(),  # the real name ("qwen3-coder:30b"), as the documents show
        "model_key": settings.model.name,  # the config's key ("qwen")
        "aliases": list(settings.aliases),
        "loaded": owner.ready,
        "backend": settings.model.backend,
        "options": options.values(settings.engine_model),  # the model's settings as loaded, as its engine declares them
        "handoff": getattr(owner.backend, "handoff_kind", None),
        "accepts": list(getattr(owner.backend, "accepts", ())),  # bundle kinds its /decode continues
        # whole bundles, and streamed ones (the overlapped handoff): what a prefill server sends, what a
        # decode server takes (all of this version, imported as they arrive where the backend can)
        "handoff_modes": ["whole", "streamed"] if settings.role == "decode" or (
            getattr(owner.backend, "kv_streaming", None) or {"enabled": False}).get("enabled") is not False
        else ["whole"],
        "progress": owner.progress,
        "error": owner.error,
        "busy": owner.busy,
        "queued": owner.queued,
        "slots": owner.slot_stats(),
        "compute_threads": owner.compute_threads,  # of the last step, where the cores are shared
        "core_share": owner.cores.describe() if owner.cores is not None else None,
        "uptime_s": round(time.time() - st.started_at, 1),
        "non_temporal_copy_bytes": copy_tunable_in_effect(),
        "version": __version__,
        "time": time.time(),  # disagg doctor compares clocks
        "auth_required": bool(settings.api_token),
        # tokens/s of prompt evaluation over recent requests (moving average; null until one):
        # the client's cost model starts from it (routing.py)
        "prompt_speed": round(st.metrics.prompt_speed, 1) if st.metrics.prompt_speed else None,
    }
    if owner.ready:
        body["model_info"] = owner.backend.describe()
        body["fingerprint"] = owner.backend.fingerprint()  # what a bundle from/to this server must match
        if body["model_info"].get("ready") is False:
            body["status"], body["loaded"] = "degraded", False
    if st.leases is not None:
        body["leases"] = st.leases.stats()
    if st.receive_buffers is not None:
        body["receive_buffers"] = {**st.receive_buffers.stats(),
                                   "socket_buffer_bytes": socket_buffer_in_effect(settings.kv_socket_buffer_bytes)}
        # the last probe of each prefill server's data path (disagg doctor), by host:port
        body["kv_probes"] = dict(st.metrics.probes)
    body["resources"] = resources.snapshot()
    body["energy"] = energy.snapshot()  # joules by device, or why none (server/energy.py)
    return json_response(body, 200 if body["status"] in ("healthy", "loading") else 503)


def json_response(body: dict, status: int = 200, headers: dict | None = None) -> Response:
    return Response(json.dumps(body), status=status, mimetype="application/json", headers=headers)


def error_response(exc: DisaggError) -> Response:
    headers = {}
    retry_after = exc.details.get("retry_after")
    if retry_after is not None:
        headers["Retry-After"] = str(int(max(1, retry_after)))
    if exc.details.pop("close", False):  # the connection is in an unknown state (a body half read)
        headers["Connection"] = "close"
    if exc.status >= 500:
        log.warning("request failed: status=%s code=%s error=%s", exc.status, exc.code, exc.message)
    return json_response(exc.to_dict(), exc.status, headers)


def json_body() -> dict:
    """The request's JSON body, or a 400/408/413/415 that says what is wrong with it."""
    if request.mimetype and request.mimetype != "application/json" and not request.mimetype.endswith("+json"):
        raise UnsupportedMediaType(f"send the body as application/json, not {request.mimetype}", field="Content-Type",
                                   close=True)  # its body is never read
    return parse_json(read_body())


def read_body(limit: int | None = None, timeout: float | None = None) -> bytes:
    """The request body (``http.read_body``), by default within this server's ``body_timeout`` and
    ``max_request_bytes``."""
    settings = state().settings
    return http.read_body(settings.max_request_bytes if limit is None else limit,
                          settings.body_timeout if timeout is None else timeout)


def request_limits() -> Limits:
    settings = state().settings
    return Limits(prompt_chars=settings.max_prompt_chars, schema_bytes=settings.max_schema_bytes)


def tokenized(st: ServerContext, prompt: Prompt) -> tuple[Prompt, float | None]:
    """The prompt with its token ids and template stops (``Backend.tokenize``), made here on the request's
    own thread: the chat template and the tokenizer, whose work a prompt's size decides, never hold the
    thread that owns the model (where every slot would wait for them). A prompt that cannot fit the
    context is refused now, before it waits for a slot. Returns (the prompt, seconds it took), or the
    prompt as it is and None for an engine that tokenizes behind its own API. Uses no request context: a
    request's work may run on a helper thread (progress.py)."""
    st.owner.require_ready()
    started = time.perf_counter()
    made = st.backend.tokenize(prompt)
    if made is None:
        return prompt, None
    tokens, stops = made
    check_fits(len(tokens), st.backend.settings.n_ctx, field="prompt" if prompt.messages is None else "messages")
    return replace(prompt, tokens=tuple(tokens), stops=tuple(stops)), round(time.perf_counter() - started, 6)


def check_model(name: str | None) -> None:
    """A request may name the model it expects; refuse it if this server serves another."""
    if name is None:
        return
    settings = state().settings
    known = {settings.model.name, settings.model.model, *settings.aliases}
    if name.lower() not in {k.lower() for k in known if k}:
        raise ModelNotFound(f"this server serves {settings.model.name or settings.model.model!r}, not {name!r}",
                            field="model")



def ndjson(lines) -> Response:
    return Response((json.dumps(line) + "\n" for line in lines), mimetype="application/x-ndjson",
                    headers=STREAM_HEADERS)
