"""Request handling through Flask's test client, on the real SmolLM2: auth, /metrics, /health."""
from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from disaggregated_inference.server import decode
from disaggregated_inference.server import prefill

TOKEN = "s3cret-token"


def wait_loaded(client, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        body = client.get("/health").get_json()
        if body["loaded"]:
            return body
        time.sleep(0.1)
    raise AssertionError(f"model did not load: {body}")


@pytest.fixture(scope="module")
def prefill_client():
    app = prefill.create_app({"name": "test-prefill", "api_token": TOKEN,
                              "model": {"model": "smollm2", "name": "qwen", "n_threads": 2}})
    client = app.test_client()
    wait_loaded(client)
    return client


@pytest.fixture(scope="module")
def decode_client():
    app = decode.create_app({"name": "test-decode", "model": {"model": "smollm2", "name": "qwen", "n_threads": 2}})
    client = app.test_client()
    wait_loaded(client)
    return client


def auth(token=TOKEN):
    return {"Authorization": f"Bearer {token}"}


def test_health_describes_model_backend_handoff_and_resources(prefill_client):
    body = prefill_client.get("/health").get_json()
    assert body["status"] == "healthy" and body["loaded"] is True and body["role"] == "prefill"
    assert body["model"] == "smollm2" and body["model_key"] == "qwen"  # the served model's name, then the key
    assert body["backend"] == "llama_cpp" and body["handoff"] == "llama_seq_state"
    assert body["model_info"]["model_file"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert body["leases"]["held"] == 0
    assert body["resources"]["process_rss_bytes"] > 50_000_000
    assert "gpu" in body["resources"]  # None on a machine without one, never a made-up zero


@pytest.mark.parametrize("headers", [{}, auth("wrong"), {"Authorization": TOKEN}])
def test_protected_endpoints_need_the_token(prefill_client, headers):
    for method, path in (("post", "/prefill"), ("get", "/kv/abc"), ("delete", "/kv/abc")):
        resp = getattr(prefill_client, method)(path, json={"prompt": "hi"}, headers=headers)
        assert resp.status_code == 401, (method, path)
        assert resp.get_json()["code"] == "unauthorized" and "Bearer" in resp.get_json()["error"]


def test_token_opens_the_door_and_health_and_metrics_stay_open(prefill_client):
    resp = prefill_client.post("/prefill", json={"prompt": "hi"}, headers=auth())
    assert resp.status_code == 200
    kv = resp.get_json()["kv"]
    assert prefill_client.get(f"/kv/{kv['handle']}", headers=auth()).status_code == 200
    assert prefill_client.get("/health").status_code == 200
    assert prefill_client.get("/metrics").status_code == 200


def metric_value(text: str, name: str, **labels) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def test_metrics_parse_as_prometheus_text_and_move_with_traffic(decode_client):
    before = decode_client.get("/metrics").get_data(as_text=True)
    list(text_string_to_metric_families(before))  # parses
    for _ in range(2):
        assert decode_client.post("/generate", json={"prompt": "Say hi.", "max_new_tokens": 3}).status_code == 200
    assert decode_client.post("/generate", json={"prompt": ""}).status_code == 400
    after = decode_client.get("/metrics").get_data(as_text=True)
    ok = "disagg_requests_total"
    assert metric_value(after, ok, endpoint="generate", status="200") == \
        metric_value(before, ok, endpoint="generate", status="200") + 2
    assert metric_value(after, ok, endpoint="generate", status="400") == \
        metric_value(before, ok, endpoint="generate", status="400") + 1
    assert metric_value(after, "disagg_decode_only_total") == metric_value(before, "disagg_decode_only_total") + 2
    assert metric_value(after, "disagg_decode_seconds_count") == metric_value(before, "disagg_decode_seconds_count") + 2
    assert metric_value(after, "disagg_handoffs_total", method="decode_only") >= 2
    assert metric_value(after, "disagg_process_rss_bytes") > 0


def test_prefill_metrics_count_kv_bytes_and_leases(prefill_client):
    before = prefill_client.get("/metrics").get_data(as_text=True)
    kv = prefill_client.post("/prefill", json={"prompt": "Count the leases."}, headers=auth()).get_json()["kv"]
    after = prefill_client.get("/metrics").get_data(as_text=True)
    assert metric_value(after, "disagg_kv_bytes_total") - metric_value(before, "disagg_kv_bytes_total") == kv["bytes"]
    assert metric_value(after, "disagg_leases_held") == metric_value(before, "disagg_leases_held") + 1
    assert metric_value(after, "disagg_lease_bytes") >= kv["bytes"]
    assert prefill_client.delete(f"/kv/{kv['handle']}", headers=auth()).status_code == 200
    assert prefill_client.get(f"/kv/{kv['handle']}", headers=auth()).status_code == 404


def test_grammar_constrained_output_is_valid_json_for_the_schema(decode_client):
    import json

    schema = {"type": "object", "properties": {"score": {"type": "integer"}, "reason": {"type": "string"}},
              "required": ["score", "reason"]}
    resp = decode_client.post("/generate", json={"prompt": "Rate this code from 1 to 5: print('hi')",
                                                 "json_schema": schema, "max_new_tokens": 60})
    body = resp.get_json()
    parsed = json.loads(body["generated_text"])
    assert isinstance(parsed["score"], int) and isinstance(parsed["reason"], str)
