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

import hmac
import json
import logging
import os
import time
from dataclasses import dataclass

from flask import Flask, Response, current_app, g, request
from werkzeug.exceptions import HTTPException

from .. import config as cluster_config
from ..client import DisaggregatedClient
from ..server.web import read_body
from ..errors import BadRequest, DisaggError, ModelNotFound, NoServerAvailable, Unauthorized, UpstreamTimeout
from .metrics import GatewayMetrics
from .parse import GatewayRequest

log = logging.getLogger(__name__)

# header -> the key of the client's metrics it reports
FACT_HEADERS = {
    "X-Disagg-Method": "method",
    "X-Disagg-Prefill-Server": "prefill_server",
    "X-Disagg-Decode-Server": "decode_server",
    "X-Disagg-KV-Bytes": "kv_bytes",
    "X-Disagg-Prompt-Tokens-Recomputed": "prompt_tokens_recomputed",
}
OPEN_PATHS = {"/health", "/metrics", "/", "/api/version"}


@dataclass
class Gateway:
    config: cluster_config.ClusterConfig
    client: DisaggregatedClient
    metrics: GatewayMetrics
    api_token: str | None
    started_at: float


def state() -> Gateway:
    return current_app.extensions["gateway"]


def facts(metrics: dict) -> dict:
    """The disaggregation facts of an answer (what its headers say)."""
    return {key: metrics.get(key) for key in FACT_HEADERS.values()}


def fact_headers(known: dict) -> dict:
    """Headers for the facts known; one not known yet (a stream's recompute count) is left out."""
    headers = {}
    for header, key in FACT_HEADERS.items():
        value = known.get(key)
        if value is None and key == "prefill_server" and known.get("method") == "decode_only_fallback":
            value = "none"
        if value is not None:
            headers[header] = str(value)
    return headers


def _model_label(name: str) -> str:
    try:
        return state().config.resolve_model(name)
    except ModelNotFound:
        return "unknown"


def complete(req: GatewayRequest, api: str) -> tuple[str, dict]:
    """One non-streamed request through the cluster: (text, the client's metrics)."""
    st = state()
    label = _model_label(req.model)
    try:
        text, metrics = st.client.generate(**req.client_kwargs())
    except DisaggError as exc:
        st.metrics.finished(api, label, None, exc.code)
        raise
    st.metrics.finished(api, label, metrics["method"], "ok")
    st.metrics.duration.labels(api=api, stream="false").observe(time.perf_counter() - g.arrived)
    return text, metrics


def open_stream(req: GatewayRequest, api: str):
    """Start a streamed request: route it and wait for its first piece (errors until then raise here,
    with their status). Returns ``(route, events)``: what is known of the handoff now, and an
    iterator of ``("piece", text)``, then ``("done", metrics)`` or ``("error", DisaggError)``."""
    st = state()
    label = _model_label(req.model)
    arrived = g.arrived
    route: dict = {}
    pieces = st.client.stream(**req.client_kwargs(), on_route=route.update)
    try:
        first = next(pieces)
    except DisaggError as exc:
        st.metrics.finished(api, label, None, exc.code)
        raise

    def events():
        item, last = first, None
        try:
            while True:
                if isinstance(item, dict):
                    st.metrics.finished(api, label, item["method"], "ok")
                    st.metrics.duration.labels(api=api, stream="true").observe(time.perf_counter() - arrived)
                    yield "done", item
                    return
                now = time.perf_counter()
                if last is None:
                    st.metrics.ttft.labels(model=label).observe(now - arrived)
                else:
                    st.metrics.inter_token.labels(model=label).observe(now - last)
                last = now
                yield "piece", item
                item = next(pieces)
        except DisaggError as exc:
            log.warning("stream failed after it started: %s", exc.message)
            st.metrics.finished(api, label, route.get("method"), exc.code)
            yield "error", exc
        except GeneratorExit:  # the caller went away: the decode server's stream is closed too
            st.metrics.finished(api, label, route.get("method"), "cancelled")
            raise
        finally:
            pieces.close()

    return route, events()


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
    kind = ("invalid_request_error" if status in (400, 404, 409, 422) else "authentication_error" if status == 401
            else "server_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return Response(json.dumps(body), status=status, mimetype="application/json", headers=headers)


def ollama_error(message: str, status: int, headers=None) -> Response:
    return Response(json.dumps({"error": message}), status=status, mimetype="application/json", headers=headers)


def _error_response(message: str, status: int, param=None, code=None, headers=None) -> Response:
    if request.path.startswith("/v1"):
        return openai_error(message, status, param, code, headers)
    return ollama_error(message, status, headers)


def resolve_config(config=None) -> cluster_config.ClusterConfig:
    if config is None and os.environ.get("DISAGG_GATEWAY_CONFIG"):
        config = json.loads(os.environ["DISAGG_GATEWAY_CONFIG"])
    return cluster_config.coerce(config)


def create_app(config=None, client: DisaggregatedClient | None = None) -> Flask:
    cfg = resolve_config(config)
    app = Flask("disaggregated_inference.gateway", static_folder=None)
    app.json.sort_keys = False
    app.config["MAX_CONTENT_LENGTH"] = cfg.server["max_request_bytes"]
    token = os.environ.get("DISAGG_GATEWAY_API_TOKEN") or cfg.gateway.get("api_token")
    app.extensions["gateway"] = Gateway(cfg, client or DisaggregatedClient(cfg), GatewayMetrics(), token, time.time())

    @app.errorhandler(DisaggError)
    def _disagg_error(exc: DisaggError):
        status, headers = error_status(exc)
        if exc.details.pop("close", False):  # a body half read: the connection is in an unknown state
            headers = {**headers, "Connection": "close"}
        if status >= 500:
            log.warning("request failed: status=%s code=%s error=%s", status, exc.code, exc.message)
        message = exc.message
        if isinstance(exc, ModelNotFound) and not request.path.startswith("/v1"):
            message = f"model '{_requested_model()}' not found"
        return _error_response(message, status, exc.field, exc.code, headers)

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):
        return _error_response(exc.description, exc.code, None, exc.name.lower().replace(" ", "_"))

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.path)
        return _error_response(f"internal error: {type(exc).__name__}: {exc}", 500, None, "internal_error")

    @app.before_request
    def _arrive():
        g.arrived = time.perf_counter()
        expected = state().api_token
        if not expected or request.path in OPEN_PATHS:
            return None
        given = request.headers.get("Authorization", "")
        if not given.startswith("Bearer ") or not hmac.compare_digest(given[7:].encode(), expected.encode()):
            raise Unauthorized("missing or wrong API token (send 'Authorization: Bearer <token>')",
                               field="Authorization")
        return None

    @app.get("/health")
    def health():
        st = state()
        servers = st.client.status()
        body = {"status": "healthy", "role": "gateway", "loaded": True, "models": sorted(st.config.models),
                "servers_up": sum(1 for s in servers if s["up"]), "servers": servers,
                "uptime_s": round(time.time() - st.started_at, 1)}
        return Response(json.dumps(body), mimetype="application/json")

    @app.get("/metrics")
    def metrics():
        return Response(state().metrics.render(), mimetype="text/plain; version=0.0.4; charset=utf-8")

    from .ollama_api import ollama
    from .openai_api import openai

    app.register_blueprint(openai)
    app.register_blueprint(ollama)
    return app


def _requested_model() -> str:
    body = g.get("body")
    return str(body.get("model") or body.get("name") or "") if isinstance(body, dict) else ""


def json_body():
    """The request's JSON body, or a 400/408/413 that says what is wrong with it. Any Content-Type is
    read as JSON (``curl -d`` sends a form's); the size and the time to send it are bounded as on
    the servers (the config's ``server.max_request_bytes`` and ``server.body_timeout``)."""
    limits = state().config.server
    data = read_body(limits["max_request_bytes"], limits["body_timeout"])
    if not data:
        raise BadRequest("request body is empty; send a JSON object", field="body")
    try:
        g.body = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"malformed JSON body: {exc}", field="body") from None
    return g.body
