"""llama.cpp per-sequence state <-> the neutral KV layout, parsed and written with numpy.

The state ``llama_state_seq_get_data`` writes for one sequence of a plain
(non-SWA) KV cache, as llama.cpp's ``src/llama-kv-cache.cpp`` (``state_write``,
``state_write_meta``, ``state_write_data``) lays it out in the version
llama-cpp-python 0.3.36 vendors (all integers little-endian)::

    u64 0xAF143CD8                    a tag the vendored version writes first (checked, written back)
    u32 n_stream                      1 for one sequence
    u32 cell_count                    cached tokens of the sequence
    cell_count x (i32 pos, u32 n_seq_id = 1, i32 seq_id)
    u32 v_trans                       1 when V is stored transposed (flash attention off)
    u32 n_layer
    n_layer x (i32 k_type, u64 k_row_bytes, cell_count rows of k_row_bytes)
    if not v_trans: n_layer x (i32 v_type, u64 v_row_bytes, cell_count rows of v_row_bytes)
    if v_trans:     n_layer x (i32 v_type, u32 v_elem_bytes, u32 n_embd_v_gqa,
                               n_embd_v_gqa x cell_count elements)

A K row is one cell's ``n_kv_heads * head_dim`` values, head after head; a
transposed V layer is ``(n_embd_v_gqa, cell_count)``. Only f32, f16 and bf16
K/V are converted; quantized cache types are refused. Sliding-window models
(two caches in one state) are refused too: the neutral kind carries one cache.

``to_neutral(...)`` then ``from_neutral(...)`` rebuilds the same bytes, so the
round trip imports back into llama.cpp and continues bit-exactly.
"""
from __future__ import annotations

import struct

import numpy as np

from ..errors import BundleError
from .neutral import NeutralKV, check_import, decode, encode, reorder_head_dim, to_float32

# ggml type ids of the cache types we convert, and their neutral names
GGML_TYPES = {0: "f32", 1: "f16", 30: "bf16"}
GGML_IDS = {name: i for i, name in GGML_TYPES.items()}
GGML_NAMES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 30: "bf16"}
STATE_TAG = 0xAF143CD8  # measured: the first u64 of every state llama-cpp-python 0.3.36 wrote (SmolLM2, Gemma 3)
_CELL = np.dtype([("pos", "<i4"), ("n_seq", "<u4"), ("seq", "<i4")])
_NP = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2"), "bf16": np.dtype("<u2")}


class _Reader:
    def __init__(self, blob):
        self.view = memoryview(blob).cast("B")
        self.at = 0

    def take(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        if self.at + size > len(self.view):
            raise BundleError(f"llama.cpp state truncated in {what} at byte {self.at}", field="kv")
        values = struct.unpack_from(fmt, self.view, self.at)
        self.at += size
        return values if len(values) > 1 else values[0]

    def array(self, dtype: np.dtype, count: int, what: str) -> np.ndarray:
        size = dtype.itemsize * count
        if self.at + size > len(self.view):
            raise BundleError(f"llama.cpp state truncated in {what} at byte {self.at}", field="kv")
        out = np.frombuffer(self.view, dtype=dtype, count=count, offset=self.at)
        self.at += size
        return out


def _cache_type(type_id: int, what: str) -> str:
    if type_id not in GGML_TYPES:
        name = GGML_NAMES.get(type_id, f"ggml type {type_id}")
        raise BundleError(f"{what} cache type {name} is quantized or unknown: only f32, f16 and bf16 K/V "
                          "convert to the neutral layout (run the prefill server with type_k/type_v f16)",
                          field="type_k" if what == "K" else "type_v")
    return GGML_TYPES[type_id]


def to_neutral(blob, *, n_kv_heads: int, rope: dict, head_dim_order: str = "interleaved",
               model: dict | None = None) -> tuple[NeutralKV, bool]:
    """Parse one sequence's llama.cpp state; return it as ``NeutralKV`` and whether V was transposed.

    ``n_kv_heads`` (the model's KV head count) splits a row into heads; the
    state itself only knows row sizes.
    """
    r = _Reader(blob)
    tag = r.take("<Q", "leading tag")
    if tag != STATE_TAG:
        raise BundleError(f"llama.cpp state starts with {tag:#x}, not {STATE_TAG:#x}: a state layout "
                          "this converter does not know (another llama.cpp version?)", field="kv")
    n_stream = r.take("<I", "stream count")
    if n_stream != 1:
        raise BundleError(f"llama.cpp state holds {n_stream} streams; one sequence's state has 1 "
                          "(a sliding-window model's two caches are not converted)", field="kv")
    n_cells = r.take("<I", "cell count")
    if n_cells == 0:
        raise BundleError("llama.cpp state holds no cells", field="kv")
    cells = r.array(_CELL, n_cells, "cell metadata")
    if (cells["n_seq"] != 1).any():
        raise BundleError("llama.cpp state has cells of several sequences (not one sequence's state)", field="kv")
    pos = cells["pos"]
    if not np.array_equal(pos, np.arange(pos[0], pos[0] + n_cells, dtype=pos.dtype)):
        raise BundleError("llama.cpp state's positions are not contiguous; the neutral layout needs them to be",
                          field="kv")
    v_trans = bool(r.take("<I", "v_trans"))
    n_layer = r.take("<I", "layer count")
    keys, values, dtype = [], [], None
    for il in range(n_layer):
        name = _cache_type(r.take("<i", "K type"), "K")
        row = r.take("<Q", "K row size")
        item = _NP[name].itemsize
        if row % (item * n_kv_heads):
            raise BundleError(f"K row of {row} bytes does not split into {n_kv_heads} heads of {name}",
                              field="n_kv_heads")
        head_dim = row // item // n_kv_heads
        k = r.array(_NP[name], n_cells * n_kv_heads * head_dim, f"K of layer {il}")
        keys.append(k.reshape(n_cells, n_kv_heads, head_dim).transpose(1, 0, 2))
        dtype = dtype or name
    for il in range(n_layer):
        name = _cache_type(r.take("<i", "V type"), "V")
        item = _NP[name].itemsize
        if v_trans:
            elem, n_embd_v = r.take("<II", "V element size")
            if elem != item:
                raise BundleError(f"V element of {elem} bytes is not {name}", field="type_v")
            v = r.array(_NP[name], n_embd_v * n_cells, f"V of layer {il}").reshape(n_embd_v, n_cells)
            v = v.reshape(n_kv_heads, n_embd_v // n_kv_heads, n_cells).transpose(0, 2, 1)
        else:
            row = r.take("<Q", "V row size")
            head_dim_v = row // item // n_kv_heads
            v = r.array(_NP[name], n_cells * n_kv_heads * head_dim_v, f"V of layer {il}")
            v = v.reshape(n_cells, n_kv_heads, head_dim_v).transpose(1, 0, 2)
        values.append(v)
        if name != dtype:
            raise BundleError(f"K is {dtype} but V is {name}; the neutral layout has one dtype", field="type_v")
    if r.at != len(r.view):
        raise BundleError(f"llama.cpp state has {len(r.view) - r.at} bytes after the last V layer "
                          "(a layout this converter does not know)", field="kv")
    return NeutralKV(keys, values, dtype=dtype, pos_start=int(pos[0]), rope=dict(rope),
                     head_dim_order=head_dim_order, model=dict(model or {})), v_trans


def from_neutral(kv: NeutralKV, *, v_trans: bool) -> bytearray:
    """The llama.cpp per-sequence state holding ``kv`` (V transposed when ``v_trans``: flash attention off)."""
    if kv.dtype not in GGML_IDS:
        raise BundleError(f"neutral dtype {kv.dtype!r} has no llama.cpp cache type", field="meta.neutral.dtype")
    n = kv.n_kv_tokens
    item = _NP[kv.dtype]
    type_id = GGML_IDS[kv.dtype]
    parts = [struct.pack("<QII", STATE_TAG, 1, n)]
    cells = np.zeros(n, dtype=_CELL)
    cells["pos"] = np.arange(kv.pos_start, kv.pos_start + n)
    cells["n_seq"] = 1
    parts.append(cells.tobytes())
    parts.append(struct.pack("<II", int(v_trans), kv.n_layer))
    for k in kv.keys:
        h, _, d = k.shape
        parts.append(struct.pack("<iQ", type_id, h * d * item.itemsize))
        parts.append(np.ascontiguousarray(k.transpose(1, 0, 2), dtype=item).tobytes())
    for v in kv.values:
        h, _, d = v.shape
        if v_trans:
            parts.append(struct.pack("<iII", type_id, item.itemsize, h * d))
            parts.append(np.ascontiguousarray(v.transpose(0, 2, 1), dtype=item).tobytes())
        else:
            parts.append(struct.pack("<iQ", type_id, h * d * item.itemsize))
            parts.append(np.ascontiguousarray(v.transpose(1, 0, 2), dtype=item).tobytes())
    return bytearray(b"".join(parts))


# llama.cpp RoPE per GGUF architecture, for the archs converted here: llama-family GGUF files had their
# Q/K rows permuted by the converter, so llama.cpp rotates interleaved pairs ("norm") of K as it caches it.
# The Qwen 3 families are converted with their rows as the checkpoint has them and rotated NEOX-style
# (llama.cpp's llama_model_rope_type): K is cached in "halves" order, as vLLM and Transformers cache the
# checkpoint's. That the two engines' K then agree is read from both sources, not yet measured across
# engines here (no second engine runs qwen3moe in CI); a wrong order is what the canary refuses.
ARCH_ROPE = {"llama": ("norm", "interleaved"), "qwen3": ("neox", "halves"), "qwen3moe": ("neox", "halves")}


def llama_layout(metadata: dict, field: str = "kv_kind") -> dict:
    """The neutral layout of a llama.cpp cache (``n_layer``, ``n_kv_heads``, ``head_dim_k``/``head_dim_v``,
    ``head_dim_order``, ``rope``) from its GGUF's key/value metadata, for the architectures converted here."""
    arch = metadata.get("general.architecture")
    if arch not in ARCH_ROPE:
        raise BundleError(f"converting {arch!r} state to or from neutral_kv is not supported (known: "
                          f"{', '.join(ARCH_ROPE)})", field=field)
    style, order = ARCH_ROPE[arch]
    n_head = int(metadata[f"{arch}.attention.head_count"])
    head_dim = int(metadata[f"{arch}.embedding_length"]) // n_head
    return {"n_layer": int(metadata[f"{arch}.block_count"]),
            "n_kv_heads": int(metadata.get(f"{arch}.attention.head_count_kv", n_head)),
            "head_dim_k": int(metadata.get(f"{arch}.attention.key_length", head_dim)),
            "head_dim_v": int(metadata.get(f"{arch}.attention.value_length", head_dim)),
            "head_dim_order": order,
            "rope": {"theta": float(metadata.get(f"{arch}.rope.freq_base", 10000.0)), "style": style}}


def llama_state_as_neutral(state, metadata: dict, model_sha256: str) -> tuple[dict, bytearray]:
    """A llama.cpp sequence state as a neutral bundle's ``meta["neutral"]`` and payload.

    ``metadata`` is the GGUF file's key/value metadata (``llama_cpp.Llama.metadata``):
    it gives the KV head count and the RoPE base the state itself does not carry.
    """
    layout = llama_layout(metadata)
    kv, _ = to_neutral(state, n_kv_heads=layout["n_kv_heads"], rope=layout["rope"],
                       head_dim_order=layout["head_dim_order"],
                       model={"model_sha256": model_sha256, "arch": metadata.get("general.architecture")})
    return encode(kv)


def neutral_as_llama_state(meta: dict, payload, metadata: dict, identity: dict, *, n_kv_tokens: int, type_k: str,
                           type_v: str, v_trans: bool) -> bytearray:
    """A neutral bundle as the llama.cpp sequence state a context of these cache types reads (the
    single-stream form, kv/llama_state.py), after the checks a neutral import makes everywhere: the
    weights (``identity``: model_sha256, arch), the shapes, the positions and the token count. K
    arriving in "halves" order is permuted into llama.cpp's; values are converted to the cache type
    (f32, f16 or bf16, the same for K and V; quantized caches are refused, naming the key)."""
    for key, wanted in (("type_k", type_k), ("type_v", type_v)):
        if wanted not in GGML_IDS:
            raise BundleError(f"this server's {key} is {wanted}: neutral K/V is written into f32, f16 or bf16 "
                              "caches only", field=key)
    if type_k != type_v:
        raise BundleError(f"type_k {type_k} and type_v {type_v} differ: a neutral import writes one cache type",
                          field="type_v")
    layout = llama_layout(metadata, field="kv")
    meta, _ = check_import(meta, identity, layout, n_kv_tokens)
    if n_kv_tokens == 0:
        raise BundleError("the bundle carries no cached tokens; send the token ids instead",
                          field="meta.neutral.n_kv_tokens")
    kv = reorder_head_dim(decode(meta, payload), layout["head_dim_order"])
    if kv.dtype != type_k:
        kv = NeutralKV([_cache_values(k, kv.dtype, type_k) for k in kv.keys],
                       [_cache_values(v, kv.dtype, type_k) for v in kv.values], dtype=type_k, pos_start=kv.pos_start,
                       rope=kv.rope, head_dim_order=kv.head_dim_order, model=kv.model)
    return from_neutral(kv, v_trans=v_trans)


def _cache_values(array: np.ndarray, dtype: str, cache_type: str) -> np.ndarray:
    """An array of neutral ``dtype`` as ``cache_type`` (bf16: float32 rounded to nearest even, as raw bits)."""
    x = to_float32(array, dtype)
    if cache_type == "bf16":
        bits = x.view(np.uint32)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return x.astype(_NP[cache_type])
