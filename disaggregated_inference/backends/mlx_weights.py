"""A GGUF file's weights as an mlx-lm model directory: dequantised once, cached, no downloads.

The MLX backend runs the very weights the llama.cpp servers run: each tensor of
the GGUF file is dequantised to float32 with the ``gguf`` package and written to
``<cache>/mlx/<gguf sha256[:16]>/`` as ``model.safetensors`` + ``config.json``,
which ``mlx_lm.utils.load_model`` reads. The directory's ``source.json`` names
the GGUF digest it was derived from.

The GGUF converter of llama-family models permuted the rows of the Q and K
projections so that llama.cpp can rotate interleaved pairs (RoPE "norm" style).
The rows are kept as they are in the GGUF file and mlx-lm is told to rotate the
same pairs (``rope_traditional: true``), so MLX computes what llama.cpp computes
and caches K in the same head-dim order ("interleaved" in the neutral layout):
llama.cpp K drops into an MLX cache with no permutation. tests/test_mlx_backend.py
checks this against llama.cpp's own cached K.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ..errors import ConfigError

ARCHS = ("llama",)  # GGUF architectures whose tensors map onto mlx-lm's llama model
_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def cache_root() -> Path:
    return Path(os.environ.get("DISAGG_CACHE_DIR", Path.home() / ".cache" / "disaggregated-inference")) / "mlx"


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    return value


def _mlx_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{parts[3]}"
    return f"{_TOP[parts[0]]}.{parts[1]}"


def model_dir(gguf_path: str | os.PathLike, digest: str, progress=lambda message: None) -> Path:
    """The mlx-lm model directory for this GGUF file, converted on first use."""
    out = cache_root() / digest[:16]
    if (out / "source.json").exists():
        return out
    import gguf
    import mlx.core as mx

    started = time.perf_counter()
    reader = gguf.GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")
    if arch not in ARCHS:
        raise ConfigError(f"the MLX backend converts GGUF architectures {', '.join(ARCHS)}; "
                          f"{os.path.basename(gguf_path)} is {arch!r}", field="model")
    progress(f"converting {os.path.basename(gguf_path)} to an MLX model (once)")
    n_head = int(_field(reader, f"{arch}.attention.head_count"))
    n_embd = int(_field(reader, f"{arch}.embedding_length"))
    weights = {}
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype("float32")
        weights[_mlx_name(tensor.name)] = mx.array(values)
    config = {
        "model_type": "llama",
        "hidden_size": n_embd,
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", n_head)),
        "head_dim": int(_field(reader, f"{arch}.rope.dimension_count", n_embd // n_head)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "vocab_size": int(weights["model.embed_tokens.weight"].shape[0]),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_traditional": True,  # GGUF Q/K row order: rotate interleaved pairs, as llama.cpp does
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 4096)),
    }
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(tmp / "model.safetensors"), weights)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    (tmp / "source.json").write_text(json.dumps({"gguf_sha256": digest, "gguf_file": os.path.basename(gguf_path),
                                                 "dtype": "float32"}, indent=1))
    try:
        tmp.rename(out)
    except OSError:  # another process converted it meanwhile
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    progress(f"converted in {time.perf_counter() - started:.1f}s")
    return out
