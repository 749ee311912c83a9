"""Prometheus metrics of one server, exposed at ``GET /metrics``.

Each app has its own registry (tests run several apps in one process).
Resource figures (memory, CPU, GPU) are read when scraped. A server serves one
model: ``disagg_server_info`` (value 1) carries its name, role and model, and a
dashboard joins on it (``* on(instance) group_left(model) disagg_server_info``)
rather than every series repeating the model. ``deploy/grafana/disagg.json``
queries these names; tests/test_dashboards.py checks them against live servers.
"""
from __future__ import annotations

import bisect
import math
import time
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from . import energy, resources
from ..metrics import ServerFigures

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
SPEED_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 50000)


def kv_source(url: str) -> str:
    """The ``source`` label of a KV pull: the prefill server's host:port as the decode server reached it."""
    return urlsplit(url).netloc or "unknown"


class EnergyCollector:
    """``disagg_energy_joules_total{device=...}``: the machine's energy counters (server/energy.py), read when
    scraped; no sample where the machine has none (``/health``'s ``energy.reason`` says why)."""

    def describe(self):
        return [CounterMetricFamily("disagg_energy_joules", "")]

    def collect(self):
        family = CounterMetricFamily("disagg_energy_joules", "Energy the machine's devices used (Zeus: NVML, RAPL, "
                                     "Apple Silicon), joules since the counter started", labels=["device"])
        for device, joules in (energy.snapshot()["joules"] or {}).items():
            family.add_metric([device], joules)
        yield family


class _Buckets:
    """A histogram's counts, kept by one thread in plain Python and read by the scrape (``StepCollector``)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple):
        self.bounds, self.counts, self.sum = bounds, [0] * (len(bounds) + 1), 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # Prometheus's le: a value on a bound is in it
        self.sum += value

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        cumulative, total = [], 0
        for bound, n in zip(self.bounds + (math.inf,), list(self.counts)):
            total += n
            cumulative.append((floatToGoString(bound), total))
        return HistogramMetricFamily(name, doc, buckets=cumulative, sum_value=self.sum)


class StepCollector:
    """The model steps of a server's owner thread: ``disagg_batch_tokens``, ``disagg_batch_sequences``,
    ``disagg_step_seconds`` (histograms) and ``disagg_between_steps_seconds_total``.

    ``on_step`` runs on the owner thread between two steps, where every microsecond holds the step's other compute
    threads back. prometheus_client's ``Histogram.observe`` takes a lock and walks its buckets: three of them and a
    counter took 39 us a step here right after a step (SmolLM2, 8 at once, 2 cores: 0.17% of a 23 ms step). This
    keeps the counts in plain lists and builds the families when scraped, with the names and buckets as before."""

    FAMILIES = (
        ("disagg_batch_tokens", "Tokens evaluated per model step (one llama_decode)",
         (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)),
        ("disagg_batch_sequences", "Requests advanced per model step", (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)),
        ("disagg_step_seconds", "Seconds per model step (one evaluation of the batch: llama_decode and the batch "
         "it is built from)", (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)),
    )
    BETWEEN = ("disagg_between_steps_seconds", "Seconds the model's owner thread spent between two steps while "
               "requests went on stepping: sampling, detokenizing, speculation, handing tokens to the HTTP threads "
               "(a wait for this server's share of shared cores not counted)")

    def __init__(self):
        self._tokens, self._sequences, self._seconds = (_Buckets(tuple(map(float, bounds)))
                                                        for _, _, bounds in self.FAMILIES)
        self.between = 0.0

    def on_step(self, n_sequences: int, n_tokens: int, seconds: float, gap: float | None) -> None:
        self._tokens.observe(n_tokens)
        self._sequences.observe(n_sequences)
        self._seconds.observe(seconds)
        if gap is not None and gap > 0:
            self.between += gap

    def describe(self):
        return [HistogramMetricFamily(name, doc) for name, doc, _ in self.FAMILIES] + \
            [CounterMetricFamily(*self.BETWEEN)]

    def collect(self):
        for (name, doc, _), buckets in zip(self.FAMILIES, (self._tokens, self._sequences, self._seconds)):
            yield buckets.family(name, doc)
        yield CounterMetricFamily(*self.BETWEEN, value=self.between)


class ServerMetrics:
    def __init__(self, role: str, leases=None, *, name: str = "", model: str = "", backend: str = "",
                 version: str = ""):
        r = self.registry = CollectorRegistry()
        Info("disagg_server", "What this server is: one model, one role", registry=r).info(
            {"name": name, "role": role, "model": model, "backend": backend, "version": version})
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
        self.decode_only = Counter("disagg_decode_only", "Whole generations on this server (/generate)", registry=r)
        self.completion_tokens = Counter("disagg_completion_tokens", "Tokens generated by this server (rate() of it "
                                         "is the server's aggregate decode speed)", registry=r)
        self.reasoning_tokens = Counter("disagg_reasoning_tokens", "Of the tokens generated, those a reasoning "
                                        "model reasoned with (its analysis channel)", registry=r)
        self.reasoning_capped = Counter("disagg_reasoning_capped", "Generations whose reasoning reached its budget "
                                        "and were moved on to the answer", registry=r)
        self.prompt_tokens_cached = Counter("disagg_prompt_tokens_cached", "Prompt tokens not evaluated because a "
                                            "free slot still held their KV (the prefix cache)", registry=r)
        self.prompt_tokens_evaluated = Counter("disagg_prompt_tokens_evaluated", "Prompt tokens this server "
                                               "evaluated (cached / (cached + evaluated) is the prefix cache's "
                                               "hit share)", registry=r)
        # speculative decoding (backends/speculate.py): accepted / draft is the drafts' acceptance; each
        # accepted token is a model step saved
        self.draft_tokens = Counter("disagg_draft_tokens", "Guessed tokens verified by speculative decoding",
                                    registry=r)
        self.accepted_tokens = Counter("disagg_accepted_tokens", "Guessed tokens that speculative decoding kept "
                                       "(each one a model step saved)", registry=r)
        self.queue_seconds = Histogram("disagg_queue_seconds", "Time a request waited for a slot",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.slow_transfers = Counter("disagg_slow_kv_transfers", "KV transfers slower than the warning threshold",
                                      registry=r)
        # per prefill server a decode server pulls from: what the handoffs moved, and the last probe of the
        # path (disagg doctor: POST /kv/probe); rate(bytes) / rate(seconds) is the pulls' throughput
        self.kv_pull_bytes = Counter("disagg_kv_pull_bytes", "KV bundle bytes pulled, by prefill server (host:port)",
                                     ["source"], registry=r)
        self.kv_pull_seconds = Counter("disagg_kv_pull_seconds", "Time spent pulling KV bundles, by prefill server",
                                       ["source"], registry=r)
        self.kv_probe_speed = Gauge("disagg_kv_probe_bytes_per_second", "Throughput of the last probe pull from "
                                    "a prefill server (disagg doctor): the path's measured capacity", ["source"],
                                    registry=r)
        self.kv_probe_time = Gauge("disagg_kv_probe_timestamp_seconds", "When that probe ran (Unix time)",
                                   ["source"], registry=r)
        self.probes: dict = {}  # source -> the last probe's figures (for /health)
        # the handoff canary (kv/canary.py): on a decode server, checks by result (passed, failed, absent,
        # unavailable) and failures on their own; on a prefill server, what making a canary costs
        self.canary_checks = Counter("disagg_canary_checks", "Handoff canaries checked, by result", ["result"],
                                     registry=r)
        self.canary_failures = Counter("disagg_canary_failures", "Handoffs refused because the imported KV did not "
                                       "reproduce the prefill's next-token distribution", registry=r)
        self.canary_divergence = Histogram("disagg_canary_divergence", "Max abs log-prob difference of a handoff's "
                                           "canary", buckets=(0, 1e-6, 1e-3, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5),
                                           registry=r)
        self.canary_seconds = Histogram("disagg_canary_seconds", "Prefill side: evaluating the last prompt token "
                                        "for the canary", buckets=LATENCY_BUCKETS, registry=r)
        if leases is not None:
            Gauge("disagg_leases_held", "KV bundles held under a lease", registry=r).set_function(
                lambda: leases.stats()["held"])
            Gauge("disagg_lease_bytes", "Bytes of KV held under leases", registry=r).set_function(
                lambda: leases.stats()["bytes"])
        r.register(EnergyCollector())
        self._resources = {}
        for name, doc in (("process_rss_bytes", "Resident memory of the server process"),
                          ("process_cpu_pct", "CPU use of the server process, percent"),
                          ("gpu_utilization_pct", "GPU utilisation, percent (first device)"),
                          ("gpu_memory_used_bytes", "GPU (or unified) memory in use")):
            self._resources[name] = Gauge(f"disagg_{name}", doc, registry=r)
        self.role = role
        self.prompt_speed = None  # tokens/s of prompt evaluation here, moving average (for /health)

    def observe_prompt_speed(self, speed) -> None:
        """A prompt this server evaluated (a prefill, or a decode server's own ``/generate``)."""
        if speed:
            self.prompt_speed = speed if self.prompt_speed is None else 0.7 * self.prompt_speed + 0.3 * speed

    def watch_owner(self, owner) -> None:
        """Slots, queue and batch figures of the model's owner, read when scraped."""
        r = self.registry
        Gauge("disagg_slots_total", "Requests the model serves at once", registry=r).set_function(lambda: owner.slots)
        Gauge("disagg_slots_busy", "Slots held by requests now", registry=r).set_function(
            lambda: owner.slot_stats()["busy"])
        Gauge("disagg_queue_depth", "Requests waiting for a slot", registry=r).set_function(lambda: owner.queued)
        steps = StepCollector()
        r.register(steps)
        owner.on_step = steps.on_step

    def watch_receive_buffers(self, pool) -> None:
        Gauge("disagg_receive_buffer_idle_bytes", "Bytes of freed KV receive buffers kept for reuse",
              registry=self.registry).set_function(pool.idle_bytes)

    def observe_prefill(self, figures: ServerFigures, kv_bytes: int) -> None:
        """A /prefill this server answered, with the backend's metrics and the bundle's size."""
        self.prefill_seconds.observe(figures.prefill_time or 0.0)
        if figures.prompt_tokens_cached:
            self.prompt_tokens_cached.inc(figures.prompt_tokens_cached)
        if figures.prompt_tokens_evaluated:
            self.prompt_tokens_evaluated.inc(figures.prompt_tokens_evaluated)
        if figures.prefill_speed:
            self.prefill_speed.observe(figures.prefill_speed)
            self.observe_prompt_speed(figures.prefill_speed)
        if figures.canary_ms is not None:
            self.canary_seconds.observe(figures.canary_ms / 1000)
        self.kv_bytes.inc(kv_bytes)

    def observe_pull(self, url: str, n_bytes: int, seconds: float) -> None:
        """A KV bundle this decode server pulled from ``url``."""
        source = kv_source(url)
        self.kv_bytes.inc(n_bytes)
        self.kv_transfer_seconds.observe(seconds)
        self.kv_pull_bytes.labels(source=source).inc(n_bytes)
        self.kv_pull_seconds.labels(source=source).inc(seconds)

    def observe_probe(self, url: str, result: dict) -> None:
        """A probe pull (``POST /kv/probe``) from ``url``: the path's capacity as last measured."""
        source = kv_source(url)
        if result.get("bytes_per_second"):
            self.kv_probe_speed.labels(source=source).set(result["bytes_per_second"])
            self.kv_probe_time.labels(source=source).set(time.time())
            self.probes[source] = {"bytes_per_second": result["bytes_per_second"], "bytes": result.get("bytes"),
                                   "measured_at": time.time()}

    def observe_decode(self, figures: ServerFigures) -> None:
        if figures.decode_time is not None:
            self.decode_seconds.observe(figures.decode_time)
        if figures.decode_speed:
            self.decode_speed.observe(figures.decode_speed)
        if figures.ttft is not None:
            self.ttft.observe(figures.ttft)
        if figures.method:
            self.handoffs.labels(method=figures.method.value).inc()
        if figures.completion_tokens:
            self.completion_tokens.inc(figures.completion_tokens)
        if figures.reasoning_tokens:
            self.reasoning_tokens.inc(figures.reasoning_tokens)
        if figures.reasoning_capped:
            self.reasoning_capped.inc()
        if figures.queue_time is not None:
            self.queue_seconds.observe(figures.queue_time)
        if figures.prefill_speed:
            self.observe_prompt_speed(figures.prefill_speed)
        if figures.prompt_tokens_cached:
            self.prompt_tokens_cached.inc(figures.prompt_tokens_cached)
        if figures.prompt_tokens_recomputed:
            self.prompt_tokens_evaluated.inc(figures.prompt_tokens_recomputed)
        if figures.canary:
            self.canary_checks.labels(result=figures.canary).inc()
        if figures.canary_divergence is not None:
            self.canary_divergence.observe(figures.canary_divergence)
        if figures.draft_tokens:
            self.draft_tokens.inc(figures.draft_tokens)
        if figures.accepted_tokens:
            self.accepted_tokens.inc(figures.accepted_tokens)

    def observe_canary_failure(self, divergence) -> None:
        self.canary_failures.inc()
        self.canary_checks.labels(result="failed").inc()
        if divergence is not None:
            self.canary_divergence.observe(divergence)

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
