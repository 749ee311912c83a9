"""Concurrent load on the local tiny_cluster: every request answered, none lost or duplicated, leases freed."""
from __future__ import annotations

import re
import time
from collections import Counter

import pytest

from disaggregated_inference.client import DisaggregatedClient
from disaggregated_inference.errors import DisaggError

pytestmark = pytest.mark.slow

N_REQUESTS, N_THREADS = 100, 8


def decode_ok_count(http, url) -> float:
    """Successful /decode answers so far, read off the server's Prometheus counter."""
    text = http.get(f"{url}/metrics").text
    match = re.search(r'^disagg_requests_total\{endpoint="decode",status="200"\} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def test_hundred_requests_from_eight_threads_across_both_models(tiny_cluster, tiny_urls, http):
    decode_urls = [tiny_urls["local-decode-qwen"], tiny_urls["local-decode-gpt-oss"]]
    before = sum(decode_ok_count(http, u) for u in decode_urls)
    jobs = [{"model": ("qwen3-coder:30b", "gpt-oss:120b")[i % 2], "prompt": f"Request {i}: say OK.",
             "max_tokens": 3, "seed": i} for i in range(N_REQUESTS)]
    with DisaggregatedClient(tiny_cluster.config, health_check=False) as client:
        results, combined = client.generate_many(jobs, max_workers=N_THREADS)
        history = list(client.history)

    assert len(results) == N_REQUESTS
    failures = [r for r in results if not isinstance(r, tuple)]
    assert all(isinstance(f, DisaggError) for f in failures), failures  # a clear error, never a crash
    assert not failures, f"{len(failures)} requests failed: {failures[:3]}"
    assert {m["method"] for _, m in results} == {"kv_handoff"}
    by_model = Counter(h["model"] for h in history)
    assert by_model == {"qwen": N_REQUESTS // 2, "gpt-oss": N_REQUESTS // 2}
    # none duplicated: the decode servers answered exactly one successful /decode per request
    assert sum(decode_ok_count(http, u) for u in decode_urls) - before == N_REQUESTS
    # every lease given back: a prefill server releases one once the last byte of its bundle is sent, on its
    # own thread, which a busy machine may run after the decode server has already answered
    deadline = time.monotonic() + 30
    for name in ("local-prefill-qwen", "local-prefill-gpt-oss"):
        while (held := http.get(f"{tiny_urls[name]}/health").json()["leases"]["held"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert held == 0, f"{name} still holds {held} leases 30 s after the last answer"
    assert combined["requests"] == N_REQUESTS and combined["failed"] == 0
