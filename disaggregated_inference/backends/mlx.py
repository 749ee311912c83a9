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
(400): mlx-lm has no grammar-constrained sampling.
"""
from __future__ import annotations

import os
import time
from importlib.metadata import version as package_version
from typing import Callable, Iterator

from ..errors import BadRequest, BundleError, FingerprintMismatch
from ..kv import fingerprint as fp
from ..kv import neutral
from ..kv.bundle import KIND_NEUTRAL_KV, KIND_TOKEN_IDS
from .base import Backend, Event, Prefilled, Prompt, Received, Sampling, check_fits, rate
from .gguf import resolve_gguf
from .gguf_vocab import GgufVocab, generation_metrics, stream_text

PREFILL_STEP = 512


class MlxBackend(Backend):
    name = "mlx"
    handoff_kind = KIND_NEUTRAL_KV
    accepts = (KIND_NEUTRAL_KV, KIND_TOKEN_IDS)

    @property
    def engine(self) -> str:
        return "mlx/metal"

    def __init__(self, settings):
        super().__init__(settings)
        self.model = None
        self.vocab: GgufVocab | None = None  # tokenize / detokenize / end-of-generation
        self.config: dict = {}
        self._fingerprint: dict = {}
        self._evaluated = 0
        self.kv_convert_time: float | None = None  # the last import's K permutation, when it needed one

    # -- loading ---------------------------------------------------------------------------------

    @property
    def slots(self) -> int:
        """One request at a time: this backend does not batch, and one mlx-lm model is not driven from
        several threads at once here (``parallel`` is ignored; requests beyond it wait for the slot)."""
        return 1

    def load(self, progress: Callable[[str], None] = lambda message: None) -> None:
        from mlx_lm.utils import load_model

        from .mlx_weights import model_dir

        path = resolve_gguf(self.settings.model, progress)
        digest = fp.file_sha256(path, progress)
        directory = model_dir(path, digest, progress)
        started = time.perf_counter()
        self.model, self.config = load_model(directory)
        self.vocab = GgufVocab(path)
        c = self.config
        self._fingerprint = {
            "backend": self.name, "library": "mlx-lm", "library_version": package_version("mlx-lm"),
            "mlx_version": package_version("mlx"), "model_sha256": digest, "model_file": os.path.basename(path),
            "weights_from": "gguf", "arch": "llama", "n_layer": c["num_hidden_layers"], "n_embd": c["hidden_size"],
            "n_ctx": self.settings.n_ctx,
        }
        progress(f"loaded MLX model from {directory.name} in {time.perf_counter() - started:.1f}s")

    def fingerprint(self) -> dict:
        return dict(self._fingerprint)

    def describe(self) -> dict:
        return {"model_sha256": self._fingerprint.get("model_sha256"), "weights_from": "gguf",
                "n_ctx": self.settings.n_ctx, "mlx_version": self._fingerprint.get("mlx_version"),
                "accepts": list(self.accepts)}

    def close(self) -> None:
        self.model = None
        if self.vocab is not None:
            self.vocab.close()
            self.vocab = None

    # -- what a neutral bundle must be to continue here --------------------------------------------

    def identity(self) -> dict:
        return {"model_sha256": self._fingerprint["model_sha256"], "arch": self._fingerprint["arch"]}

    def expected_layout(self) -> dict:
        c = self.config
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return {"n_layer": c["num_hidden_layers"], "n_kv_heads": c["num_key_value_heads"], "head_dim_k": head_dim,
                "head_dim_v": head_dim, "head_dim_order": "interleaved" if c.get("rope_traditional") else "halves",
                "rope": {"style": "norm" if c.get("rope_traditional") else "neox", "theta": c["rope_theta"]}}

    # -- prompt -> tokens ------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> tuple[list[int], tuple]:
        """Token ids of a prompt and the stop strings its chat template adds."""
        return self.vocab.tokenize(prompt)

    # -- the cache -------------------------------------------------------------------------------

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
        self._evaluated += len(tokens)
        return logits

    def export_neutral(self, cache) -> neutral.NeutralKV:
        import numpy as np

        keys, values = [], []
        for c in cache:
            keys.append(np.array(c.keys[0, :, :c.offset, :], copy=False))
            values.append(np.array(c.values[0, :, :c.offset, :], copy=False))
        layout = self.expected_layout()
        return neutral.NeutralKV(keys, values, dtype="f32", pos_start=0, rope=layout["rope"],
                                 head_dim_order=layout["head_dim_order"], model=self.identity())

    def import_neutral(self, meta: dict, payload, n_kv_tokens: int):
        """An mlx-lm cache holding a neutral bundle's K/V, checked against this model first."""
        import mlx.core as mx

        meta = neutral.validate_meta(meta)
        neutral.check_model(self.identity(), meta["model"])
        layout = self.expected_layout()
        # K in the other head-dim order (from transformers' un-permuted weights) is permuted into this one
        perm = neutral.head_dim_permutation(layout["head_dim_order"], meta["head_dim_k"]) \
            if neutral.check_shape(meta, layout, reorder=True) else None
        if meta["pos_start"] != 0:
            raise BundleError(f"pos_start is {meta['pos_start']}; the cache must start at position 0",
                              field="meta.neutral.pos_start")
        if meta["n_kv_tokens"] != n_kv_tokens:
            raise BundleError(f"n_kv_tokens is {meta['n_kv_tokens']} but the bundle's token ids need {n_kv_tokens}",
                              field="meta.neutral.n_kv_tokens")
        cache = self.new_cache()
        dtype = self.model.model.embed_tokens.weight.dtype
        self.kv_convert_time = None if perm is None else 0.0
        for c, (_, k, v) in zip(cache, neutral.iter_layers(meta, payload)):
            k = neutral.to_float32(k, meta["dtype"])
            if perm is not None:
                t = time.perf_counter()
                k = k[..., perm]
                self.kv_convert_time += time.perf_counter() - t
            c.keys = mx.array(k)[None].astype(dtype)
            c.values = mx.array(neutral.to_float32(v, meta["dtype"]))[None].astype(dtype)
            c.offset = n_kv_tokens
        mx.eval([c.state for c in cache])
        return cache

    # -- the verbs -------------------------------------------------------------------------------

    def prefill(self, prompt: Prompt) -> Prefilled:
        t0 = time.perf_counter()
        tokens, stops = self.tokenize(prompt)
        tokenize_time = time.perf_counter() - t0
        check_fits(len(tokens), self.settings.n_ctx)
        cache = self.new_cache()
        t1 = time.perf_counter()
        if len(tokens) > 1:
            self.evaluate(tokens[:-1], cache)
        prefill_time = time.perf_counter() - t1
        t2 = time.perf_counter()
        meta, payload = neutral.encode(self.export_neutral(cache) if len(tokens) > 1 else self._empty())
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
                     "prefill_speed": rate(evaluated, prefill_time), "kv_export_time": round(export_time, 6),
                     "kv_bytes": len(payload),
                     "canary_ms": round(canary_time * 1000, 3) if "canary" in extra else None},
        )

    def _empty(self) -> neutral.NeutralKV:
        import numpy as np

        layout = self.expected_layout()
        shape_k = (layout["n_kv_heads"], 0, layout["head_dim_k"])
        keys = [np.zeros(shape_k, np.float32) for _ in range(layout["n_layer"])]
        return neutral.NeutralKV(keys, [k.copy() for k in keys], dtype="f32", rope=layout["rope"],
                                 head_dim_order=layout["head_dim_order"], model=self.identity())

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
            raise FingerprintMismatch(f"this MLX server cannot continue a {received.kind!r} bundle "
                                      f"(it accepts {', '.join(self.accepts)})", field="kv")
        yield from self._continue(received.tokens, cache, sampling, stops, cancelled=cancelled, started=started,
                                  extra={"kv_load_time": round(load_time, 6), "method": method, **converted},
                                  canary=canary)

    def generate(self, prompt: Prompt, sampling: Sampling, cancelled) -> Iterator[Event]:
        _refuse_schema(sampling)
        started = time.perf_counter()
        tokens, stops = self.tokenize(prompt)
        check_fits(len(tokens), self.settings.n_ctx)
        self._evaluated = 0
        cache = self.new_cache()
        if len(tokens) > 1:
            self.evaluate(tokens[:-1], cache)
        yield from self._continue(tokens, cache, sampling, stops, cancelled=cancelled, started=started,
                                  extra={"kv_load_time": 0.0, "method": "decode_only"})

    # -- the token loop --------------------------------------------------------------------------

    def _continue(self, tokens, cache, sampling: Sampling, stops, *, cancelled, started, extra, canary=None):
        """Evaluate the last prompt token on ``cache`` (which holds the rest), then sample; a handed-over
        state's ``canary`` is checked first (kv/canary.py)."""
        import mlx.core as mx
        from mlx_lm.sample_utils import make_sampler

        if sampling.seed is not None:
            mx.random.seed(sampling.seed)
        sampler = make_sampler(temp=sampling.temperature, top_p=sampling.top_p if sampling.top_p < 1.0 else 0.0,
                               top_k=sampling.top_k if sampling.temperature > 0 else 0)
        stop = tuple(sampling.stop) + tuple(s for s in stops if s not in sampling.stop)
        budget = min(sampling.max_new_tokens, self.settings.n_ctx - len(tokens))
        t_gen = time.perf_counter()
        logits = self.evaluate(tokens[-1:], cache)
        prompt_evaluated = self._evaluated
        if canary is not None:
            extra = {**extra, **self.canary.check(canary, _as_numpy(logits), self.engine)}
        generated, finish, first_at = yield from stream_text(
            self.vocab, logits, lambda l: sampler(l - mx.logsumexp(l, axis=-1, keepdims=True)).item(),
            lambda token: self.model(mx.array([[token]]), cache=cache)[:, -1, :],
            budget=budget, stop=stop, cancelled=cancelled)
        yield Event(metrics=generation_metrics(tokens, prompt_evaluated, generated, finish, started=started,
                                               t_gen=t_gen, first_at=first_at, extra=extra))


def _refuse_schema(sampling: Sampling) -> None:
    if sampling.json_schema is not None:
        raise BadRequest("the mlx backend cannot constrain its output to a JSON schema (mlx-lm has no grammar "
                         "sampling); send the request to a llama_cpp server or leave json_schema out",
                         field="json_schema")


def _as_numpy(logits):
    """One position's logits (an mx array of shape (1, vocab)) as a float32 numpy vector."""
    import mlx.core as mx
    import numpy as np

    return np.array(logits[0].astype(mx.float32))
