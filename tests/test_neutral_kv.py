"""The engine-neutral KV kind: its layout, and llama.cpp state -> neutral -> llama.cpp on real SmolLM2 state."""
from __future__ import annotations

import io

import numpy as np
import pytest

from disaggregated_inference.errors import BundleError, FingerprintMismatch
from disaggregated_inference.kv import bundle, neutral
from disaggregated_inference.kv.convert import from_neutral, to_neutral
from disaggregated_inference.testing.bundles import read_bundle, to_bytes


def random_kv(n_layer=3, heads=2, tokens=5, dim=8, dtype="f16", seed=0) -> neutral.NeutralKV:
    rng = np.random.default_rng(seed)
    keys = [rng.standard_normal((heads, tokens, dim)).astype(np.float16) for _ in range(n_layer)]
    values = [rng.standard_normal((heads, tokens, dim)).astype(np.float16) for _ in range(n_layer)]
    return neutral.NeutralKV(keys, values, dtype=dtype, rope={"theta": 10000.0, "style": "norm"},
                             model={"model_sha256": "ab" * 32, "arch": "llama"})


def test_layout_is_k_then_v_layer_after_layer_and_travels_in_a_bundle():
    kv = random_kv()
    meta, payload = neutral.encode(kv)
    k_bytes, v_bytes = neutral.layer_bytes(meta)
    assert k_bytes == v_bytes == 2 * 5 * 8 * 2
    # layer 1's V starts after layer 0's K and V and layer 1's K
    start = 2 * k_bytes + v_bytes
    assert bytes(payload[start:start + v_bytes]) == kv.values[1].tobytes()
    header = bundle.BundleHeader(kind=bundle.KIND_NEUTRAL_KV, n_tokens=6, payload_bytes=len(payload),
                                 payload_crc32c=bundle.payload_checksum(payload), meta={"neutral": meta})
    got_header, tokens, got_payload = read_bundle(io.BytesIO(to_bytes(header, list(range(6)), payload)))
    back = neutral.decode(got_header.meta["neutral"], got_payload)
    for a, b in zip(kv.keys + kv.values, back.keys + back.values):
        assert np.array_equal(a, b)
    assert back.head_dim_order == "interleaved" and back.model == kv.model


def test_wrong_shapes_and_flags_are_refused_naming_the_field():
    meta, payload = neutral.encode(random_kv())
    with pytest.raises(BundleError) as err:
        neutral.decode(dict(meta, n_kv_tokens=6), payload)
    assert err.value.field == "meta.neutral.n_kv_tokens"
    with pytest.raises(BundleError) as err:
        neutral.decode(dict(meta, head_dim_order="reversed"), payload)
    assert err.value.field == "meta.neutral.head_dim_order"
    with pytest.raises(BundleError) as err:  # a valid flag, but not what this model's K is in
        neutral.check_shape(dict(meta, head_dim_order="halves"), meta)
    assert err.value.field == "meta.neutral.head_dim_order"
    with pytest.raises(BundleError) as err:
        neutral.check_shape(dict(meta, n_kv_heads=3), meta)
    assert err.value.field == "meta.neutral.n_kv_heads"
    with pytest.raises(FingerprintMismatch) as err:
        neutral.check_model(meta["model"], dict(meta["model"], model_sha256="cd" * 32))
    assert err.value.field == "meta.neutral.model.model_sha256"


def test_head_dim_reorder_is_the_rope_pair_permutation_and_inverts():
    kv = random_kv(dim=6)
    halves = neutral.reorder_head_dim(kv, "halves")
    k, h = kv.keys[0][0, 0], halves.keys[0][0, 0]
    # interleaved pair (2i, 2i+1) becomes (i, i + d/2)
    for i in range(3):
        assert h[i] == k[2 * i] and h[i + 3] == k[2 * i + 1]
    assert np.array_equal(halves.values[0], kv.values[0])  # V is never rotated
    back = neutral.reorder_head_dim(halves, "interleaved")
    assert np.array_equal(back.keys[2], kv.keys[2])


def test_a_receiver_that_permutes_takes_the_other_order_only_when_flag_and_rope_agree():
    meta, _ = neutral.encode(random_kv())  # interleaved, rope "norm"
    halves_meta, _ = neutral.encode(neutral.reorder_head_dim(random_kv(), "halves"))
    assert halves_meta["rope"]["style"] == "neox"  # the same rotation, laid out as halves
    assert neutral.check_shape(halves_meta, meta, reorder=True) is True
    assert neutral.check_shape(meta, meta, reorder=True) is False
    with pytest.raises(BundleError) as err:  # without reorder the other order is refused
        neutral.check_shape(halves_meta, meta)
    assert err.value.field == "meta.neutral.head_dim_order"
    with pytest.raises(BundleError) as err:  # a flag that contradicts the bundle's own rotation
        neutral.check_shape(dict(meta, head_dim_order="halves"), meta, reorder=True)
    assert err.value.field == "meta.neutral.head_dim_order"
    with pytest.raises(BundleError) as err:
        neutral.check_shape(dict(meta, rope={"theta": 500000.0, "style": "norm"}), meta, reorder=True)
    assert err.value.field == "meta.neutral.rope"
    perm = neutral.head_dim_permutation("interleaved", 8)
    kv = random_kv()
    assert np.array_equal(neutral.reorder_head_dim(kv, "halves").keys[1][..., perm], kv.keys[1])


def test_from_neutral_writes_what_to_neutral_reads_both_v_layouts():
    kv = random_kv()
    for v_trans in (False, True):
        blob = from_neutral(kv, v_trans=v_trans)
        again, was_trans = to_neutral(blob, n_kv_heads=2, rope=kv.rope)
        assert was_trans == v_trans
        for a, b in zip(kv.keys + kv.values, again.keys + again.values):
            assert np.array_equal(a, b)


def test_quantized_cache_is_refused_naming_the_type():
    blob = from_neutral(random_kv(), v_trans=False)
    k_type_at = 8 + 8 + 5 * 12 + 8  # tag, n_stream, cell_count, 5 cells, v_trans, n_layer
    blob[k_type_at:k_type_at + 4] = (8).to_bytes(4, "little")  # q8_0
    with pytest.raises(BundleError, match="q8_0") as err:
        to_neutral(blob, n_kv_heads=2, rope={"theta": 1.0, "style": "norm"})
    assert err.value.field == "type_k"


# -- real llama.cpp state (SmolLM2) --------------------------------------------------------------

@pytest.fixture(scope="module", params=[True, False], ids=["flash_attn", "no_flash_attn"])
def smollm2_pair(request):
    from disaggregated_inference.backends import ModelSettings, create

    from .conftest import THREADS

    settings = ModelSettings(model="smollm2", n_threads=THREADS, n_ctx=1024, flash_attn=request.param)
    exporter, importer = create(settings), create(settings)
    exporter.load()
    importer.load()
    yield exporter, importer
    exporter.close()
    importer.close()


@pytest.mark.slow
def test_llama_state_round_trips_through_neutral_and_continues_bit_exactly(smollm2_pair):
    from disaggregated_inference.backends import Prompt, Received, Sampling

    exporter, importer = smollm2_pair
    prompt = Prompt(text="List three uses of a pandas groupby, one line each.")
    _, prefilled = exporter.run(exporter.prefill(prompt))
    state = bytes(prefilled.payload)
    n_kv_heads = int(exporter.metadata()["llama.attention.head_count_kv"])
    kv, v_trans = to_neutral(state, n_kv_heads=n_kv_heads, rope={"theta": 10000.0, "style": "norm"})
    assert v_trans == (not exporter.settings.flash_attn)
    assert kv.n_layer == 30 and kv.keys[0].shape == (3, len(prefilled.tokens) - 1, 64)
    meta, payload = neutral.encode(kv)
    rebuilt = from_neutral(neutral.decode(meta, payload), v_trans=v_trans)
    assert bytes(rebuilt) == state
    received = Received(prefilled.kind, prefilled.tokens, rebuilt, prefilled.fingerprint, dict(prefilled.meta))
    sampling = Sampling(max_new_tokens=24, temperature=0.0)
    handed = "".join(e.piece for e in importer.run(importer.decode(received, sampling, lambda: False))[0] if e.piece)
    own = "".join(e.piece for e in exporter.run(exporter.generate(prompt, sampling, lambda: False))[0] if e.piece)
    assert handed == own and len(handed) > 10
