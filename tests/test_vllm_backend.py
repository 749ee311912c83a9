"""The vllm backend without vLLM's engine: its config, its canary, neutral KV written as llama.cpp state, the
kind the client asks a prefill server for, and its KV connector's pieces (the streamed handoff) under a
stand-in for vLLM's step loop. (vLLM itself, in real servers: tests/test_vllm_e2e.py.)"""
from __future__ import annotations

import importlib.util
import io
import os
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

from disaggregated_inference import config as cluster_config
from disaggregated_inference.backends import ModelSettings, Prompt, create
from disaggregated_inference.backends.vllm import canary_of
from disaggregated_inference.client import DisaggregatedClient
from disaggregated_inference.errors import BundleError, ConfigError, FingerprintMismatch
from disaggregated_inference.kv import bundle, neutral, stream
from disaggregated_inference.kv.canary import compare
from disaggregated_inference.kv.convert import neutral_as_llama_state, to_neutral
from disaggregated_inference.testing.bundles import read_streamed

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


# -- the connector's pieces: vLLM's step loop stood in for ---------------------------------------------------

N_LAYER, HEADS, DIM, BLOCK = 3, 2, 4, 4
PROMPT_IDS = list(range(100, 111))  # 11 tokens: the KV of the first 10 is handed over


@pytest.fixture(scope="module")
def connector():
    """The project's vLLM KV connector. Importing it imports vLLM (about 10 s), which sets environment
    variables (LD_LIBRARY_PATH among them) that servers started later by this process would inherit, and
    warning filters: both are put back."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    saved = dict(os.environ)
    with warnings.catch_warnings():
        from disaggregated_inference.backends import vllm_connector
    os.environ.clear()
    os.environ.update(saved)
    return vllm_connector


def paged(layout: str, keys, values, blocks: list):
    """One layer's paged cache ``[blocks, heads, BLOCK, 2 * DIM]``: the tokens' K and V (heads, n, DIM) in the
    request's ``blocks`` as the attention backend ``layout`` lays them out, noise everywhere else."""
    import torch

    cache = torch.randn(max(blocks) + 2, HEADS, BLOCK, 2 * DIM)
    for t in range(keys.shape[1]):
        b, s = blocks[t // BLOCK], t % BLOCK
        if layout == "FLASH_ATTN":  # per token and head: K then V along the last axis
            cache[b, :, s, :DIM], cache[b, :, s, DIM:] = keys[:, t], values[:, t]
        else:  # CPU_ATTN "vec": per block and head, K as (DIM, BLOCK), then V as (BLOCK, DIM)
            flat = cache[b].view(HEADS, 2, BLOCK * DIM)
            flat[:, 0].view(HEADS, DIM, BLOCK)[:, :, s] = keys[:, t]
            flat[:, 1].view(HEADS, BLOCK, DIM)[:, s] = values[:, t]
    return cache


class SteppedEngine:
    """vLLM's loop for one request as the connector sees it: each engine step, the scheduler side's metadata
    for a scheduler output (the request new, then running, or resumed after a preemption with blocks anew),
    then every attention layer's save hook, in layer order, on a paged cache holding the prompt's K/V.
    ``steps``: the tokens each step computes; ``resume_before``: the step the request comes back at,
    recomputed from its cached prefix into other blocks."""

    def __init__(self, vc, layout: str, steps: list, cached: int = 0, resume_before: int | None = None,
                 unreadable_layer: int | None = None):
        config = SimpleNamespace(kv_transfer_config=SimpleNamespace(is_kv_producer=True),
                                 cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="auto"))
        self.scheduler = vc.NeutralKVConnector(config, vc.KVConnectorRole.SCHEDULER)
        self.worker = vc.NeutralKVConnector(config, vc.KVConnectorRole.WORKER)
        self.names = [f"model.layers.{il}.self_attn.attn" for il in range(N_LAYER)]
        for il, name in enumerate(self.names):  # what the forward context says of each layer
            backend = "FLASHINFER" if il == unreadable_layer else layout
            self.worker._layers[name] = (il, backend, "vec" if backend == "CPU_ATTN" else None, DIM)
        self.layout, self.steps, self.cached, self.resume_before = layout, steps, cached, resume_before
        rng = np.random.default_rng(7)
        n = len(PROMPT_IDS)
        self.keys = [rng.standard_normal((HEADS, n, DIM)).astype(np.float32) for _ in range(N_LAYER)]
        self.values = [rng.standard_normal((HEADS, n, DIM)).astype(np.float32) for _ in range(N_LAYER)]

    def _caches(self, blocks: list) -> list:
        import torch

        return [paged(self.layout, torch.from_numpy(k), torch.from_numpy(v), blocks)
                for k, v in zip(self.keys, self.values)]

    def run(self, tokens: list, params):
        blocks = [6, 2, 9]  # out of order, as a paged cache hands them out
        caches, computed = self._caches(blocks), self.cached
        for i, size in enumerate(self.steps):
            running = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
            new = []
            if i == 0:
                new = [SimpleNamespace(req_id="r", sampling_params=params, block_ids=(blocks,),
                                       num_computed_tokens=computed)]
            elif i == self.resume_before:
                blocks, computed = [6, 11, 4], self.cached  # the prefix block kept, the rest anew
                caches = self._caches(blocks)
                running = SimpleNamespace(req_ids=["r"], resumed_req_ids={"r"}, new_block_ids=[(blocks,)],
                                          num_computed_tokens=[computed])
            else:
                running = SimpleNamespace(req_ids=["r"], resumed_req_ids=set(), new_block_ids=[None],
                                          num_computed_tokens=[computed])
            out = SimpleNamespace(num_scheduled_tokens={"r": size}, scheduled_new_reqs=new,
                                  scheduled_cached_reqs=running)
            self.worker.bind_connector_metadata(self.scheduler.build_connector_meta(out))
            for name, cache in zip(self.names, caches):
                self.worker.save_kv_layer(name, cache, attn_metadata=None)
            self.worker.clear_connector_metadata()
            computed += size
        self.scheduler.request_finished(SimpleNamespace(request_id="r"), blocks)
        top = {100 + r: SimpleNamespace(logprob=-0.5 * r, rank=r + 1) for r in range(8)}
        return SimpleNamespace(outputs=[SimpleNamespace(logprobs=[top])], num_cached_tokens=self.cached)


def stepped_backend(engine: SteppedEngine):
    backend = create(ModelSettings(backend="vllm", model="smollm2", n_ctx=64))
    backend.vocab = SimpleNamespace(tokenize=lambda prompt: (list(PROMPT_IDS), ("</s>",)))
    backend._engine, backend._kv_dtype = engine, "f32"
    backend._layout = {"n_layer": N_LAYER, "n_kv_heads": HEADS, "head_dim_k": DIM, "head_dim_v": DIM,
                       "head_dim_order": "halves", "rope": {"style": "neox", "theta": 10000.0}}
    backend._fingerprint = {"backend": "vllm", "model_sha256": "ab" * 32, "arch": "llama"}
    return backend


def expected_payload(engine: SteppedEngine, n: int) -> bytes:
    kv = neutral.NeutralKV([k[:, :n] for k in engine.keys], [v[:, :n] for v in engine.values], dtype="f32")
    return bytes(neutral.encode(kv)[1])


@pytest.mark.parametrize("layout", ["CPU_ATTN", "FLASH_ATTN"])
@pytest.mark.parametrize("steps,cached,resume_before,saves", [
    ([11], 0, None, [(0, 10)]),  # the prompt in one engine step: one piece per layer
    ([2, 5], 4, None, [(0, 6), (6, 10)]),  # a cached block, then chunked prefill over two steps (mid-block)
    ([2, 2, 5], 4, 1, [(0, 6), (6, 10)]),  # preempted after the first step: recomputed, nothing saved twice
], ids=["one_step", "chunked", "preempted"])
def test_vllm_streams_each_layer_of_each_step_as_one_checked_piece(connector, layout, steps, cached, resume_before,
                                                                    saves):
    engine = SteppedEngine(connector, layout, steps, cached, resume_before)
    backend = stepped_backend(engine)
    sink = stream.StreamingBundle()
    result = backend.prefill(Prompt(text="x"), kv_stream=sink)
    meta = sink.header.meta["neutral"]
    assert meta["n_layer"] == N_LAYER and meta["n_kv_tokens"] == 10 and "canary" not in sink.header.meta
    # layer by layer within a step, step after step: each piece is one layer's tokens of one step
    assert sink.pieces == [neutral.token_segments(meta, il, start, end) for start, end in saves
                           for il in range(N_LAYER)]
    assert sink.done_tokens == 10 and sink.prefill_ended_at is not None
    assert result.metrics["handoff_mode"] == "streamed" and result.metrics["kv_read_time"] > 0
    # what the decode side reads: every piece against its own checksum, every byte once, the canary after
    sink.finish({"meta": {k: v for k, v in result.meta.items() if k not in sink.header.meta}})
    raw = b"".join(sink.frames(on_sent=lambda: None))
    header, tokens, payload, trailer = read_streamed(io.BytesIO(raw))
    assert bytes(payload) == expected_payload(engine, 10) and tokens == PROMPT_IDS
    assert trailer["meta"]["canary"]["ids"] == list(range(100, 108)) and header.meta["neutral"] == meta
    # the whole handoff of the same prompt: the same bytes, handed over after the prefill
    whole = stepped_backend(SteppedEngine(connector, layout, steps, cached, resume_before)).prefill(Prompt(text="x"))
    assert bytes(whole.payload) == bytes(payload) and whole.meta["neutral"] == meta
    assert whole.metrics["handoff_mode"] == "whole" and "kv_export_time" in whole.metrics


def test_a_vllm_prefill_failing_half_way_stops_its_pieces_and_ends_the_stream_with_the_error(connector):
    engine = SteppedEngine(connector, "CPU_ATTN", [2, 5], cached=4, unreadable_layer=1)
    sink = stream.StreamingBundle()
    with pytest.raises(BundleError) as err:
        stepped_backend(engine).prefill(Prompt(text="x"), kv_stream=sink)
    assert err.value.field == "kv" and "model.layers.1.self_attn.attn" in err.value.message
    assert "FLASHINFER" in err.value.message and "0 of 3 layers" in err.value.message
    assert len(sink.pieces) == 1 and sink.prefill_ended_at is None  # layer 0 of the first step, nothing after
    sink.fail(err.value.status, err.value.message)  # what the prefill server does with it (server/prefill.py)
    with pytest.raises(bundle.BundleRemoteError, match="FLASHINFER"):
        read_streamed(io.BytesIO(b"".join(sink.frames(on_sent=lambda: None))))
