"""The vllm backend without vLLM: its config, its canary, neutral KV written as llama.cpp state, and the kind
the client asks a prefill server for. (vLLM itself, in real servers: tests/test_vllm_e2e.py.)"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from disaggregated_inference import config as cluster_config
from disaggregated_inference.backends import ModelSettings, create
from disaggregated_inference.backends.vllm import canary_of
from disaggregated_inference.client import DisaggregatedClient
from disaggregated_inference.errors import BundleError, ConfigError, FingerprintMismatch
from disaggregated_inference.kv import neutral
from disaggregated_inference.kv.canary import compare
from disaggregated_inference.kv.convert import neutral_as_llama_state, to_neutral

LLAMA = {"general.architecture": "llama", "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
         "llama.embedding_length": 32, "llama.block_count": 3, "llama.rope.freq_base": 10000.0}
IDENTITY = {"model_sha256": "ab" * 32, "arch": "llama"}


def halves_kv(tokens=5, dtype=np.float32) -> neutral.NeutralKV:
    """K/V as vLLM or transformers hand them over: float32, K in halves order, neox rope."""
    rng = np.random.default_rng(3)
    shape = (2, tokens, 8)
    return neutral.NeutralKV([rng.standard_normal(shape).astype(dtype) for _ in range(3)],
                             [rng.standard_normal(shape).astype(dtype) for _ in range(3)], dtype="f32",
                             rope={"theta": 10000.0, "style": "neox"}, head_dim_order="halves", model=dict(IDENTITY))


@pytest.mark.parametrize("v_trans", [False, True], ids=["flash_attn", "no_flash_attn"])
def test_neutral_kv_becomes_llama_state_in_its_order_and_cache_type(v_trans):
    kv = halves_kv()
    meta, payload = neutral.encode(kv)
    state = neutral_as_llama_state(meta, payload, LLAMA, IDENTITY, n_kv_tokens=5, type_k="f16", type_v="f16",
                                   v_trans=v_trans)
    back, was_trans = to_neutral(state, n_kv_heads=2, rope={"theta": 10000.0, "style": "norm"})
    assert was_trans == v_trans and back.dtype == "f16" and back.n_kv_tokens == 5
    interleaved = neutral.reorder_head_dim(kv, "interleaved")
    for ours, theirs in zip(back.keys + back.values, interleaved.keys + interleaved.values):
        assert np.array_equal(ours, theirs.astype(np.float16))
    bf16 = neutral_as_llama_state(meta, payload, LLAMA, IDENTITY, n_kv_tokens=5, type_k="bf16", type_v="bf16",
                                  v_trans=v_trans)
    back, _ = to_neutral(bf16, n_kv_heads=2, rope={"theta": 10000.0, "style": "norm"})
    widened = neutral.to_float32(back.values[1], "bf16")
    assert back.dtype == "bf16" and np.abs(widened - kv.values[1]).max() <= np.abs(kv.values[1]).max() / 128


def test_a_neutral_import_into_llama_state_refuses_naming_the_field():
    meta, payload = neutral.encode(halves_kv())
    cases = [
        (dict(type_k="q8_0", type_v="q8_0"), BundleError, "type_k"),
        (dict(type_k="f16", type_v="f32"), BundleError, "type_v"),
        (dict(n_kv_tokens=6), BundleError, "meta.neutral.n_kv_tokens"),
    ]
    for overrides, error, field in cases:
        kwargs = {"n_kv_tokens": 5, "type_k": "f16", "type_v": "f16", "v_trans": False, **overrides}
        with pytest.raises(error) as err:
            neutral_as_llama_state(meta, payload, LLAMA, IDENTITY, **kwargs)
        assert err.value.field == field, overrides
    with pytest.raises(FingerprintMismatch) as err:
        neutral_as_llama_state(meta, payload, LLAMA, dict(IDENTITY, model_sha256="cd" * 32), n_kv_tokens=5,
                               type_k="f16", type_v="f16", v_trans=False)
    assert err.value.field == "meta.neutral.model.model_sha256"
    with pytest.raises(BundleError) as err:
        neutral_as_llama_state(meta, payload, dict(LLAMA, **{"llama.attention.head_count_kv": 4}), IDENTITY,
                               n_kv_tokens=5, type_k="f16", type_v="f16", v_trans=False)
    assert err.value.field == "meta.neutral.n_kv_heads"
    with pytest.raises(BundleError) as err:
        neutral_as_llama_state(meta, payload, {**LLAMA, "general.architecture": "gemma3"}, IDENTITY,
                               n_kv_tokens=5, type_k="f16", type_v="f16", v_trans=False)
    assert err.value.field == "kv" and "gemma3" in err.value.message


def test_a_qwen3moe_state_goes_through_neutral_in_halves_order_and_continues_bit_exactly():
    """The production qwen model's architecture (a tiny random-weight GGUF, tests/tiny_models.py): its llama.cpp
    state as neutral_kv ("halves", neox) and back into another llama.cpp context continues as the state
    itself does, to the bit: the path a vLLM bundle of Qwen3-Coder takes into a Mac's llama.cpp."""
    from disaggregated_inference.backends import Prompt, Received, Sampling

    from .tiny_models import tiny_gguf

    settings = ModelSettings(model=str(tiny_gguf("qwen3moe")), n_ctx=512, n_threads=1, parallel=1)
    exporter, importer = create(settings), create(settings)
    exporter.load()
    importer.load()
    try:
        _, pre = exporter.run(exporter.prefill(Prompt(text="Name two uses of a pandas groupby.")))
        converted = exporter.convert(pre, "neutral_kv")
        meta = converted.meta["neutral"]
        assert meta["head_dim_order"] == "halves" and meta["rope"]["style"] == "neox" and meta["head_dim_k"] == 32
        texts = []
        for bundle in (pre, converted):
            received = Received(bundle.kind, bundle.tokens, bundle.payload, bundle.fingerprint, dict(bundle.meta))
            events, _ = importer.run(importer.decode(received, Sampling(max_new_tokens=8), lambda: False))
            metrics = events[-1].metrics
            assert metrics["method"] == "kv_handoff" and metrics["prompt_tokens_recomputed"] == 1
            assert metrics["canary"] == "passed" and metrics["canary_divergence"] == 0.0, metrics
            texts.append("".join(e.piece for e in events if e.piece))
        assert texts[0] == texts[1]
    finally:
        exporter.close()
        importer.close()


def test_the_canary_is_vllms_top_k_by_rank_and_compares_as_any_other():
    logits = np.array([0.5, 3.0, 1.0, 2.5, -1.0])
    lp = logits - np.log(np.exp(logits).sum())
    given = {i: SimpleNamespace(logprob=float(lp[i]), rank=r) for r, i in enumerate([1, 3, 2], start=1)}
    given[4] = SimpleNamespace(logprob=float(lp[4]), rank=5)  # vLLM adds the sampled token whatever its rank
    canary = canary_of(given, 3, "vllm/gpu")
    assert canary["ids"] == [1, 3, 2] and canary["engine"] == "vllm/gpu" and canary["alone"] is False
    top1, divergence = compare(canary, logits)
    assert top1 and divergence < 1e-12


def test_weights_must_be_a_hugging_face_directory_and_the_gguf_still_names_them(tmp_path):
    backend = create(ModelSettings(backend="vllm", model="smollm2", weights=str(tmp_path)))
    with pytest.raises(ConfigError) as err:
        backend._source(lambda message: None)
    assert err.value.field == "weights" and "config.json" in err.value.message
    (tmp_path / "config.json").write_text("{}")
    directory, gguf, weights_from = backend._source(lambda message: None)
    assert directory == tmp_path and gguf.name.endswith(".gguf") and weights_from == "huggingface"
    directory, gguf, weights_from = create(ModelSettings(backend="vllm", model="smollm2"))._source(lambda m: None)
    assert directory is None and weights_from == "gguf"


def test_vllm_options_are_checked_and_left_out_of_other_engines_servers():
    config = {
        "models": {"smol": {"backend": "vllm", "model": "smollm2", "parallel": 8, "kv_cache_gib": 2}},
        "prefill_servers": [{"name": "p", "host": "127.0.0.1", "port": 8100, "model": "smol"}],
        "decode_servers": [{"name": "d", "host": "127.0.0.1", "port": 8101, "model": "smol", "backend": "llama_cpp"}],
    }
    cfg = cluster_config.from_dict(config)
    assert cfg.prefill_servers[0].settings["kv_cache_gib"] == 2
    assert "kv_cache_gib" not in cfg.decode_servers[0].settings  # an option of vllm, not of llama_cpp
    bad = {**config, "models": {"smol": {"backend": "vllm", "model": "smollm2", "dtype": "fp8"}}}
    with pytest.raises(ConfigError) as err:
        cluster_config.from_dict(bad)
    assert err.value.field == "models.smol.dtype"


def _client_with(handoff: str | None, *accepts) -> DisaggregatedClient:
    config = {
        "models": {"m": {"backend": "llama_cpp", "model": "smollm2"}},
        "prefill_servers": [{"name": "p", "host": "127.0.0.1", "port": 8100, "model": "m"}],
        "decode_servers": [{"name": f"d{i}", "host": "127.0.0.1", "port": 8101 + i, "model": "m"}
                           for i in range(len(accepts))],
        "client": {"health_check_interval": 0},
    }
    client = DisaggregatedClient(config, health_check=False)
    for server in client.servers.values():
        if server.entry.role == "prefill":
            server.health = {"handoff": handoff} if handoff else {}
        else:
            server.health = {"accepts": list(accepts[int(server.entry.name[1:])])}
    return client


LLAMA_DECODE = ("llama_seq_state", "neutral_kv", "token_ids")
MLX_DECODE = ("neutral_kv", "token_ids")


@pytest.mark.parametrize("handoff,accepts,wanted", [
    ("llama_seq_state", [LLAMA_DECODE], {}),  # llama.cpp -> llama.cpp: its own state
    ("llama_seq_state", [MLX_DECODE], {"kv_kind": "neutral_kv"}),  # llama.cpp -> MLX: converted
    ("llama_seq_state", [LLAMA_DECODE, MLX_DECODE], {"kv_kind": "neutral_kv"}),  # one kind both read
    ("neutral_kv", [LLAMA_DECODE, MLX_DECODE], {}),  # vLLM, MLX, transformers -> either
    (None, [MLX_DECODE], {"kv_kind": "neutral_kv"}),  # prefill health unknown: as before
    (None, [LLAMA_DECODE], {}),
])
def test_the_client_asks_for_a_kind_every_decode_server_reads(handoff, accepts, wanted):
    with _client_with(handoff, *accepts) as client:
        assert client._kv_kind("m") == wanted
