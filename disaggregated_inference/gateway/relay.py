"""What the gateway's two APIs share: one request relayed to the cluster through the client.

The OpenAI and Ollama blueprints parse their bodies (``json_body``) into a
``GatewayRequest`` and hand it to ``complete`` (one answer) or ``open_stream``
(pieces as they come); both count the request in the gateway's metrics. The
disaggregation facts of an answer (``facts``) travel as ``X-Disagg-*`` headers
(``fact_headers``) and in each API's own extension field.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from flask import current_app, g

from .. import chat
from .. import config as cluster_config
from ..client import DisaggregatedClient
from ..errors import DisaggError, ModelNotFound
from ..http import parse_json, read_body
from ..metrics import RequestMetrics
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


@dataclass
class Gateway:
    config: cluster_config.ClusterConfig
    client: DisaggregatedClient
    metrics: GatewayMetrics
    api_token: str | None
    started_at: float


def state() -> Gateway:
    return current_app.extensions["gateway"]


def facts(metrics: RequestMetrics) -> dict:
    """The disaggregation facts of an answer (what its headers say)."""
    figures = metrics.as_dict()
    return {key: figures.get(key) for key in FACT_HEADERS.values()}


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


def openai_type(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status: every 4xx is the request's fault but these three."""
    if status >= 500:
        return "server_error"
    return {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error")


def _model_label(name: str) -> str:
    try:
        return state().config.resolve_model(name)
    except ModelNotFound:
        return "unknown"


def complete(req: GatewayRequest, api: str) -> tuple[str, RequestMetrics]:
    """One non-streamed request through the cluster: (text, the client's metrics)."""
    st = state()
    label = _model_label(req.model)
    try:
        text, metrics = st.client.serve(req.request)
    except DisaggError as exc:
        st.metrics.finished(api, label, None, exc.code)
        raise
    st.metrics.finished(api, label, metrics.method.value, "ok")
    st.metrics.duration.labels(api=api, stream="false").observe(time.perf_counter() - g.arrived)
    if not req.show_reasoning:
        metrics = replace(metrics, reasoning=None)
    return text, metrics


def open_stream(req: GatewayRequest, api: str):
    """Start a streamed request: route it and wait for its first piece (errors until then raise here,
    with their status). Returns ``(route, events)``: what is known of the handoff now, and an
    iterator of ``("piece", text)``, ``("reasoning", text)`` and ``("tool_call", {"name", "arguments"})``,
    then ``("done", RequestMetrics)`` or ``("error", DisaggError)``."""
    st = state()
    label = _model_label(req.model)
    arrived = g.arrived
    route: dict = {}
    pieces = st.client.serve_stream(req.request, on_route=route.update, parts=True)
    try:
        first = next(pieces)
    except DisaggError as exc:
        st.metrics.finished(api, label, None, exc.code)
        raise

    def events():
        item, last = first, None
        try:
            while True:
                if isinstance(item, RequestMetrics):
                    st.metrics.finished(api, label, item.method.value, "ok")
                    st.metrics.duration.labels(api=api, stream="true").observe(time.perf_counter() - arrived)
                    yield "done", item
                    return
                now = time.perf_counter()
                if last is None:
                    st.metrics.ttft.labels(model=label).observe(now - arrived)
                else:
                    st.metrics.inter_token.labels(model=label).observe(now - last)
                last = now
                if isinstance(item, chat.Part):
                    if item.kind == chat.TOOL_CALL or req.show_reasoning:
                        yield item.kind, item.value
                else:
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


def json_body():
    """The request's JSON body, or a 400/408/413 that says what is wrong with it. Any Content-Type is
    read as JSON (``curl -d`` sends a form's); the size and the time to send it are bounded as on
    the servers (the config's ``server.max_request_bytes`` and ``server.body_timeout``), and the JSON
    is checked as they check it (``http.parse_json``: nesting, duplicate keys, text)."""
    limits = state().config.server
    g.body = parse_json(read_body(limits["max_request_bytes"], limits["body_timeout"]))
    return g.body
