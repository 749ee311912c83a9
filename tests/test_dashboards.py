"""The operators' views against the session's real gunicorn servers and gateway: the Grafana dashboard's
queries name metrics the servers really export, ``disagg top`` draws them, the link capacity ``disagg
doctor`` measures is kept by the decode servers (all on the tiny-model cluster: what a model answers does
not matter here), and the demo gives the base-model stand-in a text to continue (the packaged models).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from disaggregated_inference import config as cluster_config
from disaggregated_inference.client import DisaggregatedClient
from disaggregated_inference.observe import figures, sampler as sampler_module
from disaggregated_inference.ops import cli
from disaggregated_inference.ops.doctor import Doctor

from .conftest import patient

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = {"counter": ("", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",), "summary": ("", "_sum", "_count", "_created"), "untyped": ("",), "info": ("",)}
# series that exist only after an event the cluster has no reason to see here
EVENT_ONLY = {"disagg_gateway_fallbacks_total"}
# made by Prometheus itself for every scrape target
SYNTHETIC = {"up"}


def exported(text: str) -> tuple[set, set]:
    """(every sample name the exposition declares, the names that have at least one sample now)."""
    declared = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        # a counter is declared with its _total (text format 0.0.4 as prometheus_client writes it)
        declared |= {name + suffix for suffix in SUFFIXES.get(kind, ("",))}
    sampled = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{| )", text, re.M))
    return declared, sampled


def queried_names(dashboard: dict) -> set:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)]
    keywords = {"sum", "by", "on", "rate", "increase", "histogram_quantile", "group_left", "max", "le",
                "label_values", "job", "instance"}
    names = set()
    for expr in exprs:
        expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", " ", expr)  # label matchers, ranges, strings
        names |= {w for w in re.findall(r"\b[a-zA-Z_][a-zA-Z0-9_]*\b", expr)
                  if w not in keywords and not re.fullmatch(r"e\d+", w)}
    return names - {"model", "name", "source", "method", "result", "outcome", "stream"}  # labels in by()/on()


@pytest.fixture(scope="module")
def traffic(tiny_cluster, tiny_gateway, http):
    """One request per model through the client, one streamed through the gateway, one link probe each."""
    with DisaggregatedClient(tiny_cluster.config, health_check=False) as client:
        for model in ("qwen", "gpt-oss"):
            client.generate(model, "Name one colour.", max_tokens=4, seed=0)
        history = list(client.history)
    with http.post(f"{tiny_gateway}/v1/chat/completions", stream=True, timeout=120,
                   json={"model": "qwen", "stream": True, "max_tokens": 4,
                         "messages": [{"role": "user", "content": "Say hi."}]}) as resp:
        assert resp.status_code == 200
        assert b"[DONE]" in b"".join(resp.iter_content(None))
    pairs = Doctor(cluster_config.coerce(tiny_cluster.config), probe_bytes=1 << 20).measure_links()
    return history, pairs


def test_every_metric_the_grafana_dashboard_queries_is_exported(tiny_cluster, tiny_gateway, http, traffic):
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "disagg.json").read_text())
    declared, sampled = set(), set()
    texts = {p.entry.name: http.get(f"{p.url}/metrics", timeout=10).text for p in tiny_cluster.processes}
    texts["gateway"] = http.get(f"{tiny_gateway}/metrics", timeout=10).text
    for text in texts.values():
        d, s = exported(text)
        declared |= d
        sampled |= s
    wanted = queried_names(dashboard)
    assert {"disagg_prefill_seconds_bucket", "disagg_kv_probe_bytes_per_second", "disagg_server_info",
            "disagg_gateway_time_to_first_token_seconds_bucket"} <= wanted  # the parse finds them
    assert sorted(wanted - declared - SYNTHETIC) == []
    assert sorted(wanted - sampled - SYNTHETIC - EVENT_ONLY) == []  # and they have data after the traffic
    # the per-model join: every server says which model and name it is
    for name, text in texts.items():
        if name != "gateway":
            info = re.search(r"^disagg_server_info\{([^}]*)\} 1\.0$", text, re.M)
            assert info and f'name="{name}"' in info.group(1) and 'model="' in info.group(1), name


def test_the_decode_servers_keep_the_doctor_s_probe_as_the_link_capacity(tiny_cluster, http, traffic):
    history, pairs = traffic
    assert {(p["prefill"], p["decode"]) for p in pairs if p.get("throughput_MB_s")} == {
        ("local-prefill-qwen", "local-decode-qwen"), ("local-prefill-gpt-oss", "local-decode-gpt-oss")}
    cfg = cluster_config.coerce(tiny_cluster.config)
    s = sampler_module.Sampler(cfg)
    try:
        newest = s.sweep()
    finally:
        s.stop()
    links = figures.server_links(newest, None, s.names)
    pair = links[("local-prefill-qwen", "local-decode-qwen")]
    measured = next(p for p in pairs if p["decode"] == "local-decode-qwen")["throughput_MB_s"]
    assert pair["capacity_gbps"] == pytest.approx(measured * 8 / 1000, rel=0.01) and pair["probed_at"]
    assert pair["kv_bytes"] > 0 and pair["gbps"] > 0  # the handoffs' pulls, by prefill server
    decode = next(p for p in tiny_cluster.processes if p.entry.name == "local-decode-qwen")
    probes = http.get(f"{decode.url}/health", timeout=10).json()["kv_probes"]
    assert [round(v["bytes_per_second"] / 1e6, 1) for v in probes.values()] == [measured]
    # the client's own view of the same pairs, by name
    mine = figures.handoff_links(history, s.names)
    assert ("local-prefill-qwen", "local-decode-qwen") in mine and mine[("local-prefill-qwen",
                                                                        "local-decode-qwen")]["gbps"] > 0


def test_disagg_top_once_draws_the_live_cluster(tiny_cluster, traffic, tmp_path, capsys):
    config = tmp_path / "cluster.json"
    config.write_text(json.dumps(tiny_cluster.config))
    assert cli.main(["top", "--config", str(config), "--once"]) == 0
    frame = capsys.readouterr().out
    assert "since the servers started" in frame
    for name in ("local-prefill-qwen", "local-decode-gpt-oss", "local-prefill-qwen -> local-decode-qwen"):
        assert name in frame
    qwen = next(line for line in frame.splitlines() if line.startswith("qwen "))
    assert re.search(r"\d+ ms|\d\.\d\d s", qwen), qwen  # percentiles, from the servers' histograms


def test_the_demo_gives_the_base_model_a_text_to_continue(cluster):
    with DisaggregatedClient(patient(cluster.config), health_check=False) as client:
        base = cli.base_models(client)
        assert base == {"gpt-oss"}  # Gemma 3 270M's GGUF has no chat template; SmolLM2-Instruct's has one
        job = cli.demo_job("gpt-oss", True, 24)
        assert job["raw"] and job["prompt"] == cli.DEMO_COMPLETION["prompt"]
        text, _ = client.generate(**job)
    assert "data" in text.lower(), text  # it goes on about what pandas is for
