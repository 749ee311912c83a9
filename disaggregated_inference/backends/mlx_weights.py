"""A GGUF file's weights as an mlx-lm model directory: dequantised once, cached, no downloads.

The tensors come from ``gguf_weights.read`` (float32, Hugging Face names) and are
written to ``<cache>/mlx/<gguf sha256[:16]>/`` as ``model.safetensors`` +
``config.json``, which ``mlx_lm.utils.load_model`` reads; ``source.json`` names
the GGUF digest they were derived from.

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
from pathlib import Path

from . import gguf_weights


def model_dir(gguf_path: str | os.PathLike, digest: str, progress=lambda message: None) -> Path:
    """The mlx-lm model directory for this GGUF file, converted on first use."""

    def write(tmp: Path) -> None:
        import mlx.core as mx

        weights, config = gguf_weights.read(gguf_path, "MLX")
        config = {"model_type": "llama", **config,
                  "rope_traditional": True}  # GGUF Q/K row order: rotate interleaved pairs, as llama.cpp does
        mx.save_safetensors(str(tmp / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
        (tmp / "config.json").write_text(json.dumps(config, indent=1))

    return gguf_weights.cached_dir("mlx", gguf_path, digest, write, progress)
