"""Issue 12 §1: config values checked for range and agreement on load, the lease byte cap, the
token-or---insecure rule for servers beyond loopback, settings that carry the trusted KV sources,
and token ids beyond the vocabulary (with a backend that states its vocabulary size)."""
from __future__ import annotations

import json
import time

import pytest

from disaggregated_inference import config
from disaggregated_inference.backends.base import Backend, Event
from disaggregated_inference.errors import ConfigError, Overloaded
from disaggregated_inference.kv.lease import LeaseTable
from disaggregated_inference.server import decode
from disaggregated_inference.server.settings import ServerSettings, from_cluster
from disaggregated_inference.metrics import ServerFigures

from .conftest import cluster_config_dict


@pytest.mark.parametrize("section,key,value", [
    ("client", "retries", -1), ("client", "history_size", 0), ("client", "prefill_timeout", 0),
    ("client", "decode_timeout", -5), ("client", "failures_before_down", 0), ("client", "connect_timeout", 0),
    ("server", "lease_seconds", 0), ("server", "queue_timeout", -1), ("server", "kv_fetch_timeout", 0),
    ("server", "threads", 1), ("server", "max_request_bytes", 10), ("server", "max_lease_seconds", 0),
    ("server", "kv_progress_timeout", 0), ("server", "body_timeout", 0), ("server", "max_kv_bytes", 0),
])
def test_values_out_of_range_are_refused_naming_the_key(section, key, value):
    data = cluster_config_dict()
    data[section][key] = value
    with pytest.raises(ConfigError) as err:
        config.from_dict(data, "cluster.json")
    assert err.value.field == f"{section}.{key}" and "cluster.json" in err.value.message


def test_unknown_server_keys_are_refused():
    data = cluster_config_dict()
    data["server"]["thread"] = 4  # a typo of "threads"
    with pytest.raises(ConfigError, match="unknown key server.thread"):
        config.from_dict(data)


def test_timeouts_must_agree():
    data = cluster_config_dict()
    data["client"]["decode_timeout"] = 30  # below the decode server's KV pull timeout (60)
    with pytest.raises(ConfigError, match="decode_timeout .* must exceed server.kv_fetch_timeout") as err:
        config.from_dict(data)
    assert err.value.field == "client.decode_timeout"
    data = cluster_config_dict(kv_progress_timeout=90)
    with pytest.raises(ConfigError) as err:
        config.from_dict(data)
    assert err.value.field == "server.kv_progress_timeout"


def test_kv_sources_must_be_strings():
    with pytest.raises(ConfigError) as err:
        config.from_dict(cluster_config_dict(kv_sources=[3]))
    assert err.value.field == "server.kv_sources"


def test_a_decode_server_trusts_its_clusters_prefill_servers_and_the_allow_list():
    data = cluster_config_dict(kv_sources=["10.1.1.1"])
    data["prefill_servers"][0]["data_url"] = "http://192.168.100.1:8100"
    cfg = config.from_dict(data)
    settings = from_cluster(cfg, cfg.decode_servers[0].name)
    assert settings.trusted_kv_sources == ("http://192.168.100.1:8100", cfg.prefill_servers[1].address, "10.1.1.1")
    # and it travels to the gunicorn process intact
    assert ServerSettings.from_dict(json.loads(settings.to_json())).trusted_kv_sources == settings.trusted_kv_sources


def test_the_lease_table_refuses_bytes_beyond_its_cap():
    class Header:
        def __init__(self, n):
            self.payload_bytes = n

    table = LeaseTable(ttl_seconds=30, sweep_every=0, max_bytes=1000)
    table.put(Header(600), [], b"")
    with pytest.raises(Overloaded) as err:
        table.put(Header(500), [], b"")
    assert err.value.status == 503 and err.value.details["retry_after"] >= 1
    table.put(Header(400), [], b"")  # exactly at the cap is fine
    with pytest.raises(Overloaded):
        table.check_room()  # a full table refuses before any prefill work


def _serve(monkeypatch, argv, token=None):
    from disaggregated_inference.ops import cli

    monkeypatch.delenv("DISAGG_API_TOKEN", raising=False)
    if token:
        monkeypatch.setenv("DISAGG_API_TOKEN", token)
    started = []

    def execvpe(file, args, env):
        started.append(env)
        raise SystemExit(0)

    monkeypatch.setattr(cli.os, "execvpe", execvpe)
    try:
        code = cli.main(["serve", "--role", "decode", "--model", "smollm2", *argv])
    except SystemExit:
        code = 0
    return code, started


def test_a_server_beyond_loopback_needs_a_token_or_insecure(monkeypatch, capsys):
    code, started = _serve(monkeypatch, ["--bind", "0.0.0.0:8001"])
    assert code == 2 and not started
    assert "without an API token" in capsys.readouterr().err
    assert _serve(monkeypatch, ["--bind", "0.0.0.0:8001", "--insecure"])[1]
    assert _serve(monkeypatch, ["--bind", "0.0.0.0:8001"], token="t0ken")[1]
    assert _serve(monkeypatch, ["--bind", "127.0.0.1:8001"])[1]


class VocabBackend(Backend):
    """A backend that states its vocabulary size (``n_vocab`` in its fingerprint) and records decodes."""

    name, handoff_kind, accepts = "vocab-fake", "token_ids", ("token_ids",)

    def __init__(self):
        from disaggregated_inference.backends.base import ModelSettings

        super().__init__(ModelSettings(backend="vocab-fake", model="fake", parallel=1))
        self.decoded = []

    def load(self, progress=lambda m: None):
        pass

    def fingerprint(self):
        return {"backend": self.name, "n_vocab": 100}

    def prefill(self, prompt):
        raise NotImplementedError

    def decode(self, received, sampling, cancelled):
        self.decoded.append(list(received.tokens))
        yield Event(piece="x")
        yield Event(metrics=ServerFigures.of(finish_reason="stop"))

    def generate(self, prompt, sampling, cancelled):
        yield Event(metrics=ServerFigures.of(finish_reason="stop"))


def test_token_ids_beyond_the_vocabulary_are_400_before_queueing():
    backend = VocabBackend()
    app = decode.create_app({"name": "vocab"}, backend=backend)
    client = app.test_client()
    deadline = time.time() + 5
    while not client.get("/health").get_json()["loaded"] and time.time() < deadline:
        time.sleep(0.01)
    resp = client.post("/decode", json={"tokens": [1, 2, 100], "max_new_tokens": 1})
    assert resp.status_code == 400 and resp.get_json()["field"] == "tokens"
    assert backend.decoded == []
    assert client.post("/decode", json={"tokens": [1, 2, 99], "max_new_tokens": 1}).status_code == 200
    assert backend.decoded == [[1, 2, 99]]


def test_disagg_serve_takes_kv_sources_on_the_command_line(monkeypatch):
    code, started = _serve(monkeypatch, ["--bind", "127.0.0.1:8001", "--kv-source", "10.0.0.7:8000",
                                         "--kv-source", "http://192.168.100.1:8000"])
    settings = json.loads(started[0]["DISAGG_SERVER_SETTINGS"])
    assert settings["kv_sources"] == ["10.0.0.7:8000", "http://192.168.100.1:8000"]


def test_a_loaded_server_section_loads_again():
    # LocalCluster.config hands a loaded config's sections back to from_dict (kv_sources is a tuple there)
    loaded = config.from_dict(cluster_config_dict())
    again = config.from_dict({**cluster_config_dict(), "server": loaded.server})
    assert tuple(again.server["kv_sources"]) == ()
