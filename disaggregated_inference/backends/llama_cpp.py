"""llama.cpp in-process (llama-cpp-python): the backend that really moves the KV cache.

Prefill evaluates every prompt token but the last and exports that sequence's
KV with the per-sequence state API; decode imports it and continues from the
last prompt token, so the decode machine evaluates one prompt token instead of
N. The monolithic ``generate`` evaluates the prompt the same way (all but the
last, then the last), so the fallback and the handoff give the same greedy text
on full-attention models. Decode also continues another engine's ``neutral_kv``
(vLLM's, transformers', MLX's), written as this context's own state on import
(``kv/convert.py``: K's head-dim order, the cache type, V transposed or not).

The engine is one class, ``LlamaCppBackend``, written in four modules by concept:

- this one: its settings, loading, and the three requests (``prefill``, ``decode``, ``generate``);
- ``llama_slots.py``: the slots (sequences of one context), continuous batching, the prefix cache and
  the steps (``evaluate``);
- ``llama_handoff.py``: the state's export and import, whole or streamed (``llama_cells.py``: the rows
  read from and written to the cache tensors directly);
- ``llama_loop.py``: the token loop, sampling, chat formats and speculation.
"""
from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass
from importlib.metadata import version as package_version
from typing import Callable, Iterator

from ..metrics import ServerFigures
from ..errors import BadRequest, FingerprintMismatch
from ..kv import fingerprint as fp
from ..kv.bundle import KIND_LLAMA_SEQ_STATE, KIND_NEUTRAL_KV, KIND_TOKEN_IDS
from . import llama_cells
from .base import (BatchedBackend, ChatSettings, Eval, Prefilled, Prompt, Received, Sampling, check_fits,
                   gguf_prompt_tokens, rate)
from .gguf import resolve_gguf
from .gguf_vocab import chat_format_of, longest_token_bytes
from .llama_handoff import StateHandoff
from .llama_loop import TokenLoop
from .llama_slots import Slots, batch_rows
from .options import option
from .speculate import PROPOSERS, DraftRecord, StepCost

TILED_MATMUL_ENV = "GGML_CPU_TILED_MM"  # ggml-cpu/tiled/tiled.cpp: 0 turns its K-quant tiled matmul off

KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}


@dataclass(frozen=True)
class LlamaCppSettings(ChatSettings):
    n_batch: int = option(512, "prompt tokens evaluated per step (the chunk a long prompt is cut into)", low=1)
    n_gpu_layers: int = option(0, "layers offloaded to the GPU (-1: all of them)")
    flash_attn: bool = option(True, "flash attention (a quantized V cache needs it)")
    prefix_cache: bool = option(True, "a free slot keeps its last prompt's KV, and a prompt that starts the same "
                                      "evaluates only the rest (off by itself on sliding-window models)")
    type_k: str = option("f16", "the K cache's type (the same on both sides of a handoff)", choices=KV_TYPES)
    type_v: str = option("f16", "the V cache's type (quantized types need flash_attn)", choices=KV_TYPES)
    speculation: str = option("ngram", "speculative decoding: ngram (guesses by prompt lookup, verified in the "
                                       "step; drafted only where the measured step cost says a draft pays), or "
                                       "off; the default of the model's requests, which may name either",
                              choices=PROPOSERS)
    draft_max: int = option(8, "speculation: most guesses one step verifies for a sequence", low=1)
    draft_min_match: int = option(3, "speculation: the shortest n-gram match that may draft (which of those drafts "
                                     "pay is decided per step from the measured step cost and each sequence's "
                                     "acceptance)", low=1)
    deterministic: bool = option(False, "a sequence's logits are bit for bit the same alone or beside any others "
                                        "(batch-invariant steps: docs/ARCHITECTURE.md, Determinism; the grader's "
                                        "cluster turns it on; on a CPU it costs one request alone half its speed)")
    paired_steps: bool = option(False, "deterministic steps: every generating sequence evaluates two rows or more a "
                                       "step (its guesses, or a throwaway row in its own stream), so guesses verify "
                                       "bit for bit where one row computes otherwise than two (a CPU without flash "
                                       "attention); measured at load, and off where that does not hold "
                                       "(docs/ARCHITECTURE.md, Paired steps)")


class LlamaCppBackend(Slots, StateHandoff, TokenLoop, BatchedBackend):
    name = "llama_cpp"
    handoff_kind = KIND_LLAMA_SEQ_STATE
    accepts = (KIND_LLAMA_SEQ_STATE, KIND_NEUTRAL_KV, KIND_TOKEN_IDS)
    Settings = LlamaCppSettings
    ignores_eos = True
    imports_streamed = (KIND_LLAMA_SEQ_STATE,)  # decode() takes its own state while it arrives (parking on Wait)

    @classmethod
    def compute_threads(cls, settings) -> int:
        """llama.cpp's CPU threads: ``n_threads``, by default half the cores."""
        return settings.n_threads or max(1, (os.cpu_count() or 2) // 2)

    def __init__(self, settings):
        super().__init__(settings)
        self.model = self.ctx = self._batch = None
        self._batch_rows = None  # the batch's arrays, read once (llama_slots.batch_rows)
        self.model_path = None
        self._fingerprint: dict = {}
        self.chat = None  # the model's chat format (chat/): None when it has no template and no format of its own
        self._longest_token = 0  # bytes; bounds a prompt's token count from below (base.check_bound)
        self._eog: list[int] | None = None
        self._ends: dict = {}  # chat format name -> the token ids that end its generations
        self._threads: int | None = None  # CPU compute threads, named in canaries (kv/canary.py)
        self._free: list[int] = []
        self._cached: dict[int, list[int]] = {}  # free slot -> the token ids its KV holds, from position 0
        self._prefix_cache = False
        self._state_bytes_per_token = 0.0  # of the last export: sizes the next export buffer in advance
        self._batch_capacity = self._n_ubatch = 0
        self._piece = 0  # prompt tokens in a step: n_batch, fewer while the cores are shared (Slots.set_threads)
        self._step_cost: StepCost | None = None  # measured at load, or at a request's first draft (speculate.py)
        self._step_medians: dict[int, float] = {}  # step size -> its lowest median step time (Slots._measure_step_cost)
        self._step_measures = 0
        self._draft_record = DraftRecord()  # how often this server's recent drafts were right (speculate.py)
        self._step_cost_retry_at = 0.0  # monotonic time: a request's first draft may measure the step cost again
        self._cells: llama_cells.CacheCells | None = None  # direct row access (streamed handoffs), when it checks out
        self._cells_reason: str | None = None
        self._cells_probed = False
        self._lone_exact = False  # deterministic: a lone token's row computes as beside others, unpadded (llama_slots)
        self._verify_exact = True  # deterministic: a verify step's rows compute as one-token steps (llama_slots)
        self._paired = False  # deterministic: every generating sequence evaluates two rows or more a step (llama_slots)
        self._batches = 0  # llama_decode calls: a row's logits are valid until the next one
        self._row_type = None  # ctypes float[n_vocab]: a row of logits, viewed in place (Slots._row_logits)
        self._token_texts: dict[tuple[int, bool], bytes] = {}  # (token, special) -> its text (TokenLoop._token_text)

    # -- loading ---------------------------------------------------------------------------------

    def load(self, progress: Callable[[str], None] = lambda message: None) -> None:
        import llama_cpp
        from llama_cpp import _internals

        s = self.settings
        for key in ("type_k", "type_v"):
            if getattr(s, key) not in KV_TYPES:
                raise BadRequest(f"{key} must be one of {', '.join(KV_TYPES)}", field=key)
        self.model_path = resolve_gguf(s.model, progress)
        digest = fp.file_sha256(self.model_path, progress)
        progress(f"loading {os.path.basename(self.model_path)} ({os.path.getsize(self.model_path) / 1e6:.0f} MB, "
                 f"n_ctx={s.n_ctx} x {self.slots} slots, gpu_layers={s.n_gpu_layers})")
        started = time.perf_counter()
        from llama_cpp._logger import set_verbose

        set_verbose(False)  # llama.cpp's own log lines (Llama(verbose=False) does the same)
        llama_cpp.llama_backend_init()
        mp = llama_cpp.llama_model_default_params()
        mp.n_gpu_layers = s.n_gpu_layers
        if s.deterministic:  # repacked weights (Q4_0, Q4_K, IQ4_NL) compute 4-row groups and the rest apart
            mp.use_extra_bufts = False
            # ggml's tiled K-quant matmul (Q2_K-Q6_K, IQ*) takes a step of 8 rows or more, vec_dot fewer: Gemma 3
            # 0.38 apart beside 7 others. Read once per process, at its first graph: a server holds one model.
            os.environ[TILED_MATMUL_ENV] = "0"
        self.model = _internals.LlamaModel(path_model=str(self.model_path), params=mp, verbose=False)
        cp = llama_cpp.llama_context_default_params()
        cp.n_seq_max = self.slots
        cp.kv_unified = False  # a KV stream per slot: see kv/llama_state.py
        cp.n_ctx = s.n_ctx * self.slots
        # one prompt chunk plus, for every slot, its token and a draft of guesses (speculation: a request may ask
        # for it whatever the setting), so that drafts never crowd a prompt's chunk out of a step
        self._batch_capacity = s.n_batch + self.slots * (1 + s.draft_max)
        cp.n_batch = self._batch_capacity
        self._piece = s.n_batch
        # deterministic: one ubatch holds a token of every slot (see _evaluate_invariant)
        # (paired steps: two rows of every slot)
        cp.n_ubatch = self._n_ubatch = max(min(512, s.n_batch), (2 if s.paired_steps else 1) * self.slots
                                           if s.deterministic else 1)
        threads = self.compute_threads(s)
        cp.n_threads = cp.n_threads_batch = threads
        self._threads = threads if self.engine.endswith("/cpu") else None
        cp.flash_attn_type = 1 if s.flash_attn else 0
        cp.type_k, cp.type_v = KV_TYPES[s.type_k], KV_TYPES[s.type_v]
        self.ctx = _internals.LlamaContext(model=self.model, params=cp, verbose=False)
        self._batch = llama_cpp.llama_batch_init(self._batch_capacity, 0, 1)
        self._batch_rows = batch_rows(self._batch, self._batch_capacity)
        self._row_type = ctypes.c_float * self.model.n_vocab()
        self._free = list(range(self.slots - 1, -1, -1))
        self._cached = {}
        self._longest_token = longest_token_bytes(self.model.vocab, self.model.n_vocab())
        meta = self.model.metadata()
        eos, bos = self.model.token_eos(), self.model.token_bos()
        self.chat = chat_format_of(s.chat_format, meta, self.model.token_get_text(bos) if bos != -1 else "",
                                   self.model.token_get_text(eos) if eos != -1 else "")
        self._ends = {}
        arch = meta.get("general.architecture")
        self._fingerprint = {
            "backend": self.name,
            "library": "llama-cpp-python",
            "library_version": package_version("llama-cpp-python"),
            "model_sha256": digest,
            "model_file": os.path.basename(self.model_path),
            "arch": arch,
            "n_layer": llama_cpp.llama_model_n_layer(self.model.model),
            "n_embd": llama_cpp.llama_model_n_embd(self.model.model),
            "n_swa": llama_cpp.llama_model_n_swa(self.model.model),
            "n_vocab": self.model.n_vocab(),
            "n_expert": int(meta.get(f"{arch}.expert_count", 0) or 0),
            "n_expert_used": int(meta.get(f"{arch}.expert_used_count", 0) or 0),
            "type_k": s.type_k,
            "type_v": s.type_v,
            "flash_attn": bool(s.flash_attn),
            "n_ctx": s.n_ctx,
        }
        # not on sliding-window models: their cache drops the cells a prefix's later tokens would need
        self._prefix_cache = bool(s.prefix_cache) and not self._fingerprint["n_swa"]
        self._cells, self._cells_reason, self._cells_probed = None, None, False
        progress(f"loaded in {time.perf_counter() - started:.1f}s")
        self._lone_exact = self._lone_rows_exact() if s.deterministic else False
        self._verify_exact = self._verify_rows_exact() if s.deterministic else True
        if s.deterministic and s.paired_steps and not self._verify_exact:
            self._paired = True  # measured in the paired layout; else the steps stay as they were
            self._paired = self._verify_exact = self._verify_rows_exact()
            progress(f"paired steps: {'guesses verify exactly' if self._paired else 'not exact here, off'}")
        if s.speculation != "off":
            self._step_cost = self._measure_step_cost()
            progress(f"speculation {s.speculation}: a step costs {self._step_cost}" if self._step_cost else
                     f"speculation {s.speculation}: waits for a step cost (other work held the cores)")

    def fingerprint(self) -> dict:
        return dict(self._fingerprint)

    @property
    def _steps(self) -> bool | str:
        """How this server's steps compute, for the canary: False (plain), True (batch-invariant) or "paired"
        (batch-invariant with paired steps, whose numerics differ from unpaired ones)."""
        return "paired" if self._paired else bool(self.settings.deterministic)

    @property
    def engine(self) -> str:
        """``llama_cpp/cpu``, or ``llama_cpp/metal`` / ``llama_cpp/gpu`` when layers are offloaded."""
        import sys

        import llama_cpp

        if self.settings.n_gpu_layers != 0 and llama_cpp.llama_supports_gpu_offload():
            return f"{self.name}/{'metal' if sys.platform == 'darwin' else 'gpu'}"
        return f"{self.name}/cpu"

    def metadata(self) -> dict:
        """The GGUF's metadata (architecture, head counts, RoPE...), as llama.cpp read it."""
        return self.model.metadata()

    def describe(self) -> dict:
        return {"model_file": str(self.model_path), "n_ctx": self.settings.n_ctx, "parallel": self.slots,
                "arch": self._fingerprint.get("arch"), "n_swa": self._fingerprint.get("n_swa"),
                "n_vocab": self._fingerprint.get("n_vocab"), "prefix_cache": self._prefix_cache,
                "deterministic": bool(self.settings.deterministic), "lone_rows_exact": self._lone_exact,
                "verify_rows_exact": self._verify_exact, "paired_steps": self._paired,
                "tiled_matmul": os.environ.get(TILED_MATMUL_ENV, "1") != "0",
                "library_version": self._fingerprint.get("library_version"),
                "chat_format": self.chat.name if self.chat is not None else None,
                "chat_template": self.chat.source if self.chat is not None else None,
                "kv_streaming": self.kv_streaming, "n_batch": self.settings.n_batch,
                "speculation": {"proposer": self.settings.speculation, "draft_max": self.settings.draft_max,
                                "step_cost_s": self._step_cost.as_dict() if self._step_cost else None,
                                "step_cost_measures": self._step_measures,
                                "guess_odds": [round(p, 3) for p in self._draft_record.odds()]}}

    def close(self) -> None:
        import llama_cpp

        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = self._batch_rows = None
        for obj in (self.ctx, self.model):
            if obj is not None:
                obj.close()
        self.ctx = self.model = None

    # -- prompt -> tokens ------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> tuple[list[int], tuple]:
        """Token ids of a prompt and the stop strings its chat template adds. Reads only the vocabulary
        and the template: the server runs it on the request's thread, beside the model's steps (as
        llama.cpp's own server tokenizes on its HTTP threads). Text that cannot fit the context is refused
        before it is tokenized (``base.check_bound``)."""
        return self.prompt_tokens(prompt)[:2]

    def prompt_tokens(self, prompt: Prompt) -> tuple[list[int], tuple, str]:
        """Token ids of a prompt, its template's stop strings and the chat format that rendered it."""
        return gguf_prompt_tokens(prompt, self.chat, self.model.tokenize, self.settings.n_ctx, self._longest_token)

    def _check_fits(self, n_prompt: int) -> None:
        check_fits(n_prompt, self.settings.n_ctx)

    # -- the requests ----------------------------------------------------------------------------

    def prefill(self, prompt: Prompt, kv_stream=None):
        """Evaluate all but the prompt's last token and export its KV (with ``kv_stream``, a sink of
        ``kv/stream.py``: hand it over chunk by chunk as the chunks are evaluated; see ``kv_streaming``)."""
        t0 = time.perf_counter()
        tokens, stops, chat_name = self.prompt_tokens(prompt)
        tokenize_time = time.perf_counter() - t0
        self._check_fits(len(tokens))
        if kv_stream is not None and not self.probe_kv_streaming()["enabled"]:
            raise RuntimeError(f"this model's KV cannot be streamed: {self._cells_reason}")
        seq, cached = self._acquire(tokens)
        keep = None
        try:
            if kv_stream is not None:
                t1 = time.perf_counter()
                payload, read_time = yield from self._prefill_streamed(
                    seq, tokens, cached, {"stop": list(stops), "chat": chat_name}, kv_stream)
                prefill_time, export_time = time.perf_counter() - t1, read_time
            else:
                prepared = self._prepare_buffer(len(tokens) - 1)
                t1 = time.perf_counter()
                yield from self._evaluate_all_but_last(seq, tokens, cached)
                prefill_time = time.perf_counter() - t1
                buffer = prepared()
                t2 = time.perf_counter()
                payload = self.export_state(seq, buffer)
                export_time = time.perf_counter() - t2
                del buffer
            # the canary: the last prompt token, evaluated after the export (which therefore still ends one
            # token early, as the decode side expects), gives the next-token distribution to check against
            t3 = time.perf_counter()
            canary = None
            if self.canary.top_k > 0:
                ev = Eval(seq, [tokens[-1]], len(tokens) - 1)
                yield ev
                canary = self.canary.make(self._row_logits(ev.row), self.engine, alone=ev.alone,
                                          threads=self._threads, deterministic=self._steps)
            canary_time = time.perf_counter() - t3
            keep = tokens
        finally:
            self._release(seq, keep)
        self._state_bytes_per_token = len(payload) / max(1, len(tokens) - 1)
        evaluated = len(tokens) - 1 - cached
        meta = {"stop": list(stops), "chat": chat_name}  # how the decode side reads what it generates
        if canary is not None:
            meta["canary"] = canary
        metrics = {"prompt_tokens": len(tokens), "prompt_tokens_evaluated": evaluated,
                   "prompt_tokens_cached": cached, "tokenize_time": round(tokenize_time, 6),
                   "prefill_time": round(prefill_time, 6), "prefill_speed": rate(evaluated, prefill_time),
                   "kv_bytes": len(payload), "canary_ms": round(canary_time * 1000, 3) if canary else None,
                   "handoff_mode": "streamed" if kv_stream is not None else "whole"}
        # streamed: the rows read from the cache chunk by chunk (part of prefill_time); else the export after it
        metrics["kv_read_time" if kv_stream is not None else "kv_export_time"] = round(export_time, 6)
        if kv_stream is not None:
            metrics["kv_chunk_tokens"] = self.settings.n_batch  # the last chunk's KV is what leaves after the prefill
        return Prefilled(kind=KIND_LLAMA_SEQ_STATE, tokens=tokens, payload=payload, fingerprint=self.fingerprint(),
                         meta=meta, metrics=ServerFigures.of(**metrics))

    def decode(self, received: Received, sampling: Sampling, cancelled) -> Iterator:
        started = time.perf_counter()
        self._check_fits(len(received.tokens))
        output = self._output(sampling, received.meta.get("chat"), received.meta.get("stop", ()), received.tokens)
        drafts = self._proposer(sampling)
        sampler = self._sampler(sampling, output, output.start_schema)
        # an imported state replaces the slot's cells: the lowest free slot; recomputed ids may reuse a prefix
        seq, cached = self._acquire(received.tokens if received.kind == KIND_TOKEN_IDS else None)
        keep = None
        try:
            canary, streamed, early, converted = None, {}, None, {}
            if received.kind == KIND_LLAMA_SEQ_STATE:
                if received.incoming is not None:  # still arriving: imported as it comes
                    load_time, how = yield from self._import_streamed(seq, received)
                    streamed = {"kv_import": how}
                    if not received.incoming.settled():
                        early = yield from self._last_token_meanwhile(seq, received)
                    received.verify()  # every byte in, every piece checked; or the pull's error
                    received.payload = None
                else:
                    load_time = self.import_state(seq, received)
                method, recomputed = "kv_handoff", 0
                canary = received.meta.get("canary") or {}  # {}: the bundle has none (reported as absent)
            elif received.kind == KIND_NEUTRAL_KV:  # another engine's KV, written as this context's state
                load_time, convert_time = self.import_neutral(seq, received)
                method, recomputed, converted = "kv_handoff", 0, {"kv_convert_time": round(convert_time, 6)}
                canary = received.meta.get("canary") or {}
            elif received.kind == KIND_TOKEN_IDS:  # only ids arrived: recompute the prompt here
                load_time, method, recomputed = 0.0, "token_ids_recompute", len(received.tokens) - 1 - cached
                yield from self._evaluate_all_but_last(seq, received.tokens, cached)
            else:
                raise FingerprintMismatch(f"this llama.cpp server cannot continue a {received.kind!r} bundle",
                                          field="kv")
            yield from self._continue(seq, received.tokens, sampler, output, sampling, cancelled=cancelled,
                                      started=started, recomputed=recomputed, canary=canary, drafts=drafts,
                                      extra=ServerFigures.of(kv_load_time=round(load_time, 6), method=method,
                                                            prompt_tokens_cached=cached, **streamed, **converted),
                                      evaluated=early)
            keep = received.tokens
        finally:
            sampler.close()
            self._release(seq, keep)

    def generate(self, prompt: Prompt, sampling: Sampling, cancelled) -> Iterator:
        started = time.perf_counter()
        tokens, stops, chat_name = self.prompt_tokens(prompt)
        self._check_fits(len(tokens))
        output = self._output(sampling, chat_name, stops, tokens)
        drafts = self._proposer(sampling)
        sampler = self._sampler(sampling, output, output.start_schema)
        seq, cached = self._acquire(tokens)
        keep = None
        try:
            yield from self._evaluate_all_but_last(seq, tokens, cached)
            yield from self._continue(seq, tokens, sampler, output, sampling, cancelled=cancelled, started=started,
                                      recomputed=len(tokens) - 1 - cached, drafts=drafts,
                                      extra=ServerFigures(kv_load_time=0.0, method="decode_only",
                                                         prompt_tokens_cached=cached))
            keep = tokens
        finally:
            sampler.close()
            self._release(seq, keep)
