"""Read one server: its ``/health`` (JSON) and its ``/metrics`` (Prometheus text) into a ``Reading``.

A parsed scrape is a dict ``{(sample name, ((label, value), ...)): value}`` (labels sorted); the
helpers below sum over the labels a question does not name, as PromQL's ``sum`` would.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import requests
from prometheus_client.parser import text_string_to_metric_families

Scrape = dict


def parse_metrics(text: str, prefix: str = "disagg_") -> Scrape:
    """The samples of a Prometheus text exposition whose names start with ``prefix`` (ours: ``disagg_*``;
    llama-server's are ``llamacpp:*``)."""
    out: Scrape = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(prefix):
                out[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return out


def total(scrape: Scrape, name: str, **labels) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in scrape.items() if n == name and wanted <= set(ls))


def by_label(scrape: Scrape, name: str, label: str) -> dict:
    """``{value of label: sum of the samples with it}`` for the samples called ``name``."""
    out: dict = {}
    for (n, ls), v in scrape.items():
        if n == name:
            key = dict(ls).get(label)
            if key is not None:
                out[key] = out.get(key, 0.0) + v
    return out


def buckets(scrape: Scrape, histogram: str) -> list:
    """A histogram's cumulative buckets ``[(upper bound, count), ...]``, ascending, +Inf last."""
    counts = by_label(scrape, f"{histogram}_bucket", "le")
    return sorted((float(le), n) for le, n in counts.items())


@dataclass
class Reading:
    """One server at one moment: its place in the config, what its endpoints answered."""

    name: str
    role: str
    model: str
    url: str
    time: float
    health: dict = field(default_factory=dict)   # /health's body; {} when it did not answer
    metrics: Scrape = field(default_factory=dict)
    error: str | None = None

    @property
    def up(self) -> bool:
        return self.error is None and self.health.get("loaded") is True

    @property
    def state(self) -> str:
        """healthy, loading, degraded, unhealthy, or down (no answer)."""
        return "down" if self.error else str(self.health.get("status") or "unknown")


def read(entry, session: requests.Session, timeout: float = 3.0) -> Reading:
    """``entry`` (a config ``ServerEntry``) now: both endpoints, never raising for a server that is away."""
    reading = Reading(entry.name, entry.role, entry.model, entry.url, time.time())
    try:
        health = session.get(f"{entry.url}/health", timeout=timeout)
        reading.health = health.json()
        reading.metrics = parse_metrics(session.get(f"{entry.url}/metrics", timeout=timeout).text)
    except (requests.RequestException, ValueError) as exc:
        reading.error = f"{type(exc).__name__}"
    return reading
