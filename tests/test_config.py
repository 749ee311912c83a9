"""Configuration is validated on load, with one message naming the file, the key and what was expected."""
import json
import re

import pytest

from disaggregated_inference import config
from disaggregated_inference.errors import ConfigError, ModelNotFound

SEEDS_SHAPE = {
    "prefill_servers": [
        {"host": "169.254.150.103", "port": 8000, "model": "qwen", "name": "DGX Spark 1"},
        {"host": "169.254.150.104", "port": 8000, "model": "gpt-oss", "name": "DGX Spark 2"},
    ],
    "decode_servers": [
        {"host": "169.254.150.102", "port": 8001, "model": "qwen", "name": "Mac Studio 2"},
        {"host": "169.254.150.101", "port": 8001, "model": "gpt-oss", "name": "Mac Studio 1"},
    ],
}


def write(tmp_path, data) -> str:
    path = tmp_path / "cluster.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_the_shipped_config_loads_and_maps_production_names():
    cfg = config.load("config_current.json")
    assert cfg.resolve_model("qwen3-coder:30b") == "qwen"
    assert cfg.resolve_model("GPT-OSS:120B") == "gpt-oss"
    assert {s.settings["model"] for s in cfg.prefill_servers} == {"smollm2", "gemma3-270m"}
    assert cfg.client["prefill_timeout"] == 60 and cfg.client["decode_timeout"] == 180


def test_the_seeds_shape_loads_with_default_aliases(tmp_path):
    cfg = config.load(write(tmp_path, SEEDS_SHAPE))
    assert [s.name for s in cfg.prefill_servers] == ["DGX Spark 1", "DGX Spark 2"]
    assert cfg.resolve_model("qwen3-coder:30b") == "qwen"
    assert cfg.find_server("Mac Studio 1").url == "http://169.254.150.101:8001"
    with pytest.raises(ModelNotFound, match="unknown model 'llama3'"):
        cfg.resolve_model("llama3")


def test_a_servers_power_and_cost_are_typed_and_kept_out_of_its_model_settings(tmp_path):
    data = json.loads(json.dumps(SEEDS_SHAPE))
    data["decode_servers"][0].update(power_watts=180, cost_per_hour=0.35)
    entry = config.load(write(tmp_path, data)).decode_servers[0]
    assert (entry.power_watts, entry.cost_per_hour) == (180.0, 0.35)
    assert "power_watts" not in entry.settings and "cost_per_hour" not in entry.settings


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["prefill_servers"][0].update(port="8000"), r"prefill_servers\[0\]\.port must be int"),
    (lambda d: d["prefill_servers"][0].update(port=70000), r"port must be 1\.\.65535"),
    (lambda d: d.update(models={"qwen": {}, "gpt-oss": {}}) or d["decode_servers"][1].update(model="llama"),
     r"decode_servers\[1\]\.model 'llama' is not a key"),
    (lambda d: d["decode_servers"][0].pop("host"), r"decode_servers\[0\]\.host is required"),
    (lambda d: d.update(client={"decode_timout": 3}), r"unknown key client\.decode_timout"),
    (lambda d: d.update(server={"lease_seconds": "long"}), r"server\.lease_seconds must be int or float"),
    (lambda d: d["decode_servers"][1].update(name="DGX Spark 1"), r"name 'DGX Spark 1' is used twice"),
    (lambda d: d.pop("decode_servers"), r"config\.decode_servers is required"),
    (lambda d: d.update(models={"qwen": {"backend": "transformers", "device": "gpu"}, "gpt-oss": {}}),
     r"models\.qwen\.device must be auto, cpu, cuda, cuda:N or mps, got \"gpu\""),
    (lambda d: d["prefill_servers"][0].update(device="cuda:x"), r"prefill_servers\[0\]\.device must be auto"),
    (lambda d: d["decode_servers"][0].update(power_watts="150W"), r"decode_servers\[0\]\.power_watts must be int or"),
    (lambda d: d["decode_servers"][1].update(cost_per_hour=-0.5), r"decode_servers\[1\]\.cost_per_hour must be >= 0"),
])
def test_bad_files_get_one_message_naming_file_and_key(tmp_path, mutate, message):
    data = json.loads(json.dumps(SEEDS_SHAPE))
    mutate(data)
    path = write(tmp_path, data)
    with pytest.raises(ConfigError, match=message) as info:
        config.load(path)
    assert info.value.message.startswith(path)


def test_unparseable_and_missing_files(tmp_path):
    path = write(tmp_path, '{"prefill_servers": [,]}')
    with pytest.raises(ConfigError, match=r"not valid JSON: .* line 1 column"):
        config.load(path)
    with pytest.raises(ConfigError, match="cannot read config file"):
        config.load(tmp_path / "absent.json")


def test_a_transformers_prefill_pairs_with_an_mlx_decode_server(tmp_path):
    data = {**SEEDS_SHAPE, "models": {"qwen": {"model": "smollm2", "backend": "transformers", "device": "auto"},
                                      "gpt-oss": {}}}
    data["decode_servers"] = [dict(SEEDS_SHAPE["decode_servers"][0], backend="mlx")]
    cfg = config.load(write(tmp_path, data))
    assert cfg.prefill_servers[0].settings["backend"] == "transformers"
    assert cfg.prefill_servers[0].settings["device"] == "auto"
    assert cfg.decode_servers[0].settings["backend"] == "mlx"


def test_model_backend_is_checked(tmp_path):
    from disaggregated_inference import backends

    data = {**SEEDS_SHAPE, "models": {"qwen": {"backend": "tensorrt"}, "gpt-oss": {}}}
    # every backend registered in this process by now (other tests' plugins too), the built-in ones among them
    names = backends.names()
    assert {"llama_cpp", "ollama", "vllm"} <= set(names)
    with pytest.raises(ConfigError, match=re.escape(f"models.qwen.backend must be a registered backend "
                                                    f"({', '.join(names)}), got 'tensorrt'")) as caught:
        config.load(write(tmp_path, data))
    assert caught.value.field == "models.qwen.backend"


def test_a_registered_plugin_backend_is_accepted(tmp_path, monkeypatch):
    from disaggregated_inference.backends import registry

    # a class that can be imported: the config checks a model's options against its engine's declarations
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setitem(registry._REGISTRY, "tensorrt", "tests.echo_engine:EchoBackend")
    data = {**SEEDS_SHAPE, "models": {"qwen": {"backend": "tensorrt"}, "gpt-oss": {}}}
    cfg = config.load(write(tmp_path, data))
    assert cfg.prefill_servers[0].settings["backend"] == "tensorrt"


def test_entry_point_backends_are_registered(monkeypatch):
    from importlib.metadata import EntryPoint

    from disaggregated_inference.backends import registry as backends

    found = [EntryPoint("mlx_plugin", "plugin.mlx:Backend", backends.ENTRY_POINT_GROUP)]
    monkeypatch.setattr(backends, "entry_points", lambda group: found if group == backends.ENTRY_POINT_GROUP else [])
    monkeypatch.setattr(backends, "_plugins_loaded", False)
    monkeypatch.setattr(backends, "_REGISTRY", dict(backends._REGISTRY))
    assert "mlx_plugin" in backends.names()
