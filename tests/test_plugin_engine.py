"""An engine from outside the package: registered, its option declared, configured and served.

``tests/echo_engine.py`` is written as docs/ARCHITECTURE.md ("Adding an engine") says, and
nothing of the package names it: the processes learn of it from ``DISAGG_PLUGINS``, the way a
lab's own engine module would be deployed. The module's servers are real gunicorn processes.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import requests

from disaggregated_inference import config as cluster_config
from disaggregated_inference.backends import options, registry, settings_class
from disaggregated_inference.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = "tests.echo_engine"


@pytest.fixture(scope="module")
def plugin():
    """The echo engine known to this process and to every server it starts; the registry as it was after."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
        mp.delitem(sys.modules, PLUGIN, raising=False)  # imported afresh: its import registers it here
        mp.setenv(registry.PLUGINS_VARIABLE, PLUGIN)
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        yield


def echo_config(**decode) -> dict:
    return {
        "models": {"echo": {"backend": "echo", "model": "words", "repeat": 2}},
        "prefill_servers": [{"name": "prefill-echo", "host": "127.0.0.1", "port": 8200, "model": "echo"}],
        "decode_servers": [{"name": "decode-echo", "host": "127.0.0.1", "port": 8201, "model": "echo", **decode}],
        "client": {"health_check_interval": 0},
    }


BUILT_IN_TABLE = ("from disaggregated_inference.backends import options, registry, settings_class; "
                  "print(options.table({name: settings_class(name) for name in registry.BUILT_IN}), end='')")


def test_the_documented_table_is_the_declarations():
    page = (ROOT / "docs" / "configuration.md").read_text()
    start = page.index("<!-- model-options")
    table = page[page.index("\n", start) + 1:page.index("<!-- /model-options -->")]
    built_in = {name: settings_class(name) for name in registry.BUILT_IN}
    assert table == options.table(built_in), ("docs/configuration.md's model options differ from the backends' "
                                              "declarations; "
                                              f"paste the output of: python -c \"{BUILT_IN_TABLE}\"")


def test_the_engines_option_is_checked_on_load_and_overridden_per_server(plugin):
    cfg = cluster_config.from_dict(echo_config(repeat=3))
    assert cfg.prefill_servers[0].settings == {"backend": "echo", "model": "words", "repeat": 2}
    assert cfg.decode_servers[0].settings["repeat"] == 3
    with pytest.raises(ConfigError, match=r"decode_servers\[0\]\.repeat must be at least 1, got 0") as err:
        cluster_config.from_dict(echo_config(repeat=0))
    assert err.value.field == "decode_servers[0].repeat"
    with pytest.raises(ConfigError, match=r"models\.echo\.repeat must be int, got \"2\""):
        cluster_config.from_dict({**echo_config(), "models": {"echo": {"backend": "echo", "repeat": "2"}}})
    # an option of another engine is refused for this one, naming it and the engine's own
    with pytest.raises(ConfigError, match=r"decode_servers\[0\]\.flash_attn is not an option of the echo backend "
                                          r"\(its options: backend, model, n_ctx, n_threads, parallel, repeat\)"):
        cluster_config.from_dict(echo_config(flash_attn=True))
    with pytest.raises(ConfigError, match=r"unknown key models\.echo\.volume"):
        cluster_config.from_dict({**echo_config(), "models": {"echo": {"backend": "echo", "volume": 11}}})


def test_a_taken_name_is_refused(plugin):
    from tests.echo_engine import EchoBackend

    assert "echo" in registry.names()
    registry.register("echo", EchoBackend)  # the same class again (a module imported twice): nothing changes
    with pytest.raises(ConfigError, match="backend 'echo' is already registered"):
        registry.register("echo", "other.module:Echo")
    with pytest.raises(ConfigError, match="backend 'llama_cpp' is already registered"):
        registry.register("llama_cpp", EchoBackend)
    assert registry.backend_class("echo") is EchoBackend


def test_a_plugin_that_cannot_be_imported_is_named(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setenv(registry.PLUGINS_VARIABLE, "no_such_module_here")
    with pytest.raises(ConfigError, match="DISAGG_PLUGINS names 'no_such_module_here', which cannot be imported"):
        registry.names()


@pytest.mark.slow
def test_real_servers_run_the_engine_from_outside_the_package(plugin, tmp_path):
    from disaggregated_inference.client import DisaggregatedClient
    from disaggregated_inference.ops.cluster import LocalCluster

    with LocalCluster(echo_config(repeat=3), free_ports=True, log_dir=tmp_path) as cluster:
        cluster.wait_healthy(timeout=120)
        urls = {p.entry.name: p.url for p in cluster.processes}
        health = requests.get(urls["decode-echo"] + "/health", timeout=10).json()
        assert health["backend"] == "echo" and health["options"]["repeat"] == 3  # the server entry's override
        answer = requests.post(urls["decode-echo"] + "/generate", json={"prompt": "hello plugin world"}, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.json()["generated_text"] == "hello hello hello plugin plugin plugin world world world"
        assert answer.json()["metrics"]["method"] == "decode_only"
        # the handoff: the prefill server (repeat 2, unused by a prefill) hands over the prompt's ids
        with DisaggregatedClient(cluster.config, health_check=False) as client:
            text, metrics = client.generate("echo", "two words", max_tokens=5)
        assert text == "two two two words words" and metrics["finish_reason"] == "length"
        assert metrics["method"] == "token_ids_recompute" and metrics["prefill_server"] is not None
        bad = requests.post(urls["decode-echo"] + "/decode", json={"tokens": [300]}, timeout=30)
        assert bad.status_code == 400 and bad.json()["field"] == "tokens"  # beyond its declared vocabulary
        assert json.loads(cluster.process("decode-echo").settings.to_json())["model"]["repeat"] == 3
