"""Concurrent requests report what was measured: request time in wall time, never a speedup (issue 12 §2)."""
import threading
import time

import pytest

from disaggregated_inference.client import DisaggregatedClient, describe_overlap, overlap_figures


class SerializingClient(DisaggregatedClient):
    """The real ``generate_many`` over a ``generate`` that one lock serializes, as one server thread would."""

    def __init__(self, seconds: float):
        self.seconds, self.lock = seconds, threading.Lock()

    def generate(self, **kwargs):
        started = time.perf_counter()
        with self.lock:  # the second request waits for the first: they cannot overlap
            time.sleep(self.seconds)
        return "ok", {"total_time": time.perf_counter() - started}


def test_two_requests_that_cannot_overlap_claim_no_speedup():
    results, combined = SerializingClient(0.2).generate_many([{"prompt": "a"}, {"prompt": "b"}])
    assert [r[0] for r in results] == ["ok", "ok"]
    assert "speedup" not in combined and "sequential_time" not in combined
    assert combined["wall_time"] >= 0.4  # serialized: no time was saved
    # the second request's time includes its wait: 0.2 + 0.4 s of request time in 0.4 s of wall time
    assert combined["request_time"] == pytest.approx(0.6, abs=0.1)
    assert combined["overlap"] == pytest.approx(combined["request_time"] / combined["wall_time"], abs=1e-3)
    text = describe_overlap(combined)
    assert "of request time in" in text and "requests in flight" in text and "speedup" not in text


def test_overlap_figures_without_time():
    assert overlap_figures(0.0, 0.0) == {"request_time": 0.0, "wall_time": 0.0, "overlap": None}
    assert describe_overlap(overlap_figures(3.0, 2.0)) == \
        "3.00 s of request time in 2.00 s of wall time (1.50 requests in flight on average)"
