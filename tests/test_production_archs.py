"""The production architectures (qwen3moe, gpt-oss) through the real handoff, on generated tiny models.

The models come from ``tests/tiny_models.py`` (random weights, the real layout llama.cpp 0.3.36
loads), served under their production names from an Ollama store laid out as ``ollama pull``
leaves it, by real gunicorn prefill and decode servers on free ports. Flash attention is on for
both, as a GPU deployment runs them.

- qwen3moe (full attention) restores bit-exactly: greedy text through the handoff equals the
  monolithic ``/generate`` at every length.
- gpt-oss slides a 128-token window on every other layer (``n_swa``): inside the window the
  restore is bit-exact; beyond it, with flash attention on, the importer places the window's
  cells elsewhere and the logits move by float noise (docs/sliding-window.md), so the test
  compares first-token logits with a one-shot evaluation, the exporter's own distance as yardstick.
"""
from __future__ import annotations

import numpy as np
import pytest

from disaggregated_inference.backends import ModelSettings, Prompt, Received, create, ollama_store

from .conftest import TINY_THREADS
from .tiny_models import GPT_OSS, PRODUCTION, QWEN3MOE, tiny_gguf, write_ollama_store

pytestmark = pytest.mark.slow

MAX_NEW = 16
N_CTX = 2048
CELL_METADATA = 12   # bytes llama.cpp writes per cached cell beside K and V (position, sequence ids)
HEADER_SLACK = 256   # the state's own header, per KV cache
FILLER = "The quarterly sales report lists revenue by region, product line and month. "
TOLERANCE = 0.01     # mean abs logit difference over the exporter's own (logit std here is about 0.8)


def prompt_of(repeats: int) -> str:
    return FILLER * repeats + "\nSummarise the report above."


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("ollama") / "models"
    return root, write_ollama_store(root)


@pytest.fixture(scope="module")
def servers(store, tmp_path_factory):
    from disaggregated_inference.ops.cluster import LocalCluster

    root, _ = store
    models = {"qwen": "qwen3-coder:30b", "gpt-oss": "gpt-oss:120b"}
    config = {
        "models": {key: {"aliases": [name], "backend": "llama_cpp", "model": f"ollama:{name}", "n_ctx": N_CTX,
                         "n_threads": TINY_THREADS, "flash_attn": True} for key, name in models.items()},
        "prefill_servers": [{"name": f"prefill-{k}", "host": "127.0.0.1", "port": 18000 + i, "model": k}
                            for i, k in enumerate(models)],  # ports replaced by free ones
        "decode_servers": [{"name": f"decode-{k}", "host": "127.0.0.1", "port": 18010 + i, "model": k}
                           for i, k in enumerate(models)],
        "client": {"health_check_interval": 0},
    }
    with LocalCluster(config, free_ports=True, log_dir=tmp_path_factory.mktemp("logs"),
                      env={"OLLAMA_MODELS": str(root)}) as running:
        running.wait_healthy(timeout=300)
        yield {p.entry.name: p.url for p in running.processes}


def handoff(http, servers, model: str, prompt: str) -> tuple[dict, dict]:
    pre = http.post(f"{servers['prefill-' + model]}/prefill", json={"prompt": prompt, "raw": True}).json()
    resp = http.post(f"{servers['decode-' + model]}/decode",
                     json={"kv": pre["kv"], "max_new_tokens": MAX_NEW, "temperature": 0})
    assert resp.status_code == 200, resp.text
    return pre, resp.json()


def monolithic(http, servers, model: str, prompt: str) -> dict:
    return http.post(f"{servers['decode-' + model]}/generate",
                     json={"prompt": prompt, "raw": True, "max_new_tokens": MAX_NEW, "temperature": 0}).json()


def expected_kv_bytes(shape, n_cached: int) -> tuple[int, int]:
    """(low, high) of the per-sequence state: all layers' K and V per token, SWA layers only for the window."""
    swa = len(shape.swa_layers)
    full = shape.n_layer - swa
    size = n_cached * (shape.kv_bytes_per_token(full) + CELL_METADATA)
    if swa:
        size += min(n_cached, shape.n_swa) * (shape.kv_bytes_per_token(swa) + CELL_METADATA)
    caches = 2 if swa else 1
    return size, size + caches * HEADER_SLACK


def test_the_store_resolves_the_production_names_to_the_tiny_models(store):
    root, digests = store
    for name, spec in PRODUCTION.items():
        found = ollama_store.resolve(f"ollama:{name}", root=root)
        assert found.name == name and found.digest == digests[name]
        assert found.blob.read_bytes() == tiny_gguf(spec["arch"]).read_bytes()


@pytest.mark.parametrize("repeats", [2, 30])
def test_qwen3moe_handoff_is_bit_exact_and_recomputes_one_token(http, servers, store, repeats):
    prompt = prompt_of(repeats)
    pre, out = handoff(http, servers, "qwen", prompt)
    m = out["metrics"]
    assert m["method"] == "kv_handoff" and m["prompt_tokens_recomputed"] == 1
    assert out["generated_text"] == monolithic(http, servers, "qwen", prompt)["generated_text"]
    low, high = expected_kv_bytes(QWEN3MOE, pre["prompt_tokens"] - 1)
    assert low <= m["kv_bytes"] < high
    f = pre["fingerprint"]
    assert (f["arch"], f["n_layer"], f["n_embd"], f["n_swa"]) == ("qwen3moe", 4, 64, 0)
    assert f["model_sha256"] == store[1]["qwen3-coder:30b"].split(":")[1]


@pytest.mark.parametrize("repeats", [2, 30])
def test_gpt_oss_handoff_recomputes_one_token_and_ships_only_the_window_of_swa_layers(
        http, servers, store, repeats):
    prompt = prompt_of(repeats)
    pre, out = handoff(http, servers, "gpt-oss", prompt)
    n_cached = pre["prompt_tokens"] - 1
    m = out["metrics"]
    assert m["method"] == "kv_handoff" and m["prompt_tokens_recomputed"] == 1
    low, high = expected_kv_bytes(GPT_OSS, n_cached)
    assert low <= m["kv_bytes"] < high
    f = pre["fingerprint"]
    assert (f["arch"], f["n_layer"], f["n_swa"]) == ("gpt-oss", 4, GPT_OSS.n_swa)
    if n_cached < GPT_OSS.n_swa:  # inside the window the restore is bit-exact, so the text is too
        assert out["generated_text"] == monolithic(http, servers, "gpt-oss", prompt)["generated_text"]
    else:
        assert n_cached > 3 * GPT_OSS.n_swa  # the size check above then proves the window: only 128 cells of SWA layers


def test_fingerprint_names_the_experts(http, servers):
    f = http.post(f"{servers['prefill-qwen']}/prefill", json={"prompt": "hi", "raw": True}).json()["fingerprint"]
    assert (f["n_expert"], f["n_expert_used"]) == (QWEN3MOE.n_expert, QWEN3MOE.n_expert_used)


@pytest.fixture(scope="module")
def gpt_oss_pair():
    settings = ModelSettings(model=str(tiny_gguf("gpt-oss")), n_threads=TINY_THREADS, n_ctx=N_CTX, flash_attn=True)
    exporter, importer = create(settings), create(settings)
    exporter.load()
    importer.load()
    yield exporter, importer
    exporter.close()
    importer.close()


@pytest.mark.parametrize("repeats", [5, 20, 60])
def test_gpt_oss_logits_after_the_handoff_are_as_close_to_one_shot_as_the_exporter(gpt_oss_pair, repeats):
    exporter, importer = gpt_oss_pair
    tokens, _ = exporter.tokenize(Prompt(text=prompt_of(repeats), raw=True))
    with exporter.sequence() as seq:
        exporter.logits(seq, tokens[:-1])
        received = Received("llama_seq_state", tokens, bytearray(exporter.export_state(seq)), exporter.fingerprint())
        with importer.sequence() as dest:
            importer.import_state(dest, received)
            imported = importer.logits(dest, tokens[-1:], len(tokens) - 1)
        exported = exporter.logits(seq, tokens[-1:], len(tokens) - 1)
    with exporter.sequence() as seq:
        one_shot = exporter.logits(seq, tokens)
    d_import = float(np.mean(np.abs(imported - one_shot)))
    d_export = float(np.mean(np.abs(exported - one_shot)))
    assert d_import <= d_export + TOLERANCE
    assert int(np.argmax(imported)) == int(np.argmax(one_shot))
    if len(tokens) - 1 < GPT_OSS.n_swa:
        assert np.array_equal(imported, exported)


def test_the_tiny_gpt_oss_stores_its_experts_as_mxfp4_like_llama_cpp_conversions():
    import gguf

    reader = gguf.GGUFReader(tiny_gguf("gpt-oss"))
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.ffn_down_exps.weight"] == gguf.GGMLQuantizationType.MXFP4
    assert types["blk.0.attn_sinks.weight"] == gguf.GGMLQuantizationType.F32
    assert reader.fields["gpt-oss.attention.sliding_window"].contents() == GPT_OSS.n_swa
