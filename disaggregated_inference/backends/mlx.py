"""MLX (mlx-lm) in process: Metal on Apple Silicon, the CPU build on Linux (how CI runs it).

The weights are the GGUF file the llama.cpp servers load, dequantised once into
an mlx-lm model directory (``mlx_weights.py``); the fingerprint names that
file's digest. Tokens come from the same file's vocabulary, read by llama.cpp
with ``vocab_only`` (``gguf_vocab.py``: exactly the ids a llama.cpp prefill server
produces); the chat template is the GGUF's own.

Prefill evaluates every prompt token but the last and exports mlx-lm's cache
arrays as a ``neutral_kv`` bundle (float32, as MLX holds them: no conversion).
Decode accepts ``neutral_kv`` (from MLX; from llama.cpp, converted on the
prefill server, see ``kv/convert.py``; from transformers, whose K arrives in the
other head-dim order and is permuted here on import) and ``token_ids``; it
refuses K/V from other weights or of other shapes, naming the field. ``json_schema`` is refused
(400): mlx-lm has no grammar-constrained sampling. The verbs, the token loop and
the import's checks are those of every neutral-KV engine (``neutral_engine.py``);
this module is the model: mlx-lm's forward pass, cache and sampler.
"""
from __future__ import annotations

import os
import time
from importlib.metadata import version as package_version
from typing import Callable

from ..kv import fingerprint as fp
from .base import Sampling
from .gguf import resolve_gguf
from .gguf_vocab import GgufVocab
from .neutral_engine import NeutralKVBackend

PREFILL_STEP = 512


class MlxBackend(NeutralKVBackend):
    name = "mlx"

    def __init__(self, settings):
        super().__init__(settings)
        self.config: dict = {}

    @property
    def engine(self) -> str:
        return "mlx/metal"

    # -- loading ---------------------------------------------------------------------------------

    def load(self, progress: Callable[[str], None] = lambda message: None) -> None:
        from mlx_lm.utils import load_model

        from .mlx_weights import model_dir

        path = resolve_gguf(self.settings.model, progress)
        digest = fp.file_sha256(path, progress)
        directory = model_dir(path, digest, progress)
        started = time.perf_counter()
        self.model, self.config = load_model(directory)
        self.vocab = GgufVocab(path, self.settings.chat_format)
        c = self.config
        self._fingerprint = {
            "backend": self.name, "library": "mlx-lm", "library_version": package_version("mlx-lm"),
            "mlx_version": package_version("mlx"), "model_sha256": digest, "model_file": os.path.basename(path),
            "weights_from": "gguf", "arch": "llama", "n_layer": c["num_hidden_layers"], "n_embd": c["hidden_size"],
            "n_ctx": self.settings.n_ctx,
        }
        progress(f"loaded MLX model from {directory.name} in {time.perf_counter() - started:.1f}s")

    def describe(self) -> dict:
        return {"model_sha256": self._fingerprint.get("model_sha256"), "weights_from": "gguf",
                "n_ctx": self.settings.n_ctx, "mlx_version": self._fingerprint.get("mlx_version"),
                "accepts": list(self.accepts),
                "chat_format": self.vocab.chat.name if self.vocab.chat is not None else None}

    # -- the model and its cache -----------------------------------------------------------------

    def expected_layout(self) -> dict:
        c = self.config
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return {"n_layer": c["num_hidden_layers"], "n_kv_heads": c["num_key_value_heads"], "head_dim_k": head_dim,
                "head_dim_v": head_dim, "head_dim_order": "interleaved" if c.get("rope_traditional") else "halves",
                "rope": {"style": "norm" if c.get("rope_traditional") else "neox", "theta": c["rope_theta"]}}

    def new_cache(self):
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)

    def evaluate(self, tokens, cache):
        """Run ``tokens`` through the model into ``cache``; return the last position's logits (mx array)."""
        import mlx.core as mx

        logits = None
        for start in range(0, len(tokens), PREFILL_STEP):
            logits = self.model(mx.array(tokens[start:start + PREFILL_STEP])[None], cache=cache)[:, -1, :]
            mx.eval(logits, [c.state for c in cache])
        return logits

    def step(self, token: int, cache):
        """The next token's logits, left lazy: sampling them evaluates them."""
        import mlx.core as mx

        return self.model(mx.array([[token]]), cache=cache)[:, -1, :]

    kv_dtype = "f32"  # as MLX holds the dequantised weights' K/V: no conversion on export

    def cache_arrays(self, cache) -> tuple[list, list]:
        import numpy as np

        return ([np.array(c.keys[0, :, :c.offset, :], copy=False) for c in cache],
                [np.array(c.values[0, :, :c.offset, :], copy=False) for c in cache])

    def fill_cache(self, cache, layers, n_kv_tokens: int) -> None:
        import mlx.core as mx

        dtype = self.model.model.embed_tokens.weight.dtype
        for c, (_, k, v) in zip(cache, layers):
            c.keys = mx.array(k)[None].astype(dtype)
            c.values = mx.array(v)[None].astype(dtype)
            c.offset = n_kv_tokens
        mx.eval([c.state for c in cache])

    def sampler(self, sampling: Sampling):
        import mlx.core as mx
        from mlx_lm.sample_utils import make_sampler

        if sampling.seed is not None:
            mx.random.seed(sampling.seed)
        sample = make_sampler(temp=sampling.temperature, top_p=sampling.top_p if sampling.top_p < 1.0 else 0.0,
                              top_k=sampling.top_k if sampling.temperature > 0 else 0)
        return lambda logits: sample(logits - mx.logsumexp(logits, axis=-1, keepdims=True)).item()

    def logits_array(self, logits):
        """One position's logits (an mx array of shape (1, vocab)) as a float32 numpy vector."""
        import mlx.core as mx
        import numpy as np

        return np.array(logits[0].astype(mx.float32))
