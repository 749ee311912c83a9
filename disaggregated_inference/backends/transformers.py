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
decoder layer copies that layer's K and V of the chunk just evaluated into their
place in the neutral payload and hands them over as one piece, so the layers'
bytes leave while the layers above them still compute.
``json_schema`` is refused (400): no grammar-constrained sampling here.

``device``: ``auto`` (CUDA when torch sees it, else the CPU), ``cpu``, ``cuda``,
``cuda:N`` or ``mps``; ``n_threads`` sets torch's CPU threads.
"""
from __future__ import annotations

import json
import os
import time
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Callable, Iterator

from ..errors import BadRequest, BundleError, ConfigError, FingerprintMismatch
from ..kv import buffers
from ..kv import fingerprint as fp
from ..kv import neutral
from ..kv.bundle import KIND_NEUTRAL_KV, KIND_TOKEN_IDS
from . import gguf_weights
from .base import Backend, Event, Prefilled, Prompt, Received, Sampling, check_fits, rate
from .gguf import resolve_gguf
from .gguf_vocab import GgufVocab, generation_metrics, stream_text

_NEUTRAL_DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
_ENGINE_DEVICE = {"cpu": "cpu", "cuda": "gpu", "mps": "metal"}  # as canary tolerances name devices


class TransformersBackend(Backend):
    name = "transformers"
    handoff_kind = KIND_NEUTRAL_KV
    accepts = (KIND_NEUTRAL_KV, KIND_TOKEN_IDS)

    def __init__(self, settings):
        super().__init__(settings)
        self.model = None
        self.device = None
        self.vocab: GgufVocab | None = None
        self._fingerprint: dict = {}
        self._evaluated = 0
        self.kv_convert_time: float | None = None  # the last import's K permutation, when it needed one

    @property
    def engine(self) -> str:
        """``transformers/cpu``, or ``transformers/gpu`` on CUDA, ``transformers/metal`` on MPS."""
        kind = getattr(self.device, "type", "cpu")
        return f"transformers/{_ENGINE_DEVICE.get(kind, kind)}"

    @property
    def slots(self) -> int:
        """One request at a time: this backend does not batch (``parallel`` is ignored)."""
        return 1

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
        self.vocab = GgufVocab(path)
        c = self.model.config
        self._fingerprint = {
            "backend": self.name, "library": "transformers", "library_version": package_version("transformers"),
            "torch_version": torch.__version__, "model_sha256": digest, "model_file": os.path.basename(path),
            "weights_from": "gguf", "arch": "llama", "n_layer": c.num_hidden_layers, "n_embd": c.hidden_size,
            "n_vocab": c.vocab_size, "n_ctx": self.settings.n_ctx, "device": str(self.device), "dtype": "float32",
        }
        progress(f"loaded the transformers model from {directory.name} on {self.device} "
                 f"in {time.perf_counter() - started:.1f}s")

    def fingerprint(self) -> dict:
        return dict(self._fingerprint)

    def describe(self) -> dict:
        return {"model_sha256": self._fingerprint.get("model_sha256"), "weights_from": "gguf",
                "n_ctx": self.settings.n_ctx, "device": self._fingerprint.get("device"),
                "torch_version": self._fingerprint.get("torch_version"), "accepts": list(self.accepts)}

    def close(self) -> None:
        self.model = None
        if self.vocab is not None:
            self.vocab.close()
            self.vocab = None

    # -- what a neutral bundle must be to continue here --------------------------------------------

    def identity(self) -> dict:
        return {"model_sha256": self._fingerprint["model_sha256"], "arch": self._fingerprint["arch"]}

    def expected_layout(self) -> dict:
        c = self.model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return {"n_layer": c.num_hidden_layers, "n_kv_heads": c.num_key_value_heads, "head_dim_k": head_dim,
                "head_dim_v": head_dim, "head_dim_order": "halves",
                "rope": {"style": "neox", "theta": float(c.rope_parameters["rope_theta"])}}

    # -- the cache -------------------------------------------------------------------------------

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
        self._evaluated += len(tokens)
        return logits[0, -1].float()

    def export_neutral(self, cache, n_kv_tokens: int) -> neutral.NeutralKV:
        """``DynamicCache`` -> neutral: each layer's K and V as (n_kv_heads, n_kv_tokens, head_dim) arrays."""
        layout = self.expected_layout()
        dtype = _NEUTRAL_DTYPES[str(self.model.dtype).removeprefix("torch.")]
        if n_kv_tokens == 0:
            import numpy as np

            shape = (layout["n_kv_heads"], 0, layout["head_dim_k"])
            keys = [np.zeros(shape, np.float32) for _ in range(layout["n_layer"])]
            values = [k.copy() for k in keys]
        else:
            keys = [_as_numpy(layer.keys[0]) for layer in cache.layers]
            values = [_as_numpy(layer.values[0]) for layer in cache.layers]
        return neutral.NeutralKV(keys, values, dtype=dtype, pos_start=0, rope=layout["rope"],
                                 head_dim_order=layout["head_dim_order"], model=self.identity())

    def import_neutral(self, meta: dict, payload, n_kv_tokens: int):
        """neutral -> ``DynamicCache``, checked against this model first (K permuted into halves if need be)."""
        import torch

        meta = neutral.validate_meta(meta)
        neutral.check_model(self.identity(), meta["model"])
        layout = self.expected_layout()
        perm = neutral.head_dim_permutation(layout["head_dim_order"], meta["head_dim_k"]) \
            if neutral.check_shape(meta, layout, reorder=True) else None
        if meta["pos_start"] != 0:
            raise BundleError(f"pos_start is {meta['pos_start']}; the cache must start at position 0",
                              field="meta.neutral.pos_start")
        if meta["n_kv_tokens"] != n_kv_tokens:
            raise BundleError(f"n_kv_tokens is {meta['n_kv_tokens']} but the bundle's token ids need {n_kv_tokens}",
                              field="meta.neutral.n_kv_tokens")
        cache = self.new_cache()
        self.kv_convert_time = None if perm is None else 0.0
        if n_kv_tokens == 0:
            return cache
        dtype = self.model.dtype
        for il, k, v in neutral.iter_layers(meta, payload):
            k = neutral.to_float32(k, meta["dtype"])
            if perm is not None:
                t = time.perf_counter()
                k = k[..., perm]
                self.kv_convert_time += time.perf_counter() - t
            k = torch.from_numpy(k)
            v = torch.from_numpy(neutral.to_float32(v, meta["dtype"]))
            cache.update(k[None].to(self.device, dtype), v[None].to(self.device, dtype), il)
        return cache

    # -- the verbs -------------------------------------------------------------------------------

    kv_streaming = {"enabled": True, "reason": None}  # prefill streams its KV layer by layer (kv_stream)

    def prefill(self, prompt: Prompt, kv_stream=None) -> Prefilled:
        t0 = time.perf_counter()
        tokens, stops = self.vocab.tokenize(prompt)
        tokenize_time = time.perf_counter() - t0
        check_fits(len(tokens), self.settings.n_ctx)
        cache = self.new_cache()
        t1 = time.perf_counter()
        if kv_stream is not None:
            meta, payload, export_time = self._prefill_streamed(tokens, cache, stops, kv_stream)
            prefill_time = time.perf_counter() - t1
        else:
            if len(tokens) > 1:
                self.evaluate(tokens[:-1], cache)
            prefill_time = time.perf_counter() - t1
            t2 = time.perf_counter()
            meta, payload = neutral.encode(self.export_neutral(cache, len(tokens) - 1))
            export_time = time.perf_counter() - t2
        evaluated = len(tokens) - 1
        extra = {"stop": list(stops), "neutral": meta}
        t3 = time.perf_counter()
        if self.canary.top_k > 0:  # after the export: the bundle still ends one token early (kv/canary.py)
            extra["canary"] = self.canary.make(_as_numpy(self.evaluate(tokens[-1:], cache)), self.engine)
        canary_time = time.perf_counter() - t3
        return Prefilled(
            kind=KIND_NEUTRAL_KV, tokens=tokens, payload=payload, fingerprint=self.fingerprint(), meta=extra,
            metrics={"prompt_tokens": len(tokens), "prompt_tokens_evaluated": evaluated,
                     "tokenize_time": round(tokenize_time, 6), "prefill_time": round(prefill_time, 6),
                     "prefill_speed": rate(evaluated, prefill_time),
                     # streamed: the layers' copies into the payload, made during the prefill (part of it)
                     "kv_read_time" if kv_stream is not None else "kv_export_time": round(export_time, 6),
                     "kv_bytes": len(memoryview(payload).cast("B")),
                     "handoff_mode": "streamed" if kv_stream is not None else "whole",
                     "canary_ms": round(canary_time * 1000, 3) if "canary" in extra else None},
        )

    def _prefill_streamed(self, tokens, cache, stops, sink) -> tuple[dict, object, float]:
        """Evaluate ``tokens[:-1]`` into ``cache`` handing ``sink`` each layer's K and V of each chunk as soon
        as that layer has run on it (a forward hook per decoder layer); returns (meta, payload, copy time)."""
        n, layout = len(tokens) - 1, self.expected_layout()
        meta = neutral.validate_meta({
            "layout": neutral.LAYOUT, "dtype": _NEUTRAL_DTYPES[str(self.model.dtype).removeprefix("torch.")],
            "n_layer": layout["n_layer"], "n_kv_heads": layout["n_kv_heads"], "head_dim_k": layout["head_dim_k"],
            "head_dim_v": layout["head_dim_v"], "n_kv_tokens": n, "pos_start": 0, "rope": layout["rope"],
            "head_dim_order": layout["head_dim_order"], "model": self.identity()})
        payload = buffers.sendable(neutral.payload_bytes(meta))
        buffers.populate(payload)
        arrays = [(k, v) for _, k, v in neutral.iter_layers(meta, payload)]
        sink.open(KIND_NEUTRAL_KV, tokens, payload, self.fingerprint(), {"stop": list(stops), "neutral": meta})
        copied = [0.0]

        def after(il: int):
            def hook(module, args, output):
                t = time.perf_counter()
                chunk = (output[0] if isinstance(output, tuple) else output).shape[1]
                layer = cache.layers[il]
                end = layer.keys.shape[-2]
                arrays[il][0][:, end - chunk:end] = _as_numpy(layer.keys[0, :, end - chunk:end])
                arrays[il][1][:, end - chunk:end] = _as_numpy(layer.values[0, :, end - chunk:end])
                sink.ready(neutral.token_segments(meta, il, end - chunk, end))
                if il == len(arrays) - 1:
                    sink.progress(end)
                copied[0] += time.perf_counter() - t
            return hook

        hooks = [layer.register_forward_hook(after(il)) for il, layer in enumerate(self.model.model.layers)]
        try:
            if n:
                self.evaluate(tokens[:-1], cache)
        finally:
            for handle in hooks:
                handle.remove()
        sink.ended()
        return meta, payload, copied[0]

    def decode(self, received: Received, sampling: Sampling, cancelled) -> Iterator[Event]:
        _refuse_schema(sampling)
        started = time.perf_counter()
        check_fits(len(received.tokens), self.settings.n_ctx)
        stops = tuple(received.meta.get("stop", ()))
        canary, converted = None, {}
        self._evaluated = 0
        if received.kind == KIND_NEUTRAL_KV:
            t = time.perf_counter()
            cache = self.import_neutral(received.meta.get("neutral"), received.payload, len(received.tokens) - 1)
            received.payload = None
            received.verify()
            load_time, method = time.perf_counter() - t, "kv_handoff"
            canary = received.meta.get("canary") or {}
            if self.kv_convert_time is not None:  # K permuted from the other head-dim order: part of kv_load_time
                converted = {"kv_convert_time": round(self.kv_convert_time, 6)}
        elif received.kind == KIND_TOKEN_IDS:
            cache, load_time, method = self.new_cache(), 0.0, "token_ids_recompute"
            if len(received.tokens) > 1:
                self.evaluate(received.tokens[:-1], cache)
        else:
            raise FingerprintMismatch(f"this transformers server cannot continue a {received.kind!r} bundle "
                                      f"(it accepts {', '.join(self.accepts)})", field="kv")
        yield from self._continue(received.tokens, cache, sampling, stops, cancelled=cancelled, started=started,
                                  extra={"kv_load_time": round(load_time, 6), "method": method, **converted},
                                  canary=canary)

    def generate(self, prompt: Prompt, sampling: Sampling, cancelled) -> Iterator[Event]:
        _refuse_schema(sampling)
        started = time.perf_counter()
        tokens, stops = self.vocab.tokenize(prompt)
        check_fits(len(tokens), self.settings.n_ctx)
        self._evaluated = 0
        cache = self.new_cache()
        if len(tokens) > 1:
            self.evaluate(tokens[:-1], cache)
        yield from self._continue(tokens, cache, sampling, stops, cancelled=cancelled, started=started,
                                  extra={"kv_load_time": 0.0, "method": "decode_only"})

    def _continue(self, tokens, cache, sampling: Sampling, stops, *, cancelled, started, extra, canary=None):
        """Evaluate the last prompt token on ``cache`` (which holds the rest), then sample; a handed-over
        state's ``canary`` is checked first (kv/canary.py)."""
        stop = tuple(sampling.stop) + tuple(s for s in stops if s not in sampling.stop)
        budget = min(sampling.max_new_tokens, self.settings.n_ctx - len(tokens))
        t_gen = time.perf_counter()
        logits = self.evaluate(tokens[-1:], cache)
        prompt_evaluated = self._evaluated
        if canary is not None:
            extra = {**extra, **self.canary.check(canary, _as_numpy(logits), self.engine)}
        generated, finish, first_at = yield from stream_text(
            self.vocab, logits, make_sampler(sampling), lambda token: self.evaluate([token], cache),
            budget=budget, stop=stop, cancelled=cancelled)
        yield Event(metrics=generation_metrics(tokens, prompt_evaluated, generated, finish, started=started,
                                               t_gen=t_gen, first_at=first_at, extra=extra))


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


def _refuse_schema(sampling: Sampling) -> None:
    if sampling.json_schema is not None:
        raise BadRequest("the transformers backend cannot constrain its output to a JSON schema; send the "
                         "request to a llama_cpp server or leave json_schema out", field="json_schema")


def _as_numpy(tensor):
    """A tensor as a numpy array on the CPU (bfloat16 as its raw bits, as the neutral layout keeps them)."""
    import torch

    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).cpu().numpy().view("<u2")
    return tensor.cpu().numpy()
