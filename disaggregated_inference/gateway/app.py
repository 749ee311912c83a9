"""The gateway's Flask app: one ``DisaggregatedClient`` behind the OpenAI and Ollama APIs.

``create_app(config=None, client=None)``: the config is a ClusterConfig, a dict, a
path, or None (then ``$DISAGG_GATEWAY_CONFIG``, a JSON text, or the usual config
file). Every request goes through the one client (shared by the worker's threads),
so it gets the client's routing, failover, recompute and decode-only fallback.

Errors are answered in the shape of the API asked: OpenAI's
``{"error": {"message", "type", "param", "code"}}`` under ``/v1``, Ollama's
``{"error": "..."}`` under ``/api``.
"""
from __future__ import annotations

import json
import logging
import os
import time

from flask import Flask, Response, g, request
from werkzeug.exceptions import HTTPException

from .. import config as cluster_config
from ..client import DisaggregatedClient
from ..errors import DisaggError, ModelNotFound, NoServerAvailable, UpstreamTimeout
from ..http import arrival_limits, check_bearer
from .metrics import GatewayMetrics
from .parse import api_field
from .ollama_api import ollama
from .openai_api import openai
from .relay import Gateway, openai_type, state

log = logging.getLogger(__name__)

OPEN_PATHS = {"/health", "/metrics", "/", "/api/version"}


def error_status(exc: DisaggError) -> tuple[int, dict]:
    """The honest status of a cluster error, and its extra headers."""
    if isinstance(exc, NoServerAvailable):
        if exc.details.get("timed_out"):
            return 504, {}
        interval = float(state().config.client.get("health_check_interval") or 0)
        return 503, {"Retry-After": str(int(max(1, min(interval, 30)) if interval else 5))}
    if isinstance(exc, UpstreamTimeout):
        return 504, {}
    return exc.status, {}


def openai_error(message: str, status: int, param=None, code=None, headers=None) -> Response:
    body = {"error": {"message": message, "type": openai_type(status), "param": param, "code": code}}
    return Response(json.dumps(body), status=status, mimetype="application/json", headers=headers)


def ollama_error(message: str, status: int, field=None, headers=None) -> Response:
    """Ollama's ``{"error": message}``, with the ``field`` at fault where there is one."""
    body = {"error": message, **({"field": field} if field else {})}
    return Response(json.dumps(body), status=status, mimetype="application/json", headers=headers)


def _error_response(message: str, status: int, param=None, code=None, headers=None) -> Response:
    if request.path.startswith("/v1"):
        return openai_error(message, status, api_field(param, "openai"), code, headers)
    return ollama_error(message, status, api_field(param, "ollama"), headers)


def resolve_config(config=None) -> cluster_config.ClusterConfig:
    if config is None and os.environ.get("DISAGG_GATEWAY_CONFIG"):
        config = json.loads(os.environ["DISAGG_GATEWAY_CONFIG"])
    return cluster_config.coerce(config)


def create_app(config=None, client: DisaggregatedClient | None = None) -> Flask:
    cfg = resolve_config(config)
    app = Flask("disaggregated_inference.gateway", static_folder=None)
    app.json.sort_keys = False
    app.config["MAX_CONTENT_LENGTH"] = cfg.server["max_request_bytes"]
    app.config["DISAGG_ARRIVAL"] = arrival_limits(cfg.server["header_timeout"], cfg.server["body_timeout"],
                                                  cfg.server["max_request_bytes"])
    token = os.environ.get("DISAGG_GATEWAY_API_TOKEN") or cfg.gateway.get("api_token")
    app.extensions["gateway"] = Gateway(cfg, client or DisaggregatedClient(cfg), GatewayMetrics(), token, time.time())
    app.register_error_handler(DisaggError, _disagg_error)
    app.register_error_handler(HTTPException, _http_error)
    app.register_error_handler(Exception, _unexpected)
    app.before_request(_arrive)
    app.add_url_rule("/health", view_func=health, methods=["GET"])
    app.add_url_rule("/metrics", view_func=metrics, methods=["GET"])
    app.register_blueprint(openai)
    app.register_blueprint(ollama)
    return app


def _disagg_error(exc: DisaggError):
    status, headers = error_status(exc)
    if exc.details.pop("close", False):  # a body half read: the connection is in an unknown state
        headers = {**headers, "Connection": "close"}
    if status >= 500:
        log.warning("request failed: status=%s code=%s error=%s", status, exc.code, exc.message)
    message, field = exc.message, exc.field
    if isinstance(exc, ModelNotFound) and not request.path.startswith("/v1"):
        message, field = f"model '{_requested_model()}' not found", None  # Ollama's very words, and only them
    return _error_response(message, status, field, exc.code, headers)


def _http_error(exc: HTTPException):
    return _error_response(exc.description, exc.code, None, exc.name.lower().replace(" ", "_"))


def _unexpected(exc: Exception):
    log.exception("unhandled error in %s %s", request.method, request.path)
    return _error_response(f"internal error: {type(exc).__name__}: {exc}", 500, None, "internal_error")


def _arrive():
    g.arrived = time.perf_counter()
    expected = state().api_token
    if not expected or request.path in OPEN_PATHS:
        return None
    check_bearer(expected)
    return None


def health():
    """``GET /health``: the gateway and the servers it sees."""
    st = state()
    servers = st.client.status()
    body = {"status": "healthy", "role": "gateway", "loaded": True, "models": sorted(st.config.models),
            "servers_up": sum(1 for s in servers if s["up"]), "servers": servers,
            "uptime_s": round(time.time() - st.started_at, 1)}
    return Response(json.dumps(body), mimetype="application/json")


def metrics():
    """``GET /metrics``: Prometheus' text format."""
    return Response(state().metrics.render(), mimetype="text/plain; version=0.0.4; charset=utf-8")


def _requested_model() -> str:
    body = g.get("body")
    return str(body.get("model") or body.get("name") or "") if isinstance(body, dict) else ""
