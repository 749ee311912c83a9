"""Transformers (PyTorch) in process: CUDA on the DGX, the CPU here (how CI runs it).

The weights are the GGUF file the llama.cpp servers load, dequantised once to
float32 (``gguf_weights.py``) into a Hugging Face model directory under
``<cache>/transformers/<gguf sha256[:16]>/`` with the Q/K rows put back in the
original checkpoint's order, and loaded from there with ``local_files_only``
(``HF_HUB_OFFLINE`` is set: nothing is fetched). The fingerprint names the GGUF's
digest. Tokens come from the same file's vocabulary, read by llama.cpp
(``gguf_vocab.py``), so the ids are exactly a llama.cpp server's.

Prefill evaluates every prompt token but the last and exports ``DynamicCache``'s
K/V as a ``neutral_kv`` bundle in the model's dtype, with ``head_dim_order``
"halves": Transformers rotates halves of ``head_dim`` (RoPE "neox" style) on the
checkpoint-order weights (tests/test_transformers_backend.py compares its K with
llama.cpp's, which is "interleaved"). An MLX decode server permutes K on import.
Decode takes ``neutral_kv`` from any engine (K permuted into halves where it
arrives interleaved) or ``token_ids``; generate is the decode-only fallback.

Streamed (the overlapped handoff, ``kv/stream.py``): a forward hook after each
decoder layer hands that layer's K and V of the chunk just evaluated over
(``evaluate_streamed``), so the layers' bytes leave while the layers above them
still compute.
``json_schema`` is refused (400): no grammar-constrained sampling here.

``device``: ``auto`` (CUDA when torch sees it, else the CPU), ``cpu``, ``cuda``,
``cuda:N`` or ``mps``; ``n_threads`` sets torch's CPU threads. The verbs, the
token loop and the import's checks are those of every neutral-KV engine
(``neutral_engine.py``); this module is the model: the forward pass over a
``DynamicCache``, the cache's K/V and the sampler.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Callable

from ..errors import ConfigError
from ..kv import fingerprint as fp
from . import gguf_weights
from .base import ChatSettings, Sampling
from .gguf import resolve_gguf
from .gguf_vocab import GgufVocab
from .neutral_engine import NeutralKVBackend
from .options import option

_NEUTRAL_DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
_ENGINE_DEVICE = {"cpu": "cpu", "cuda": "gpu", "mps": "metal"}  # as canary tolerances name devices


@dataclass(frozen=True)
class TransformersSettings(ChatSettings):
    n_batch: int = option(512, "prompt tokens per forward pass", low=1)
    device: str = option("auto", "the torch device (auto: CUDA when torch sees it, else the CPU)",
                         pattern=r"auto|cpu|mps|cuda(:[0-9]+)?", expected="auto, cpu, cuda, cuda:N or mps")


class TransformersBackend(NeutralKVBackend):
    name = "transformers"
    Settings = TransformersSettings

    def __init__(self, settings):
        super().__init__(settings)
        self.device = None

    @classmethod
    def compute_threads(cls, settings) -> int:
        """torch's CPU threads: ``n_threads``, by default every core."""
        return settings.n_threads or os.cpu_count() or 2

    @property
    def engine(self) -> str:
        """``transformers/cpu``, or ``transformers/gpu`` on CUDA, ``transformers/metal`` on MPS."""
        kind = getattr(self.device, "type", "cpu")
        return f"transformers/{_ENGINE_DEVICE.get(kind, kind)}"

    # -- loading ---------------------------------------------------------------------------------

    def load(self, progress: Callable[[str], None] = lambda message: None) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import torch
        from transformers import LlamaForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights" bars in the server's log
        self.device = _device(self.settings.device)
        if self.settings.n_threads:
            torch.set_num_threads(self.settings.n_threads)
        path = resolve_gguf(self.settings.model, progress)
        digest = fp.file_sha256(path, progress)
        directory = model_dir(path, digest, progress)
        started = time.perf_counter()
        self.model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True)
        self.model.to(self.device).eval()
        self.vocab = GgufVocab(path, self.settings.chat_format)
        c = self.model.config
        self._fingerprint = {
            "backend": self.name, "library": "transformers", "library_version": package_version("transformers"),
            "torch_version": torch.__version__, "model_sha256": digest, "model_file": os.path.basename(path),
            "weights_from": "gguf", "arch": "llama", "n_layer": c.num_hidden_layers, "n_embd": c.hidden_size,
            "n_vocab": c.vocab_size, "n_ctx": self.settings.n_ctx, "device": str(self.device), "dtype": "float32",
        }
        progress(f"loaded the transformers model from {directory.name} on {self.device} "
                 f"in {time.perf_counter() - started:.1f}s")

    def describe(self) -> dict:
        return {"model_sha256": self._fingerprint.get("model_sha256"), "weights_from": "gguf",
                "n_ctx": self.settings.n_ctx, "device": self._fingerprint.get("device"),
                "torch_version": self._fingerprint.get("torch_version"), "accepts": list(self.accepts),
                "chat_format": self.vocab.chat.name if self.vocab.chat is not None else None}

    # -- the model and its cache -----------------------------------------------------------------

    def expected_layout(self) -> dict:
        c = self.model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return {"n_layer": c.num_hidden_layers, "n_kv_heads": c.num_key_value_heads, "head_dim_k": head_dim,
                "head_dim_v": head_dim, "head_dim_order": "halves",
                "rope": {"style": "neox", "theta": float(c.rope_parameters["rope_theta"])}}

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def evaluate(self, tokens, cache):
        """Run ``tokens`` through the model into ``cache`` (``n_batch`` at a time); return the last
        position's logits (a float32 tensor of the vocabulary's size)."""
        import torch

        logits = None
        step = max(1, self.settings.n_batch)
        with torch.inference_mode():
            for start in range(0, len(tokens), step):
                ids = torch.tensor([tokens[start:start + step]], device=self.device)
                logits = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        return logits[0, -1].float()

    kv_streaming = {"enabled": True, "reason": None}  # a forward hook per decoder layer (evaluate_streamed)

    def evaluate_streamed(self, tokens, cache, layer_done):
        def after(il: int):
            def hook(module, args, output):
                chunk = (output[0] if isinstance(output, tuple) else output).shape[1]
                layer = cache.layers[il]
                end = layer.keys.shape[-2]
                layer_done(il, end - chunk, end, lambda: (_as_numpy(layer.keys[0, :, end - chunk:end]),
                                                          _as_numpy(layer.values[0, :, end - chunk:end])))
            return hook

        hooks = [layer.register_forward_hook(after(il)) for il, layer in enumerate(self.model.model.layers)]
        try:
            return self.evaluate(tokens, cache)
        finally:
            for handle in hooks:
                handle.remove()

    @property
    def kv_dtype(self) -> str:
        return _NEUTRAL_DTYPES[str(self.model.dtype).removeprefix("torch.")]

    def cache_arrays(self, cache) -> tuple[list, list]:
        """``DynamicCache`` -> each layer's K and V as (n_kv_heads, n_kv_tokens, head_dim) arrays."""
        return ([_as_numpy(layer.keys[0]) for layer in cache.layers],
                [_as_numpy(layer.values[0]) for layer in cache.layers])

    def fill_cache(self, cache, layers, n_kv_tokens: int) -> None:
        import torch

        dtype = self.model.dtype
        for il, k, v in layers:
            cache.update(torch.from_numpy(k)[None].to(self.device, dtype),
                         torch.from_numpy(v)[None].to(self.device, dtype), il)

    def sampler(self, sampling: Sampling):
        return make_sampler(sampling)

    def logits_array(self, logits):
        return _as_numpy(logits)


def make_sampler(sampling: Sampling):
    """``logits -> token id``: greedy at temperature 0, else top-k, then top-p, then a draw seeded by
    ``sampling.seed`` (a fresh seed when None)."""
    import torch

    if sampling.temperature <= 0:
        return lambda logits: int(torch.argmax(logits))
    generator = torch.Generator()
    if sampling.seed is None:
        generator.seed()
    else:
        generator.manual_seed(sampling.seed)

    def sample(logits) -> int:
        x = logits.float().cpu() / sampling.temperature
        if 0 < sampling.top_k < x.numel():
            x[x < torch.topk(x, sampling.top_k).values[-1]] = float("-inf")
        if sampling.top_p < 1.0:
            ordered, order = torch.sort(x, descending=True)
            probs = torch.softmax(ordered, dim=-1)
            ordered[torch.cumsum(probs, dim=-1) - probs > sampling.top_p] = float("-inf")
            x = torch.full_like(x, float("-inf")).scatter(0, order, ordered)
        return int(torch.multinomial(torch.softmax(x, dim=-1), 1, generator=generator))

    return sample


def model_dir(gguf_path, digest: str, progress=lambda message: None) -> Path:
    """The Hugging Face model directory for this GGUF file (checkpoint-order Q/K rows), made on first use."""

    def write(tmp: Path) -> None:
        from safetensors.numpy import save_file

        weights, config = gguf_weights.read(gguf_path, "transformers")
        gguf_weights.unpermute_qk(weights, config)
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        theta = config.pop("rope_theta")
        (tmp / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", **config, "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": theta}, "dtype": "float32"}, indent=1))

    return gguf_weights.cached_dir("transformers", gguf_path, digest, write, progress)


def _device(setting: str):
    import torch

    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(setting)
    available = {"cuda": torch.cuda.is_available, "mps": lambda: torch.backends.mps.is_available()}
    if device.type in available and not available[device.type]():
        raise ConfigError(f"device is {setting!r} but this torch ({torch.__version__}) has no {device.type} device "
                          "here; use 'auto' or 'cpu'", field="device")
    return device


def _as_numpy(tensor):
    """A tensor as a numpy array on the CPU (bfloat16 as its raw bits, as the neutral layout keeps them)."""
    import torch

    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).cpu().numpy().view("<u2")
    return tensor.cpu().numpy()
