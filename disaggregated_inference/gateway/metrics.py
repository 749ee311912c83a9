"""The gateway's Prometheus metrics: what only the router in front of the cluster can measure.

Time to first token and inter-token latency are taken as the gateway's caller sees
them (from the request's arrival at the gateway, through prefill, KV handoff and
decode, to each piece leaving the gateway), for streamed answers.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("disagg_gateway_requests", "Requests answered, by model, method and outcome",
                                ["api", "model", "method", "outcome"], registry=r)
        self.fallbacks = Counter("disagg_gateway_fallbacks", "Requests served decode-only (no prefill server)",
                                 ["model"], registry=r)
        self.ttft = Histogram("disagg_gateway_time_to_first_token_seconds",
                              "Streamed requests: arrival at the gateway to the first piece sent", ["model"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("disagg_gateway_inter_token_seconds",
                                     "Streamed requests: time between consecutive pieces sent", ["model"],
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("disagg_gateway_request_seconds", "Arrival to the answer's last byte",
                                  ["api", "stream"], buckets=LATENCY_BUCKETS, registry=r)

    def finished(self, api: str, model: str, method: str | None, outcome: str) -> None:
        self.requests.labels(api=api, model=model, method=method or "none", outcome=outcome).inc()
        if method == "decode_only_fallback":
            self.fallbacks.labels(model=model).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
