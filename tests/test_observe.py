"""The dashboards' figures (observe/): from a client's history, and from real servers' Prometheus text.

The server-side figures are computed from what a real ``ServerMetrics`` renders (the code every server
runs for /metrics), parsed back; the sampler reads it over HTTP from a local stand-in that serves that
text. No model is loaded here; tests/test_doctor.py and tests/test_dashboards.py read live servers.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from disaggregated_inference import config as cluster_config
from disaggregated_inference.observe import figures, sampler as sampler_module, scrape, top
from disaggregated_inference.server.metrics import ServerMetrics
from disaggregated_inference.metrics import ServerFigures

ROOT = Path(__file__).resolve().parents[1]


def owner(busy=0, queued=0, slots=4):
    return SimpleNamespace(slots=slots, queued=queued, slot_stats=lambda: {"busy": busy, "total": slots},
                           on_step=None)


def reading(name, role, model, metrics: ServerMetrics, at: float) -> scrape.Reading:
    return scrape.Reading(name, role, model, f"http://{name}", at, {"status": "healthy", "loaded": True,
                                                                    "slots": {"busy": 1, "total": 4}, "queued": 0},
                          scrape.parse_metrics(metrics.render().decode()))


def servers():
    pre = ServerMetrics("prefill", name="p", model="qwen", backend="llama_cpp")
    dec = ServerMetrics("decode", name="d", model="qwen", backend="llama_cpp")
    pre.watch_owner(owner())
    dec.watch_owner(owner(busy=2, queued=1))
    return pre, dec


def sweep(pre, dec, at):
    return sampler_module.Sweep(at, [reading("p", "prefill", "qwen", pre, at), reading("d", "decode", "qwen", dec, at)])


def test_quantiles_as_numpy_and_promql_compute_them():
    assert figures.quantile([4, 1, 3, 2], 0.5) == 2.5
    assert figures.quantile([1, 2, 3, 4], 0.95) == pytest.approx(3.85)
    assert figures.quantile([], 0.5) is None and figures.spread([None, 2.0]) == {"p50": 2.0, "p95": 2.0, "n": 1}
    cumulative = [(0.1, 0.0), (0.5, 5.0), (1.0, 10.0), (float("inf"), 10.0)]
    assert figures.histogram_quantile(0.5, cumulative) == pytest.approx(0.5)
    assert figures.histogram_quantile(0.75, cumulative) == pytest.approx(0.75)
    # the rank in +Inf: the largest finite bound, as PromQL answers
    assert figures.histogram_quantile(0.99, [(1.0, 1.0), (float("inf"), 10.0)]) == 1.0
    assert figures.histogram_quantile(0.5, [(1.0, 0.0), (float("inf"), 0.0)]) is None


def test_figures_of_a_client_history_count_failures_apart_and_fallbacks_as_such():
    t = 1000.0
    history = [
        {"time": t, "model": "qwen", "method": "kv_handoff", "prefill_time": 0.2, "prefill_speed": 1000.0,
         "decode_time": 1.0, "decode_speed": 50.0, "total_time": 1.3, "completion_tokens": 50,
         "ttft_end_to_end": 0.3, "kv_bytes": 10_000_000, "kv_transfer_time": 0.01,
         "prefill_server": "10.0.0.1:8100", "decode_server": "10.0.0.2:8101"},
        {"time": t + 1, "model": "qwen", "method": "kv_handoff", "prefill_time": 0.4, "prefill_speed": 500.0,
         "decode_time": 2.0, "decode_speed": 25.0, "total_time": 2.5, "completion_tokens": 50,
         "ttft_end_to_end": 0.5, "kv_bytes": 10_000_000, "kv_transfer_time": 0.04,
         "prefill_server": "10.0.0.1:8100", "decode_server": "10.0.0.2:8101"},
        {"time": t + 2, "model": "gpt-oss", "method": "decode_only_fallback", "prefill_time": 0.5,
         "decode_time": 1.5, "decode_speed": 20.0, "total_time": 2.0, "completion_tokens": 30, "kv_bytes": 0,
         "prefill_server": None, "decode_server": "10.0.0.3:8103"},
        {"time": t + 3, "model": "gpt-oss", "error": "upstream_timeout", "total_time": 180.0},
    ]
    per_model = figures.request_figures(history)
    assert per_model["qwen"]["requests"] == 2 and per_model["qwen"]["failed"] == 0
    assert per_model["qwen"]["prefill_time"] == {"p50": pytest.approx(0.3), "p95": pytest.approx(0.39), "n": 2}
    assert per_model["qwen"]["ttft_end_to_end"]["p50"] == pytest.approx(0.4)
    assert per_model["gpt-oss"]["requests"] == 1 and per_model["gpt-oss"]["failed"] == 1
    assert figures.method_mix(history) == {"kv_handoff": 2, "recompute": 0, "decode_only": 0, "fallback": 1}
    both = figures.combined_throughput(history)  # first start 998.5 to last end 1002; not the failure
    assert both["completion_tokens"] == 130 and both["wall_time"] == pytest.approx(3.5)
    assert both["tokens_per_second"] == pytest.approx(130 / 3.5)
    links = figures.handoff_links(history, {"10.0.0.1:8100": "dgx1", "10.0.0.2:8101": "mac2"})
    assert list(links) == [("dgx1", "mac2")]
    link = links[("dgx1", "mac2")]
    assert link["handoffs"] == 2 and link["gbps"] == pytest.approx(20e6 * 8 / 0.05 / 1e9)
    assert link["gbps_p50"] == pytest.approx((8.0 + 2.0) / 2)  # 8 Gb/s and 2 Gb/s
    points = figures.request_points(history)
    assert {(p["model"], p["phase"]) for p in points} == {("qwen", "prefill"), ("qwen", "decode"),
                                                          ("gpt-oss", "prefill"), ("gpt-oss", "decode")}
    assert len(figures.recent(history, now=t + 3, window=1.5)) == 2


def test_server_figures_are_the_window_s_increase_of_real_server_metrics():
    pre, dec = servers()
    pre.observe_prefill(ServerFigures.of(prefill_time=9.0, prefill_speed=10.0, prompt_tokens_evaluated=100), 1000)
    dec.observe_decode(ServerFigures.of(decode_time=9.0, method="kv_handoff", completion_tokens=500, canary="passed"))
    baseline = sweep(pre, dec, 100.0)
    for time_s in (0.2, 0.3, 0.4):  # within the window: only these count
        pre.observe_prefill(ServerFigures.of(prefill_time=time_s, prefill_speed=1000.0, prompt_tokens_evaluated=30,
                             prompt_tokens_cached=70), 2000)
    dec.observe_decode(ServerFigures.of(decode_time=1.5, decode_speed=40.0, ttft=0.08, method="kv_handoff",
                        completion_tokens=60, canary="passed"))
    dec.observe_decode(ServerFigures.of(decode_time=1.5, decode_speed=40.0, method="decode_only", completion_tokens=40,
                        prompt_tokens_recomputed=10))
    dec.observe_canary_failure(0.7)
    dec.observe_pull("http://10.0.0.1:8100/kv/abc", 50_000_000, 0.05)
    dec.observe_probe("http://10.0.0.1:8100/kv/probe?bytes=4194304", {"bytes_per_second": 1.25e9, "bytes": 4194304})
    newest = sweep(pre, dec, 110.0)

    f = figures.server_model_figures(newest, baseline)["qwen"]
    assert f["requests"] == 2 and f["completion_tokens"] == 100 and f["tokens_per_second"] == pytest.approx(10.0)
    assert f["prefill_time"]["n"] == 3 and 0.25 <= f["prefill_time"]["p50"] <= 0.5  # not the 9 s before
    assert f["decode_time"]["p50"] == pytest.approx(1.0 + (2.5 - 1.0) * 1 / 2)  # rank 1 of 2 in the 1..2.5 s bucket
    assert f["prefix_cache"] == {"cached": 210.0, "evaluated": 100.0, "share": pytest.approx(210 / 310)}
    since_start = figures.server_model_figures(newest, None)["qwen"]
    assert since_start["requests"] == 3 and since_start["tokens_per_second"] is None
    assert figures.server_method_mix(newest, baseline) == {"kv_handoff": 1.0, "recompute": 0.0, "decode_only": 1.0}
    canary = figures.canary_figures(newest, baseline)
    assert canary["passed"] == 1 and canary["failed"] == 1 and canary["refused"] == 1
    links = figures.server_links(newest, baseline, {"10.0.0.1:8100": "p"})
    assert links[("p", "d")]["gbps"] == pytest.approx(8.0) and links[("p", "d")]["capacity_gbps"] == 10.0
    rows = figures.link_rows({}, links)
    assert rows[0]["utilisation"] == pytest.approx(0.8) and rows[0]["handoffs"] == 0
    (p_row, d_row) = figures.server_rows(newest)
    assert d_row["name"] == "d" and d_row["state"] == "healthy" and d_row["busy"] == 1
    series = figures.throughput_series([baseline, newest])
    assert series == [{"time": 110.0, "model": "qwen", "tokens_per_second": pytest.approx(10.0)},
                      {"time": 110.0, "model": figures.COMBINED, "tokens_per_second": pytest.approx(10.0)}]
    assert {(r["server"], r["busy"], r["queued"]) for r in figures.slot_series([newest])} == {("p", 0, 0), ("d", 2, 1)}
    frame = top.render(newest, baseline, {"10.0.0.1:8100": "p"})
    assert "figures over the last 10 s" in frame and "p -> d" in frame and "10.00" in frame  # capacity, Gb/s
    assert "handoffs refused: 1" in frame and "68%" in frame  # the prefix cache's share


def test_a_restarted_server_s_counters_count_from_zero():
    pre, dec = servers()
    dec.observe_decode(ServerFigures.of(completion_tokens=500))
    before = sweep(pre, dec, 0.0)
    pre, dec = servers()  # a restart: the counters start again
    dec.observe_decode(ServerFigures.of(completion_tokens=20))
    after = sweep(pre, dec, 10.0)
    assert figures.server_model_figures(after, before)["qwen"]["completion_tokens"] == 20


def test_the_owners_steps_and_the_time_between_them_are_exported():
    """An operator reads the model's share of the owner's time: step seconds over steps plus what lies between."""
    metrics, o = ServerMetrics("decode", name="d", model="qwen"), owner(busy=2)
    metrics.watch_owner(o)
    o.on_step(2, 2, 0.020, None)  # the first step after the owner had nothing to step
    o.on_step(2, 2, 0.022, 0.001)
    o.on_step(3, 30, 0.150, 0.002)
    got = scrape.parse_metrics(metrics.render().decode())
    assert scrape.total(got, "disagg_step_seconds_count") == 3
    assert scrape.total(got, "disagg_step_seconds_sum") == pytest.approx(0.192)
    assert scrape.total(got, "disagg_between_steps_seconds_total") == pytest.approx(0.003)
    assert scrape.total(got, "disagg_batch_tokens_sum") == 34


def test_the_step_histograms_read_as_prometheus_client_s_own_would():
    """The owner's step figures are kept in plain lists (``StepCollector``); a scrape must not tell them from
    prometheus_client's histograms fed the same values, bucket bounds included (a value on a bound is in it)."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from disaggregated_inference.server.metrics import StepCollector

    steps, reference = StepCollector(), CollectorRegistry()
    hists = [Histogram(name, doc, buckets=bounds, registry=reference) for name, doc, bounds in steps.FAMILIES]
    between = Counter(*steps.BETWEEN, registry=reference)
    for n_seq, n_tok, seconds, gap in [(1, 1, 0.002, None), (4, 4, 0.0231, 0.0004), (2, 512, 0.9, 0.001),
                                       (64, 2048, 5.0, 0.0), (80, 4000, 7.5, 0.25), (3, 3, 0.02, None)]:
        steps.on_step(n_seq, n_tok, seconds, gap)
        for hist, value in zip(hists, (n_tok, n_seq, seconds)):
            hist.observe(value)
        if gap is not None:
            between.inc(gap)
    ours = CollectorRegistry()
    ours.register(steps)

    def samples(registry):
        return sorted(line for line in generate_latest(registry).decode().splitlines()
                      if line and not line.startswith("#") and "_created" not in line)
    assert samples(ours) == samples(reference)
    assert any(line.startswith('disagg_step_seconds_bucket{le="0.002"} 1.0') for line in samples(ours))


def test_the_sampler_keeps_whole_sweeps_as_baselines_and_thins_the_rest(bytes_server):
    """Read over HTTP from the session's stand-in server, which answers as a decode server would."""
    metrics = ServerMetrics("decode", name="d", model="qwen")
    metrics.watch_owner(owner(busy=1))
    bytes_server("/health", json.dumps({"status": "healthy", "loaded": True, "slots": {"busy": 1, "total": 4},
                                        "queued": 0}).encode())
    host, port = bytes_server.address.rsplit(":", 1)
    cfg = cluster_config.coerce({"models": {"qwen": {"model": "smollm2"}}, "prefill_servers": [],
                                 "decode_servers": [{"name": "d", "host": host, "port": int(port), "model": "qwen"},
                                                    {"name": "gone", "host": "127.0.0.1", "port": 9, "model": "qwen"}]})
    clock = iter(range(0, 1000, 2))
    s = sampler_module.Sampler(cfg, keep_seconds=30, anchor_seconds=15, timeout=2, clock=lambda: float(next(clock)))
    try:
        for _ in range(11):  # t = 0, 2, ..., 20
            metrics.completion_tokens.inc(10)
            bytes_server("/metrics", metrics.render())
            s.sweep()
        sweeps = s.sweeps()
        assert [x.time for x in sweeps if x.whole] == [0.0, 16.0, 20.0]
        thinned = sweeps[1].readings[0]
        assert {k[0] for k in thinned.metrics} <= set(sampler_module.CHART_SAMPLES) and thinned.metrics
        assert s.baseline(10).time == 16.0 and s.baseline(100).time == 0.0
        newest = s.latest()
        assert [r.state for r in newest.readings] == ["healthy", "down"] and newest.readings[1].error
        # the thinned sweeps still draw the throughput chart: 10 tokens per 2 s
        assert figures.throughput_series(sweeps)[-1] == {"time": 20.0, "model": figures.COMBINED,
                                                          "tokens_per_second": pytest.approx(5.0)}
        for _ in range(10):  # t = 22 .. 40: t = 0 falls out of the 30 s kept
            s.sweep()
        assert s.sweeps()[0].time >= 10.0
    finally:
        s.stop()


def test_the_client_s_history_holds_the_requests_no_server_could_serve():
    from disaggregated_inference.client import DisaggregatedClient, FallbackWarning
    from disaggregated_inference.errors import NoServerAvailable

    cfg = {"models": {"qwen": {"model": "smollm2"}}, "prefill_servers": [],
           "decode_servers": [{"name": "gone", "host": "127.0.0.1", "port": 9, "model": "qwen"}],
           "client": {"health_check_interval": 0, "connect_timeout": 1}}
    with DisaggregatedClient(cfg, health_check=False) as client:
        with pytest.raises(NoServerAvailable), pytest.warns(FallbackWarning):  # no prefill server: decode-only
            client.generate("qwen", "hello", max_tokens=2)
    (record,) = client.history
    assert record["model"] == "qwen" and record["error"] == "no_server_available" and record["total_time"] >= 0
    assert figures.request_figures(client.history)["qwen"]["failed"] == 1


def test_the_grafana_dashboard_is_well_formed():
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "disagg.json").read_text())
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    names = {v["name"] for v in dashboard["templating"]["list"]}
    assert names == {"datasource", "job"}
    for p in panels:
        assert 0 <= p["gridPos"]["x"] and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)) and all(t["expr"].strip() for t in p["targets"]), p["title"]
    titles = " | ".join(p["title"] for p in panels)
    for wanted in ("Prefill time", "Decode speed", "Time to first token", "Decode tokens/s, combined",
                   "Slots busy and queue depth", "How requests were served", "Canary", "Prefix cache",
                   "KV link throughput against capacity", "Owner's time in model steps"):
        assert wanted in titles
