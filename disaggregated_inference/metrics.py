"""Prometheus metrics of one server, exposed at ``GET /metrics``.

Each app has its own registry (tests run several apps in one process).
Resource figures (memory, CPU, GPU) are read when scraped.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from . import resources

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
SPEED_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 50000)


class ServerMetrics:
    def __init__(self, role: str, leases=None):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("disagg_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.prefill_seconds = Histogram("disagg_prefill_seconds", "Prompt evaluation time", buckets=LATENCY_BUCKETS,
                                         registry=r)
        self.prefill_speed = Histogram("disagg_prefill_tokens_per_second", "Prompt evaluation speed",
                                       buckets=SPEED_BUCKETS, registry=r)
        self.decode_seconds = Histogram("disagg_decode_seconds", "Generation time", buckets=LATENCY_BUCKETS,
                                        registry=r)
        self.decode_speed = Histogram("disagg_decode_tokens_per_second", "Generation speed", buckets=SPEED_BUCKETS,
                                      registry=r)
        self.ttft = Histogram("disagg_time_to_first_token_seconds", "Request arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.kv_bytes = Counter("disagg_kv_bytes", "KV bundle bytes produced (prefill) or received (decode)",
                                registry=r)
        self.kv_transfer_seconds = Histogram("disagg_kv_transfer_seconds", "KV pull time on the decode side",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.handoffs = Counter("disagg_handoffs", "Decode requests by what was handed over", ["method"], registry=r)
        self.fallbacks = Counter("disagg_decode_only", "Whole generations on this server (/generate)", registry=r)
        self.slow_transfers = Counter("disagg_slow_kv_transfers", "KV transfers slower than the warning threshold",
                                      registry=r)
        if leases is not None:
            Gauge("disagg_leases_held", "KV bundles held under a lease", registry=r).set_function(
                lambda: leases.stats()["held"])
            Gauge("disagg_lease_bytes", "Bytes of KV held under leases", registry=r).set_function(
                lambda: leases.stats()["bytes"])
        self._resources = {}
        for name, doc in (("process_rss_bytes", "Resident memory of the server process"),
                          ("process_cpu_pct", "CPU use of the server process, percent"),
                          ("gpu_utilization_pct", "GPU utilisation, percent (first device)"),
                          ("gpu_memory_used_bytes", "GPU (or unified) memory in use")):
            self._resources[name] = Gauge(f"disagg_{name}", doc, registry=r)
        self.role = role

    def watch_receive_buffers(self, pool) -> None:
        Gauge("disagg_receive_buffer_idle_bytes", "Bytes of freed KV receive buffers kept for reuse",
              registry=self.registry).set_function(pool.idle_bytes)

    def observe_decode(self, metrics: dict) -> None:
        if metrics.get("decode_time") is not None:
            self.decode_seconds.observe(metrics["decode_time"])
        if metrics.get("decode_speed"):
            self.decode_speed.observe(metrics["decode_speed"])
        if metrics.get("ttft") is not None:
            self.ttft.observe(metrics["ttft"])
        if metrics.get("method"):
            self.handoffs.labels(method=metrics["method"]).inc()

    def render(self) -> bytes:
        snap = resources.snapshot()
        self._resources["process_rss_bytes"].set(snap["process_rss_bytes"])
        self._resources["process_cpu_pct"].set(snap["process_cpu_pct"])
        gpu = snap.get("gpu") or {}
        device = (gpu.get("devices") or [gpu])[0] if gpu else {}
        if device.get("utilization_pct") is not None:
            self._resources["gpu_utilization_pct"].set(device["utilization_pct"])
        if device.get("memory_used_bytes") is not None:
            self._resources["gpu_memory_used_bytes"].set(device["memory_used_bytes"])
        return generate_latest(self.registry)
