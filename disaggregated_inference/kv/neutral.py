"""The engine-neutral KV layout (bundle kind ``neutral_kv``): what any engine can read.

A ``neutral_kv`` bundle's payload is, layer after layer (layer 0 first)::

    K of layer il   dense (n_kv_heads, n_kv_tokens, head_dim_k), C order
    V of layer il   dense (n_kv_heads, n_kv_tokens, head_dim_v), C order

in one dtype (``f16``, ``bf16`` or ``f32``, little-endian), so a receiver can
convert layer il as soon as its bytes are in. ``n_kv_tokens`` is the number of
prompt tokens whose K/V is cached (the prompt but its last token, which the
decode side evaluates). The header's ``meta["neutral"]`` says everything the
payload does not::

    layout          "neutral_kv/1"
    dtype           "f16" | "bf16" | "f32"
    n_layer         number of layers carried
    n_kv_heads      KV heads per layer (GQA: fewer than the query heads)
    head_dim_k, head_dim_v
    n_kv_tokens     tokens per layer
    pos_start       position of the first cached token; positions are
                    pos_start .. pos_start + n_kv_tokens - 1, contiguous
    rope            {"theta": base frequency, "style": "norm" | "neox"}: the
                    rotation the cached K already carries ("norm" rotates
                    interleaved pairs, "neox" halves: the style agrees with
                    ``head_dim_order`` in every bundle)
    head_dim_order  "interleaved": RoPE pairs are (2i, 2i+1) along head_dim, as
                    llama.cpp stores K for llama-family GGUF files (whose
                    converter permuted the Q/K rows); "halves": pairs are
                    (i, i + head_dim/2), as Transformers and MLX store it with
                    the original checkpoint's weights. ``reorder_head_dim``
                    turns one into the other; a receiver whose model caches K
                    in the other order permutes it (``check_shape(reorder=True)``
                    says when).
    model           identity: {"model_sha256", "arch"}: the weights the K/V
                    came from (an MLX model dequantised from a GGUF file names
                    that file's digest), checked by ``check_model``.

K is cached after RoPE, V is never rotated, so only K depends on the order.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import BundleError, FingerprintMismatch
from .bundle import KIND_NEUTRAL_KV

KIND = KIND_NEUTRAL_KV
LAYOUT = "neutral_kv/1"
ORDERS = ("interleaved", "halves")
ROPE_STYLES = ("norm", "neox")
ORDER_OF_STYLE = {"norm": "interleaved", "neox": "halves"}  # the RoPE pairs each style rotates
_DTYPES = {"f16": np.dtype("<f2"), "bf16": np.dtype("<u2"), "f32": np.dtype("<f4")}  # bf16 kept as raw bits
MODEL_KEYS = ("model_sha256", "arch")


@dataclass
class NeutralKV:
    """K and V per layer as numpy arrays (n_kv_heads, n_kv_tokens, head_dim), plus what they mean."""

    keys: list
    values: list
    dtype: str = "f16"
    pos_start: int = 0
    rope: dict = field(default_factory=lambda: {"theta": 10000.0, "style": "norm"})
    head_dim_order: str = "interleaved"
    model: dict = field(default_factory=dict)

    @property
    def n_layer(self) -> int:
        return len(self.keys)

    @property
    def n_kv_tokens(self) -> int:
        return self.keys[0].shape[1] if self.keys else 0

    def meta(self) -> dict:
        k0, v0 = self.keys[0], self.values[0]
        return {"layout": LAYOUT, "dtype": self.dtype, "n_layer": self.n_layer, "n_kv_heads": int(k0.shape[0]),
                "head_dim_k": int(k0.shape[2]), "head_dim_v": int(v0.shape[2]), "n_kv_tokens": int(k0.shape[1]),
                "pos_start": int(self.pos_start), "rope": dict(self.rope), "head_dim_order": self.head_dim_order,
                "model": dict(self.model)}


def _bad(message: str, key: str) -> BundleError:
    return BundleError(message, field=f"meta.neutral.{key}")


def validate_meta(meta: dict) -> dict:
    """Check a ``meta["neutral"]`` dict; raise ``BundleError`` naming the first bad field."""
    if not isinstance(meta, dict):
        raise BundleError("a neutral_kv bundle needs meta.neutral", field="meta.neutral")
    if meta.get("layout") != LAYOUT:
        raise _bad(f"layout {meta.get('layout')!r} is not {LAYOUT!r}", "layout")
    if meta.get("dtype") not in _DTYPES:
        raise _bad(f"dtype {meta.get('dtype')!r} is not one of {', '.join(_DTYPES)}", "dtype")
    for key in ("n_layer", "n_kv_heads", "head_dim_k", "head_dim_v", "n_kv_tokens", "pos_start"):
        value = meta.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if key in ("n_kv_tokens", "pos_start") else 1):
            raise _bad(f"{key} must be a {'non-negative' if key in ('n_kv_tokens', 'pos_start') else 'positive'} "
                       f"integer, got {value!r}", key)
    if meta.get("head_dim_order") not in ORDERS:
        raise _bad(f"head_dim_order {meta.get('head_dim_order')!r} is not one of {', '.join(ORDERS)}", "head_dim_order")
    rope = meta.get("rope")
    if not isinstance(rope, dict) or rope.get("style") not in ROPE_STYLES or not isinstance(rope.get("theta"), (int, float)):
        raise _bad(f"rope must be {{'theta': number, 'style': one of {', '.join(ROPE_STYLES)}}}, got {rope!r}", "rope")
    if not isinstance(meta.get("model"), dict):
        raise _bad("model must be a dict naming the weights (model_sha256, arch)", "model")
    return meta


def layer_bytes(meta: dict) -> tuple[int, int]:
    """Bytes of one layer's K and of its V."""
    item = _DTYPES[meta["dtype"]].itemsize
    rows = meta["n_kv_heads"] * meta["n_kv_tokens"]
    return rows * meta["head_dim_k"] * item, rows * meta["head_dim_v"] * item


def payload_bytes(meta: dict) -> int:
    k, v = layer_bytes(meta)
    return meta["n_layer"] * (k + v)


def token_segments(meta: dict, layer: int, start: int, end: int) -> list[tuple[int, int]]:
    """Where tokens ``start..end-1`` of ``layer`` lie in the payload: per KV head a run of K, then of V
    (what a producer that streams layer by layer hands over as one piece)."""
    item = _DTYPES[meta["dtype"]].itemsize
    k_bytes, v_bytes = layer_bytes(meta)
    base, t = layer * (k_bytes + v_bytes), meta["n_kv_tokens"]
    out = []
    for offset, dim in ((base, meta["head_dim_k"]), (base + k_bytes, meta["head_dim_v"])):
        row = dim * item
        out += [(offset + (h * t + start) * row, (end - start) * row) for h in range(meta["n_kv_heads"])]
    return out


def encode(kv: NeutralKV) -> tuple[dict, bytearray]:
    """The bundle ``meta["neutral"]`` and the payload (K then V, layer after layer)."""
    if kv.dtype not in _DTYPES:
        raise ValueError(f"dtype {kv.dtype!r} is not one of {', '.join(_DTYPES)}")
    if not kv.keys or len(kv.keys) != len(kv.values):
        raise ValueError("need as many V layers as K layers, at least one")
    meta = validate_meta(kv.meta())
    want = np.dtype(_DTYPES[kv.dtype])
    k_bytes, v_bytes = layer_bytes(meta)
    out = bytearray(payload_bytes(meta))
    offset = 0
    for il, (k, v) in enumerate(zip(kv.keys, kv.values)):
        for what, array, size, dim in (("K", k, k_bytes, "head_dim_k"), ("V", v, v_bytes, "head_dim_v")):
            shape = (meta["n_kv_heads"], meta["n_kv_tokens"], meta[dim])
            if tuple(array.shape) != shape:
                raise ValueError(f"{what} of layer {il} has shape {tuple(array.shape)}, expected {shape}")
            np.frombuffer(out, dtype=want, count=array.size, offset=offset).reshape(shape)[...] = array.astype(want, copy=False)
            offset += size
    return meta, out


def iter_layers(meta: dict, payload):
    """Yield ``(il, K, V)`` numpy views into ``payload`` (no copies), layer after layer."""
    meta = validate_meta(meta)
    view = memoryview(payload).cast("B")
    if len(view) != payload_bytes(meta):
        raise _bad(f"payload has {len(view)} bytes but the declared shapes need {payload_bytes(meta)} "
                   f"({meta['n_layer']} layers x (K + V) of ({meta['n_kv_heads']}, {meta['n_kv_tokens']}, head_dim) "
                   f"{meta['dtype']})", "n_kv_tokens")
    dtype = _DTYPES[meta["dtype"]]
    k_bytes, v_bytes = layer_bytes(meta)
    h, t = meta["n_kv_heads"], meta["n_kv_tokens"]
    offset = 0
    for il in range(meta["n_layer"]):
        k = np.frombuffer(view, dtype=dtype, count=h * t * meta["head_dim_k"], offset=offset).reshape(h, t, meta["head_dim_k"])
        offset += k_bytes
        v = np.frombuffer(view, dtype=dtype, count=h * t * meta["head_dim_v"], offset=offset).reshape(h, t, meta["head_dim_v"])
        offset += v_bytes
        yield il, k, v


def decode(meta: dict, payload) -> NeutralKV:
    """A payload and its meta as a ``NeutralKV`` (arrays are views into the payload)."""
    keys, values = [], []
    for _, k, v in iter_layers(meta, payload):
        keys.append(k)
        values.append(v)
    return NeutralKV(keys, values, dtype=meta["dtype"], pos_start=meta["pos_start"], rope=dict(meta["rope"]),
                     head_dim_order=meta["head_dim_order"], model=dict(meta["model"]))


def to_float32(array: np.ndarray, dtype: str) -> np.ndarray:
    """Values of an array of the neutral dtype as float32 (bf16 bits widened)."""
    if dtype == "bf16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)


def reorder_head_dim(kv: NeutralKV, order: str) -> NeutralKV:
    """K with its head_dim in ``order`` (V is never rotated, so it is left as it is).

    interleaved -> halves: new[i] = old[2i], new[i + d/2] = old[2i + 1].
    """
    if order not in ORDERS:
        raise BundleError(f"head_dim_order {order!r} is not one of {', '.join(ORDERS)}", field="head_dim_order")
    if order == kv.head_dim_order:
        return kv
    perm = head_dim_permutation(order, kv.keys[0].shape[-1])
    keys = [np.ascontiguousarray(k[..., perm]) for k in kv.keys]
    style = next(s for s, o in ORDER_OF_STYLE.items() if o == order)  # the same rotation, laid out as ``order``
    return NeutralKV(keys, kv.values, dtype=kv.dtype, pos_start=kv.pos_start, rope=dict(kv.rope, style=style),
                     head_dim_order=order, model=dict(kv.model))


def head_dim_permutation(order: str, d: int) -> np.ndarray:
    """Indices that put K's last axis (``d`` wide) from the other order into ``order``: ``k[..., perm]``."""
    if d % 2:
        raise BundleError(f"head_dim {d} is odd: no RoPE pairs to reorder", field="meta.neutral.head_dim_k")
    if order == "halves":
        return np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])
    return np.stack([np.arange(d // 2), np.arange(d // 2) + d // 2], axis=1).reshape(-1)


def check_model(ours: dict, theirs: dict) -> None:
    """Refuse K/V from other weights: every key of ``MODEL_KEYS`` must be equal, named when not."""
    for key in MODEL_KEYS:
        if ours.get(key) != theirs.get(key):
            raise FingerprintMismatch(
                f"neutral KV was computed from other weights: {key} is {theirs.get(key)!r} in the bundle, "
                f"{ours.get(key)!r} here", field=f"meta.neutral.model.{key}")


def check_shape(meta: dict, expected: dict, reorder: bool = False) -> bool:
    """Refuse a bundle whose shapes or conventions differ from what this model needs; name the field.

    With ``reorder`` (a receiver that can permute K), a bundle in the other head-dim order is taken
    when its RoPE style rotates the pairs its order says (the same rotation, laid out otherwise);
    one whose flag contradicts its style is refused naming ``head_dim_order``. Returns whether K's
    head_dim must be permuted into ``expected["head_dim_order"]`` (``head_dim_permutation``).
    """
    keys = ("n_layer", "n_kv_heads", "head_dim_k", "head_dim_v") + (() if reorder else ("head_dim_order",))
    for key in keys:
        if key in expected and meta.get(key) != expected[key]:
            raise BundleError(f"{key} is {meta.get(key)!r} in the bundle; this model needs {expected[key]!r}",
                              field=f"meta.neutral.{key}")
    rope, want = meta.get("rope", {}), expected.get("rope")
    if reorder:
        if ORDER_OF_STYLE.get(rope.get("style")) != meta.get("head_dim_order"):
            raise BundleError(f"head_dim_order {meta.get('head_dim_order')!r} contradicts the bundle's rope style "
                              f"{rope.get('style')!r}, which rotates {ORDER_OF_STYLE.get(rope.get('style'))} pairs",
                              field="meta.neutral.head_dim_order")
    elif want and rope.get("style") != want["style"]:
        raise BundleError(f"rope style {rope.get('style')!r} in the bundle; this model uses "
                          f"{want['style']!r}", field="meta.neutral.rope")
    if want and "theta" in want and not np.isclose(float(rope.get("theta", 0)), float(want["theta"]), rtol=1e-6):
        raise BundleError(f"rope theta {rope.get('theta')!r} in the bundle; this model uses {want['theta']!r}",
                          field="meta.neutral.rope")
    return "head_dim_order" in expected and meta.get("head_dim_order") != expected["head_dim_order"]


def check_import(meta: dict, identity: dict, expected: dict, n_kv_tokens: int) -> tuple[dict, bool]:
    """Every check a receiver makes before it imports a neutral bundle, each naming its field: the meta's
    form, the weights (``identity``), the shapes and conventions against ``expected`` (K may arrive in
    the other head-dim order), positions from 0, and ``n_kv_tokens`` cached tokens. Returns the meta and
    whether K must be permuted into ``expected["head_dim_order"]``."""
    meta = validate_meta(meta)
    check_model(identity, meta["model"])
    permute = check_shape(meta, expected, reorder=True)
    if meta["pos_start"] != 0:
        raise _bad(f"pos_start is {meta['pos_start']}; the cache must start at position 0", "pos_start")
    if meta["n_kv_tokens"] != n_kv_tokens:
        raise _bad(f"n_kv_tokens is {meta['n_kv_tokens']} but the bundle's token ids need {n_kv_tokens}",
                   "n_kv_tokens")
    return meta, permute
