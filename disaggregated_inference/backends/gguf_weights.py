"""A llama-family GGUF file's weights as float32 numpy arrays under Hugging Face names, and its config.

The MLX and transformers backends run the very weights the llama.cpp servers run:
each tensor of the GGUF file is dequantised to float32 with the ``gguf`` package
and named as the original checkpoint names it (``model.layers.0.self_attn.q_proj.weight``).
Each backend writes them once into a model directory of its own under
``<cache>/<engine>/<gguf sha256[:16]>/`` (``cached_dir``), whose ``source.json``
names the GGUF digest it was derived from. No downloads.

The GGUF converter of llama-family models permuted the rows of the Q and K
projections (per head, so that llama.cpp rotates interleaved pairs, RoPE "norm"
style). ``read`` returns the rows as the GGUF file holds them; ``unpermute_qk``
restores the original checkpoint's order, in which Transformers rotates halves
(RoPE "neox" style). Both compute the same attention; only the order of
``head_dim`` in cached K differs (``kv/neutral.py``, ``head_dim_order``).
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from ..errors import ConfigError

ARCHS = ("llama",)  # GGUF architectures whose tensors map onto the llama model of mlx-lm and transformers
_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def cache_root(engine: str) -> Path:
    """Where ``engine``'s model directories live: ``$DISAGG_CACHE_DIR/<engine>`` or ``~/.cache/...``."""
    return Path(os.environ.get("DISAGG_CACHE_DIR", Path.home() / ".cache" / "disaggregated-inference")) / engine


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{parts[3]}"
    return f"{_TOP[parts[0]]}.{parts[1]}"


def read(gguf_path: str | os.PathLike, backend: str) -> tuple[dict, dict]:
    """``(weights, config)``: every tensor dequantised to float32 under its Hugging Face name (Q/K rows
    in the GGUF's order), and the llama config keys the file's metadata gives. ``backend`` names
    who asks, for the refusal of an architecture this module does not map."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")
    if arch not in ARCHS:
        raise ConfigError(f"the {backend} backend converts GGUF architectures {', '.join(ARCHS)}; "
                          f"{os.path.basename(gguf_path)} is {arch!r}", field="model")
    weights = {hf_name(t.name): gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
               for t in reader.tensors}
    n_head = int(_field(reader, f"{arch}.attention.head_count"))
    n_embd = int(_field(reader, f"{arch}.embedding_length"))
    config = {
        "hidden_size": n_embd,
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", n_head)),
        "head_dim": int(_field(reader, f"{arch}.rope.dimension_count", n_embd // n_head)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "vocab_size": int(weights["model.embed_tokens.weight"].shape[0]),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 4096)),
    }
    return weights, config


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo the GGUF converter's per-head row permutation of a Q or K projection (``n_head``: Q heads
    for Q, KV heads for K): within each head, row ``2i + j`` goes back to ``j * head_dim/2 + i``."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(weights: dict, config: dict) -> dict:
    """``weights`` with every layer's Q and K rows in the original checkpoint's order (in place)."""
    for il in range(config["num_hidden_layers"]):
        for proj, heads in (("q_proj", config["num_attention_heads"]), ("k_proj", config["num_key_value_heads"])):
            name = f"model.layers.{il}.self_attn.{proj}.weight"
            weights[name] = np.ascontiguousarray(unpermute_rows(weights[name], heads))
    return weights


def cached_dir(engine: str, gguf_path, digest: str, write, progress=lambda message: None) -> Path:
    """The model directory ``<cache>/<engine>/<digest[:16]>``, made on first use by ``write(tmp_dir)``
    (the converted weights and config), then ``source.json`` naming the GGUF it came from."""
    out = cache_root(engine) / digest[:16]
    if (out / "source.json").exists():
        return out
    started = time.perf_counter()
    progress(f"converting {os.path.basename(gguf_path)} to a {engine} model directory (once)")
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    write(tmp)
    (tmp / "source.json").write_text(json.dumps({"gguf_sha256": digest, "gguf_file": os.path.basename(gguf_path),
                                                 "dtype": "float32"}, indent=1))
    try:
        tmp.rename(out)
    except OSError:  # another process converted it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    progress(f"converted in {time.perf_counter() - started:.1f}s")
    return out
