"""The gateway's answers when the cluster cannot serve, and its edge checks (no models loaded).

A real ``DisaggregatedClient`` behind the gateway's app (``app.test_client()``), aimed at
ports where nothing listens, or at a socket that accepts and never answers.
"""
from __future__ import annotations

import io
import json
import socket

import pytest

from disaggregated_inference import config as cluster_config
from disaggregated_inference.errors import ConfigError
from disaggregated_inference.gateway.app import create_app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(prefill_port: int, decode_port: int, **extra) -> dict:
    return {"models": {"qwen": {"aliases": ["qwen3-coder:30b"]}},
            "prefill_servers": [{"name": "p", "host": "127.0.0.1", "port": prefill_port, "model": "qwen"}],
            "decode_servers": [{"name": "d", "host": "127.0.0.1", "port": decode_port, "model": "qwen"}],
            "client": {"health_check_interval": 0, "connect_timeout": 0.5, "decode_timeout": 0.5,
                       "prefill_timeout": 0.5, "retries": 0},
            # the decode servers' KV pulls must fit in the client's decode timeout (config check on load)
            "server": {"kv_fetch_timeout": 0.4, "kv_progress_timeout": 0.2},
            **extra}


@pytest.fixture()
def silent_server():
    """A socket that accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield sock.getsockname()[1]
    sock.close()


CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_no_server_able_to_serve_is_a_503_with_retry_after():
    app = create_app(_config(_free_port(), _free_port()))
    resp = app.test_client().post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 503
    assert int(resp.headers["Retry-After"]) >= 1
    assert resp.json["error"]["type"] == "server_error" and resp.json["error"]["code"] == "no_server_available"
    resp = app.test_client().post("/api/chat", json={"model": "qwen", "messages": CHAT["messages"]})  # streamed
    assert resp.status_code == 503 and set(resp.json) == {"error"}  # Ollama's shape


def test_a_decode_server_that_never_answers_is_a_504(silent_server):
    # no prefill server reachable: the client falls back to the decode server, which times out
    app = create_app(_config(_free_port(), silent_server))
    resp = app.test_client().post("/v1/completions", json={"model": "qwen", "prompt": "hi", "max_tokens": 2})
    assert resp.status_code == 504
    assert resp.json["error"]["message"]


def test_bad_bodies_are_400s_naming_the_field():
    app = create_app(_config(_free_port(), _free_port()))
    client = app.test_client()
    cases = [
        ("/v1/chat/completions", {**CHAT, "temperature": 9}, "temperature"),
        ("/v1/chat/completions", {**CHAT, "frobnicate": 1}, "frobnicate"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
        ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}]},
         "tools[0].function.name"),
        ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {**CHAT, "reasoning_effort": "maximal"}, "reasoning_effort"),
        ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ("/v1/completions", {"model": "qwen", "prompt": ["a", "b"]}, "prompt"),
        ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"model": "qwen", "prompt": "hi", "ignore_eos": "yes"}, "ignore_eos"),
        ("/v1/chat/completions", {**CHAT, "ignore_eos": True, "response_format": {"type": "json_object"}}, "ignore_eos"),
        ("/v1/chat/completions", {**CHAT, "speculation": "eagle"}, "speculation"),
        ("/v1/completions", {"model": "qwen", "prompt": "hi", "speculation": True}, "speculation"),
    ]
    for path, body, param in cases:
        resp = client.post(path, json=body)
        assert resp.status_code == 400, (body, resp.json)
        assert resp.json["error"]["param"] == param, resp.json
    resp = client.post("/api/chat", json={"model": "qwen", "messages": [{"role": "user", "content": "x",
                                                                         "images": ["aGk="]}]})
    assert resp.status_code == 400 and "images" in resp.json["error"]
    # curl -d sends JSON as a form: read as JSON all the same
    resp = client.post("/v1/chat/completions", data=json.dumps({**CHAT, "n": 3}),
                       content_type="application/x-www-form-urlencoded")
    assert resp.status_code == 400 and resp.json["error"]["param"] == "n"
    resp = client.post("/v1/chat/completions", data=b"{not json", content_type="application/json")
    assert resp.status_code == 400 and resp.json["error"]["param"] == "body"


def test_a_body_over_the_configured_size_is_a_413_naming_the_body_and_the_gateway_keeps_serving():
    cfg = _config(_free_port(), _free_port())
    cfg["server"]["max_request_bytes"] = 4096
    client = create_app(cfg).test_client()
    big = {"model": "qwen", "messages": [{"role": "user", "content": "x" * 10_000}]}
    for path in ("/v1/chat/completions", "/api/chat"):
        resp = client.post(path, data=json.dumps(big), content_type="application/json")
        assert resp.status_code == 413, resp.get_data(as_text=True)
        error = resp.get_json()["error"]
        if path.startswith("/v1"):
            assert error["param"] == "body" and "4096" in error["message"]
        else:
            assert "4096" in error
    assert client.get("/v1/models").status_code == 200
    # a chunked body (no Content-Length) over the limit too: was Werkzeug's own 413, typed server_error
    for path in ("/v1/chat/completions", "/api/chat"):
        resp = client.post(path, input_stream=io.BytesIO(json.dumps(big).encode()), content_type="application/json",
                           headers={"Transfer-Encoding": "chunked"}, environ_overrides={"wsgi.input_terminated": True})
        assert resp.status_code == 413, resp.get_data(as_text=True)
        error = resp.get_json()
        if path.startswith("/v1"):
            assert error["error"]["param"] == "body" and error["error"]["type"] == "invalid_request_error", error
        else:
            assert error["field"] == "body", error


def test_ollama_empty_prompt_only_loads_and_unknown_model_is_404():
    client = create_app(_config(_free_port(), _free_port())).test_client()
    resp = client.post("/api/generate", json={"model": "qwen3-coder:30b", "prompt": ""})
    assert resp.json["done"] is True and resp.json["done_reason"] == "load"
    resp = client.post("/api/show", json={"model": "nope"})
    assert resp.status_code == 404 and resp.json == {"error": "model 'nope' not found"}


def test_api_token_is_required_when_configured():
    client = create_app(_config(_free_port(), _free_port(), gateway={"api_token": "s3cret"})).test_client()
    assert client.get("/v1/models").status_code == 401
    assert client.get("/api/version").status_code == 200  # open, like /health and /metrics
    assert client.get("/metrics").status_code == 200
    ok = client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and {m["id"] for m in ok.json["data"]} == {"qwen", "qwen3-coder:30b"}


@pytest.mark.parametrize("gateway, field", [({"port": 0}, "gateway.port"), ({"bind": "x"}, "gateway.bind"),
                                             ({"api_token": 5}, "gateway.api_token")])
def test_gateway_section_is_validated(gateway, field):
    with pytest.raises(ConfigError) as info:
        cluster_config.from_dict(_config(1, 2, gateway=gateway), "c.json")
    assert info.value.field == field and "c.json" in info.value.message


def test_gateway_section_defaults():
    cfg = cluster_config.from_dict(_config(1, 2))
    assert cfg.gateway == {"host": "127.0.0.1", "port": 8080, "api_token": None}


def test_the_gateway_runs_under_gunicorn_with_its_own_app():
    import importlib

    from disaggregated_inference.ops.cli import build_parser
    from disaggregated_inference.ops.launch import gateway_command

    cmd, env = gateway_command({"models": {}}, "127.0.0.1:0", environ={})
    assert cmd[-1] == "python:disaggregated_inference.gateway.gunicorn_conf"
    assert json.loads(env["DISAGG_GATEWAY_CONFIG"]) == {"models": {}} and env["DISAGG_BIND"] == "127.0.0.1:0"
    conf = importlib.import_module("disaggregated_inference.gateway.gunicorn_conf")
    assert conf.wsgi_app == "disaggregated_inference.gateway.wsgi:create_app()" and conf.workers == 1
    assert build_parser().parse_args(["up"]).no_gateway is False
    assert build_parser().parse_args(["gateway", "--bind", "0.0.0.0:9000"]).func.__name__ == "cmd_gateway"


def _nested_schema(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_the_whole_request_is_checked_before_a_server_is_chosen_even_with_none_up():
    """Issue 33 §3: what every server would refuse is refused by the gateway itself, in each API's shape
    and naming the API's own field, although no server is up (the client checks the request as the
    servers parse it before it looks for one)."""
    client = create_app(_config(_free_port(), _free_port())).test_client()
    surrogate = '{"model": "qwen", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    openai_cases = [
        ("/v1/chat/completions", surrogate, 400, "messages[0].content"),
        # a schema nested 40 levels deep is past the servers' 32 for a json_schema; 100 levels (200 of
        # JSON) are past the 128 any body may have
        ("/v1/chat/completions", json.dumps({**CHAT, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": _nested_schema(40)}}}), 400, "response_format"),
        ("/v1/chat/completions", json.dumps({**CHAT, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": _nested_schema(100)}}}), 400, "body"),
        ("/v1/chat/completions", json.dumps({**CHAT, "stop": [f"s{i}" for i in range(17)]}), 400, "stop"),
        ("/v1/completions", json.dumps({"model": "qwen", "prompt": "x" * ((1 << 20) + 1)}), 413, "prompt"),
        ("/v1/chat/completions", json.dumps(CHAT)[:-1] + ', "model": "qwen"}', 400, "body"),  # duplicate key
    ]
    for path, body, status, param in openai_cases:
        resp = client.post(path, data=body, content_type="application/json")
        assert resp.status_code == status, (path, resp.get_json())
        error = resp.get_json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
    ollama_cases = [
        ("/api/chat", surrogate, "messages[0].content"),
        ("/api/chat", json.dumps({"model": "qwen", "messages": CHAT["messages"], "format": _nested_schema(40)}),
         "format"),
        ("/api/generate", json.dumps({"model": "qwen", "prompt": "hi", "options": {"mirostat": 1}}), "options.mirostat"),
        ("/api/generate", json.dumps({"model": "qwen", "prompt": "hi", "options": {"stop": ["x"] * 17}}),
         "options.stop"),
        ("/api/generate", json.dumps({"model": "qwen", "prompt": "hi", "options": {"temperature": 9}}),
         "options.temperature"),
    ]
    for path, body, field in ollama_cases:
        resp = client.post(path, data=body, content_type="application/json")
        assert resp.status_code == 400 and resp.get_json()["field"] == field, (path, resp.get_json())
    # and a body that is fine is answered as before: 503, no server up
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 503


def test_every_4xx_keeps_openais_shape_and_type():
    cfg = _config(_free_port(), _free_port(), gateway={"api_token": "s3cret"})
    client = create_app(cfg).test_client()
    resp = client.get("/v1/models")
    assert resp.status_code == 401 and resp.get_json()["error"]["type"] == "authentication_error"
    auth = {"Authorization": "Bearer s3cret"}
    for method, path, status in (("get", "/v1/nowhere", 404), ("get", "/v1/chat/completions", 405)):
        resp = getattr(client, method)(path, headers=auth)
        assert resp.status_code == status and resp.get_json()["error"]["type"] == "invalid_request_error"
    resp = client.post("/v1/chat/completions", data=b"[" * 200 + b"]" * 200, headers=auth,
                       content_type="application/json")
    assert resp.status_code == 400 and resp.get_json()["error"]["param"] == "body"


def test_speculation_is_passed_to_the_client_as_the_decode_servers_field():
    from disaggregated_inference.gateway.parse import parse_openai_chat, parse_openai_completion

    chat = parse_openai_chat({**CHAT, "speculation": "ngram"})
    assert chat.request.speculation == "ngram" and chat.request.sampling_body()["speculation"] == "ngram"
    assert "speculation" not in parse_openai_completion({"model": "qwen", "prompt": "hi"}).request.sampling_body()
