"""llama.cpp in-process (llama-cpp-python): the backend that really moves the KV cache.

Prefill evaluates every prompt token but the last and exports that sequence's
KV with the per-sequence state API; decode imports it and continues from the
last prompt token, so the decode machine evaluates one prompt token instead of
N. The monolithic ``generate`` evaluates the prompt the same way (all but the
last, then the last), so the fallback and the handoff give the same greedy text
on full-attention models. Decode also continues another engine's ``neutral_kv``
(vLLM's, transformers', MLX's), written as this context's own state on import
(``kv/convert.py``: K's head-dim order, the cache type, V transposed or not).

**Slots and continuous batching.** One context holds ``parallel`` sequences,
each in a KV stream of its own of ``n_ctx`` cells (so a request's numerics do
not depend on its neighbours: ``kv/llama_state.py``). Every request is a
generator that yields ``Eval`` requests; the owner thread (``server/owner.py``)
gathers them and calls ``evaluate`` once per step: one ``llama_decode`` with a
token for every generating sequence and, within ``n_batch``, the next fixed-size
chunk of each prompt being evaluated (prefill, decode-only, recompute), so a
long prompt never freezes the other streams. Requests join and leave between
steps; sampling is per sequence (a ``llama_sampler`` chain: grammar, top-k,
top-p, temperature, seeded distribution, or greedy).

**Prefix cache.** A slot that finishes keeps its prompt's KV while it is free;
a request whose prompt starts with the same tokens (a shared system prompt, a
rubric, an earlier chat turn) takes that slot and evaluates only the rest, as
llama.cpp's server does with ``cache_prompt``. See ``_acquire``.

**Chat formats.** Prompts are rendered and answers read by the model's chat
format (chat/): the token loop (``_continue``) feeds each sampled token's text
to the request's ``chat.Output`` and yields what it reads (answer, reasoning,
tool calls); the format decides which tokens end the generation, and when the
loop feeds the model text itself (a reasoning budget spent) or starts the
grammar of a schema that constrains the answer only.

**Streamed handoff.** Given a sink (``kv/stream.py``), ``prefill`` lays the
state out at its final size at once and hands over each chunk's rows as soon as
the chunk is evaluated (cached cells at once), read straight from the cache
tensors (``llama_cells.py``); ``decode`` of a streamed bundle imports the
state's skeleton when it arrives and writes each later piece's rows into the
cache as it lands, so that when the prefill ends only its last chunk is left
to move. Models whose state the cache tensors do not reproduce (sliding-window
models) hand over the whole state (``kv_streaming`` says why).

**Speculation.** With a proposer (the model's ``speculation`` setting, or a request's), a generating
sequence's step may verify guesses after its token, with logits on every row; ``_continue`` keeps the
guesses the sampler would have chosen and removes the KV cells of the rest, so a slot holds exactly
the answer. ``speculate.py`` says why it is exact and how it decides which drafts pay.
"""
from __future__ import annotations

import codecs
import contextlib
import ctypes
import json
import os
import threading
import time
from dataclasses import dataclass, replace
import logging
from importlib.metadata import version as package_version
from typing import Callable, Iterator

from .. import chat
from ..kv import fingerprint as fp
from ..kv import llama_state
from ..kv import buffers
from ..kv.buffers import HUGE_THRESHOLD, sendable
from ..kv.bundle import KIND_LLAMA_SEQ_STATE, KIND_NEUTRAL_KV, KIND_TOKEN_IDS
from ..errors import BadRequest, BundleError, FingerprintMismatch
from . import llama_cells
from .gguf import resolve_gguf
from .gguf_vocab import longest_token_bytes
from .base import (BatchedBackend, ChatSettings, Eval, Event, Prefilled, Prompt, Received, Sampling, Wait, check_fits,
                   gguf_prompt_tokens, rate)
from .gguf_vocab import chat_format_of, end_tokens
from .options import option
from .speculate import PROPOSERS, Lookahead, StepCost, cut_drafts, proposer

log = logging.getLogger(__name__)

# A reused prefix counts only from this many tokens on (below it the lowest free slot is worth more:
# see ``evaluate``). ggml's CPU matmul takes another path for fewer than 64 rows: a prompt's last rows
# computed that way after a reused prefix came out up to 0.96 apart in the logits (SmolLM2, 17-63 rows;
# bit-identical at 64-200). ``_aligned_reuse`` therefore keeps every row in a chunk of the same kind
# as without the cache, and the KV and logits come out bit for bit the same (tests/test_prefix_cache.py).
PREFIX_MIN_TOKENS = 64

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
    speculation: str = option("off", "speculative decoding: off, or ngram (guesses by prompt lookup, verified in "
                                     "the step); the default of the model's requests, which may name either",
                              choices=PROPOSERS)
    draft_max: int = option(8, "speculation: most guesses one step verifies for a sequence", low=1)
    draft_min_match: int = option(3, "speculation: the shortest n-gram match that may draft (which of those drafts "
                                     "pay is decided per step from the measured step cost and each sequence's "
                                     "acceptance)", low=1)
    deterministic: bool = option(False, "a sequence's logits are bit for bit the same alone or beside any others "
                                        "(batch-invariant steps: docs/ARCHITECTURE.md, Determinism; the grader's "
                                        "cluster turns it on; on a CPU it costs one request alone half its speed)")


class LlamaCppBackend(BatchedBackend):
    name = "llama_cpp"
    handoff_kind = KIND_LLAMA_SEQ_STATE
    accepts = (KIND_LLAMA_SEQ_STATE, KIND_NEUTRAL_KV, KIND_TOKEN_IDS)
    Settings = LlamaCppSettings
    ignores_eos = True
    imports_streamed = (KIND_LLAMA_SEQ_STATE,)  # decode() takes its own state while it arrives (parking on Wait)

    # tokens evaluated at load to check that the cache tensors reproduce the state API's export
    PROBE_TEXT = b"The cells of one sequence, laid out from the cache tensors and exported."

    @classmethod
    def compute_threads(cls, settings) -> int:
        """llama.cpp's CPU threads: ``n_threads``, by default half the cores."""
        return settings.n_threads or max(1, (os.cpu_count() or 2) // 2)

    def __init__(self, settings):
        super().__init__(settings)
        self.model = self.ctx = self._batch = None
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
        self._step_cost: StepCost | None = None  # measured at load, or at a request's first draft (speculate.py)
        self._cells: llama_cells.CacheCells | None = None  # direct row access (streamed handoffs), when it checks out
        self._cells_reason: str | None = None
        self._cells_probed = False
        self._batches = 0  # llama_decode calls: a row's logits are valid until the next one

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
        # deterministic: one ubatch holds a token of every slot (see _evaluate_invariant)
        cp.n_ubatch = self._n_ubatch = max(min(512, s.n_batch), self.slots if s.deterministic else 1)
        threads = self.compute_threads(s)
        cp.n_threads = cp.n_threads_batch = threads
        self._threads = threads if self.engine.endswith("/cpu") else None
        cp.flash_attn_type = 1 if s.flash_attn else 0
        cp.type_k, cp.type_v = KV_TYPES[s.type_k], KV_TYPES[s.type_v]
        self.ctx = _internals.LlamaContext(model=self.model, params=cp, verbose=False)
        self._batch = llama_cpp.llama_batch_init(self._batch_capacity, 0, 1)
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
        if s.speculation != "off":
            self._step_cost = self._measure_step_cost()
            progress(f"speculation {s.speculation}: a step costs {self._step_cost.per_ubatch * 1000:.2f} ms per "
                     f"ubatch + {self._step_cost.per_token * 1000:.2f} ms per token")

    def probe_kv_streaming(self, seq: int | None = None) -> dict:
        """Check, once, that the cache's rows can be moved directly (``llama_cells.probe``): in ``seq``
        (a slot this request holds, left empty), else in a free slot. On the model's thread. Done at the
        first streamed handoff, not at load: its first evaluation costs what a first request would."""
        if not self._cells_probed:
            import llama_cpp

            self._cells_probed = True
            tokens = self.model.tokenize(self.PROBE_TEXT, add_bos=True, special=False)
            borrowed = seq is None
            if borrowed:  # a free slot, one that keeps no cached prompt if there is one
                seq = next((s for s in reversed(self._free) if s not in self._cached), self._free[-1])
                self._free.remove(seq)
                self._cached.pop(seq, None)
            try:
                llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self.ctx.ctx), seq, -1, -1)
                self._cells = llama_cells.probe(self, seq, tokens)
            except llama_cells.Unavailable as exc:
                self._cells_reason = str(exc)
            except Exception as exc:  # a build whose functions misbehave: the whole-state handoff still works
                self._cells_reason = f"probe failed: {type(exc).__name__}: {exc}"
            finally:
                if borrowed:
                    self._release(seq)
                else:
                    llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self.ctx.ctx), seq, -1, -1)
        return self.kv_streaming

    @property
    def kv_streaming(self) -> dict:
        """Whether prefill streams the KV as chunks are evaluated and decode imports a stream as it arrives
        (``enabled``; None until the first streamed handoff checked it), and if not, why."""
        if not self._cells_probed:
            return {"enabled": None, "reason": "checked at the first streamed handoff"}
        return {"enabled": self._cells is not None, "reason": self._cells_reason}

    def fingerprint(self) -> dict:
        return dict(self._fingerprint)

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

    def convert(self, prefilled: Prefilled, kind: str) -> Prefilled | None:
        """A sequence state as ``neutral_kv`` (kv/convert.py), for decode servers that read no llama.cpp state."""
        if kind != KIND_NEUTRAL_KV or prefilled.kind != KIND_LLAMA_SEQ_STATE:
            return None
        from ..kv.convert import llama_state_as_neutral

        meta, payload = llama_state_as_neutral(prefilled.payload, self.metadata(), prefilled.fingerprint["model_sha256"])
        return replace(prefilled, kind=KIND_NEUTRAL_KV, payload=payload, meta={**prefilled.meta, "neutral": meta})

    def describe(self) -> dict:
        return {"model_file": str(self.model_path), "n_ctx": self.settings.n_ctx, "parallel": self.slots,
                "arch": self._fingerprint.get("arch"), "n_swa": self._fingerprint.get("n_swa"),
                "n_vocab": self._fingerprint.get("n_vocab"), "prefix_cache": self._prefix_cache,
                "deterministic": bool(self.settings.deterministic),
                "tiled_matmul": os.environ.get(TILED_MATMUL_ENV, "1") != "0",
                "library_version": self._fingerprint.get("library_version"),
                "chat_format": self.chat.name if self.chat is not None else None,
                "chat_template": self.chat.source if self.chat is not None else None,
                "kv_streaming": self.kv_streaming, "n_batch": self.settings.n_batch,
                "speculation": {"proposer": self.settings.speculation, "draft_max": self.settings.draft_max,
                                "step_cost_s": self._step_cost.as_dict() if self._step_cost else None}}

    def close(self) -> None:
        import llama_cpp

        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
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

    # -- slots and the batch ---------------------------------------------------------------------

    def _acquire(self, tokens: list[int] | None = None) -> tuple[int, int]:
        """A free sequence (slot) for a prompt of ``tokens``, and how many of them its KV already holds.

        The free slot whose cached prompt shares the longest start with ``tokens`` when that reuses
        ``PREFIX_MIN_TOKENS`` or more; otherwise the lowest free slot, so that busy sequences stay dense
        from 0 (see ``evaluate``). The reuse is cut so that the rest's chunks compute their rows as
        the cache-less evaluation does (``_aligned_reuse``). Cells past the reused prefix are dropped.
        The owner admits no more requests than there are slots."""
        import llama_cpp

        if not self._free:
            raise RuntimeError("no free slot: the owner admitted more requests than there are slots")
        seq, reuse = self._free[-1], 0  # kept in descending order
        if tokens and self._prefix_cache and self._cached:
            limit = len(tokens) - 1 - PREFIX_MIN_TOKENS  # the prompt's last token is always evaluated
            best, shared = max(((s, _shared_start(self._cached.get(s, ()), tokens)) for s in self._free),
                               key=lambda c: (c[1], -c[0]))
            reuse = _aligned_reuse(min(shared, limit), len(tokens) - 1, self.settings.n_batch)  # 0: none
            if reuse:
                seq = best
        self._free.remove(seq)
        if len(self._cached.pop(seq, ())) > reuse:
            llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self.ctx.ctx), seq, reuse, -1)
        return seq, reuse

    def _release(self, seq: int, tokens: list[int] | None = None) -> None:
        """Free ``seq``. With the prompt's ``tokens`` (a request that ended normally) and the prefix
        cache on, the slot keeps the KV of the prompt tokens it evaluated (what it generated is dropped:
        only the prompt's ids are known to match a later prompt); otherwise all of it is dropped."""
        import llama_cpp

        mem = llama_cpp.llama_get_memory(self.ctx.ctx)
        if tokens and self._prefix_cache:
            held = min(len(tokens), llama_cpp.llama_memory_seq_pos_max(mem, seq) + 1)
            llama_cpp.llama_memory_seq_rm(mem, seq, held, -1)
            if held > 0:
                self._cached[seq] = list(tokens[:held])
        else:
            llama_cpp.llama_memory_seq_rm(mem, seq, -1, -1)
        self._free.append(seq)
        self._free.sort(reverse=True)

    def set_threads(self, threads: int) -> None:
        """Compute with ``threads`` CPU threads from the next step on (the owner shares the machine's
        cores between the servers on it: ``server/cores.py``). Canaries name the count in use."""
        import llama_cpp

        llama_cpp.llama_set_n_threads(self.ctx.ctx, threads, threads)
        if self._threads is not None:
            self._threads = threads

    def cached_prefixes(self) -> dict[int, int]:
        """Free slot -> how many prompt tokens of KV it holds for reuse (tests, diagnostics)."""
        return {seq: len(held) for seq, held in sorted(self._cached.items())}

    def evaluate(self, evals: list[Eval]) -> int:
        """One step over the pending requests; returns the tokens evaluated (padding not counted).

        Single tokens (generating sequences) all go in; then each prompt's next
        chunk of up to ``n_batch`` tokens (chunk boundaries at multiples of
        ``n_batch`` from position 0, so a prompt's numerics depend neither on what
        ran beside it nor on a cached prefix) while room is left. An ``Eval``
        whose tokens are all in gets ``row``. Without ``deterministic`` that is one
        ``llama_decode``; with it, ``_evaluate_invariant``.

        The batch lists its sequences in ascending id order. With a KV stream per
        slot, llama.cpp splits a batch into ubatches with ``split_equal(...,
        sequential=true)``, which grows a ubatch only while each next sequence id is
        the last one plus 1: eight generating sequences listed out of order cost up
        to eight graph evaluations per step instead of one (measured on this 2-core
        machine: every other burst of 8 streams ran at ~75 tok/s instead of ~115,
        as the free list handed the slots out in reverse). ``_acquire`` keeps busy
        ids dense for the same reason.

        A speculative step (``draft_acceptance``) goes in whole, with logits on every row, after its
        guesses are cut to what pays in this step (``speculate.cut_drafts``).
        """
        deterministic = self.settings.deterministic
        room, used, chosen = self._batch_capacity, 0, []
        chunk = self.settings.n_batch
        if deterministic and len(evals) > 1:
            # a verify step beside other sequences would change their ubatches, and its rows would not outlive
            # the singles' decode: with deterministic steps a sequence verifies guesses only when it is alone
            for ev in evals:
                if ev.draft_acceptance is not None:
                    del ev.tokens[1:]
                    ev.draft_acceptance = None
        elif self._step_cost is not None:
            cut_drafts(evals, self._step_cost, self._n_ubatch)
        # singles and speculative steps first, then chunks
        for ev in sorted(evals, key=lambda e: (1 if e.draft_acceptance is not None else len(e.tokens) - e.done, e.seq)):
            left = len(ev.tokens) - ev.done
            if ev.draft_acceptance is not None:  # whole, in this step: its rows are read together
                del ev.tokens[max(1, room - used):]
                take = len(ev.tokens)
            else:
                # chunks end at multiples of n_batch counted from position 0, wherever the Eval starts (a prompt
                # after a cached prefix is cut where the whole prompt would be: see _aligned_reuse)
                take = min(chunk - (ev.pos + ev.done) % chunk, left)
                if deterministic and ev.logits and left > 1:
                    take = min(take, left - 1)  # the token whose logits are wanted goes in as a single, next step
            if take <= room - used:
                chosen.append((ev, take))
                used += take
        if not chosen:
            return 0
        if deterministic:
            return self._evaluate_invariant(chosen)
        self._decode(chosen)
        for ev, _ in chosen:
            ev.alone = len(chosen) == 1
        return used

    def _evaluate_invariant(self, chosen: list[tuple[Eval, int]]) -> int:
        """A step whose every row is computed as it would be with no other sequence beside it.

        Measured (docs/ARCHITECTURE.md, Determinism): ggml's CPU kernels compute a
        ubatch of one sequence otherwise than one of several (flash attention splits a
        lone query's cells across the threads from 512 cells on: SmolLM2 at 2 threads,
        0.5-0.66 apart), and llama.cpp's ``split_equal`` gives a ubatch as many tokens
        of each sequence as its shortest one has, so a prompt chunk beside generating
        tokens was cut into other row counts (Gemma 3 without flash attention: 1.0). Hence each
        prompt chunk in a ``llama_decode`` of its own, as when it is alone; and the
        single tokens in one ``llama_decode`` where no ubatch holds one sequence only:
        a single whose neighbouring ids bring no token (``split_equal`` groups only
        consecutive ids) gets a throwaway row in a neighbouring slot's stream, one
        position past what that stream holds (with one slot: in its own, the next
        position), whose cell is dropped after the step.
        Only singles want logits (``evaluate``), and they go last, so their rows stay
        readable until the next step."""
        import llama_cpp

        mem = llama_cpp.llama_get_memory(self.ctx.ctx)
        total, unpadded = 0, set()
        for ev, take in chosen:
            if take > 1:  # a prompt chunk, or a verify step (alone in its step: every row an output)
                self._decode([(ev, take)], [] if ev.draft_acceptance is not None else None)
                total += take
        singles = [(ev, take) for ev, take in chosen if take == 1]
        if singles:
            ids = {ev.seq for ev, _ in singles}
            pads = []
            for ev, _ in singles:
                beside = ids | {p[0] for p in pads}
                if ev.seq - 1 in beside or ev.seq + 1 in beside:
                    continue  # beside another single or a padding row
                for other in (ev.seq + 1, ev.seq - 1):
                    if 0 <= other < self.slots:
                        held = llama_cpp.llama_memory_seq_pos_max(mem, other) + 1
                        if held < self.settings.n_ctx:
                            pads.append((other, held, ev.tokens[ev.done]))
                            break
                else:  # one slot, or both neighbours' streams full
                    if self._fingerprint.get("n_swa"):
                        # a row past a sliding window's end may take a cell the window still needs: alone,
                        # as a one-slot server always is (and such a model's canary is never held exact)
                        unpadded.add(ev.seq)
                    else:  # the row in its own stream: measured the same as one beside it (tiny llama, SmolLM2)
                        pads.append((ev.seq, ev.pos + ev.done + 1, ev.tokens[ev.done]))
            self._decode(singles, pads)
            total += len(singles)
            for seq, pos, _ in pads:
                llama_cpp.llama_memory_seq_rm(mem, seq, pos, -1)
        for ev, _ in chosen:
            ev.alone = ev.seq not in unpadded or self.slots == 1  # its numerics are those of a step of its own
        return total

    def _decode(self, chosen: list[tuple[Eval, int]], pads=None) -> None:
        """One ``llama_decode`` of ``take`` tokens of each ``Eval`` and the throwaway rows ``pads``
        (``(seq, pos, token)``), in ascending sequence ids; advances the ``Eval``s and sets ``row``.
        With ``pads`` (a list, maybe empty: the singles of a deterministic step) every row is an output:
        llama.cpp computes the last layer's feed-forward and the output matrix for the output rows
        only, and one output row takes another matmul path than two or more (5e-7 on the tiny llama)."""
        import llama_cpp

        b, n = self._batch, 0
        placed = []
        every = pads is not None
        rows = [(ev.seq, ev, take) for ev, take in chosen] + [(seq, (pos, token), 0) for seq, pos, token in pads or ()]
        for seq, ev, take in sorted(rows, key=lambda r: r[0]):
            if not take:  # padding
                pos, token = ev
                b.token[n], b.pos[n], b.n_seq_id[n], b.logits[n] = token, pos, 1, True
                b.seq_id[n][0] = seq
                n += 1
                continue
            for i in range(ev.done, ev.done + take):
                b.token[n] = ev.tokens[i]
                b.pos[n] = ev.pos + i
                b.n_seq_id[n] = 1
                b.seq_id[n][0] = ev.seq
                b.logits[n] = every or (ev.logits and (i == len(ev.tokens) - 1 or ev.draft_acceptance is not None))
                n += 1
            placed.append((ev, take, n - 1))
        b.n_tokens = n
        self._batches += 1
        rc = llama_cpp.llama_decode(self.ctx.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed ({rc}) for a batch of {n} tokens")
        for ev, take, last in placed:
            ev.done += take
            if ev.complete:
                ev.row = last

    # -- in-process use (tests, benchmarks, tools): one request at a time on the calling thread -----

    @contextlib.contextmanager
    def sequence(self):
        """A slot of this context for in-process use; its cells are freed afterwards."""
        seq, _ = self._acquire()
        try:
            yield seq
        finally:
            self._release(seq)

    def logits(self, seq: int, tokens: list[int], pos: int = 0):
        """Evaluate ``tokens`` into ``seq`` from ``pos``; the last one's next-token logits (a numpy copy)."""
        ev = Eval(seq, list(tokens), pos)
        while not ev.complete:
            self.evaluate([ev])
        return self._row_logits(ev.row).copy()

    def _measure_step_cost(self, rounds: int = 5, sizes=(1, 2, 4, 8), context: int = 64) -> StepCost:
        """What a step costs this model here, for speculation to decide which drafts pay: one sequence's steps
        of ``sizes`` tokens (logits on every row, as a verify step) after a ``context``-token prompt, in a
        free slot, ``rounds`` times after a warm-up; ``StepCost.fit`` through the medians."""
        import llama_cpp

        context = max(1, min(context, self.settings.n_ctx - max(sizes)))
        sizes = [n for n in sizes if context + n <= self.settings.n_ctx]
        if len(sizes) < 2:
            return StepCost()
        text = b"Every row of the quarterly sales table lists a store, a region and its revenue. "
        ids = self.model.tokenize(text * (1 + (context + max(sizes)) // 8), add_bos=True, special=False)
        mem = llama_cpp.llama_get_memory(self.ctx.ctx)
        seq, _ = self._acquire()
        timings: dict[int, list[float]] = {n: [] for n in sizes}
        try:
            self.logits(seq, ids[:context])
            for round_ in range(rounds + 1):
                for n in sizes:
                    ev = Eval(seq, ids[context:context + n], context, draft_acceptance=1.0)
                    started = time.perf_counter()
                    self.evaluate([ev])
                    if round_:  # the first round warms up
                        timings[n].append(time.perf_counter() - started)
                    llama_cpp.llama_memory_seq_rm(mem, seq, context, -1)
        finally:
            self._release(seq)
        return StepCost.fit(timings)

    def _drop_cells(self, seq: int, pos: int) -> None:
        """Remove sequence ``seq``'s KV from position ``pos`` on (speculation's rejected guesses)."""
        import llama_cpp

        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self.ctx.ctx), seq, pos, -1)

    def _proposer(self, sampling: Sampling):
        """The request's draft proposer (speculate.py), or None: the request's ``speculation`` if it names one,
        else the model's setting. The step cost is measured the first time a proposer is needed (on the owner
        thread, between steps: a fraction of a second, once)."""
        kind = sampling.speculation or self.settings.speculation
        if kind != "off" and self._step_cost is None:
            self._step_cost = self._measure_step_cost()
            log.info("speculation: a step costs %.3f ms per ubatch + %.3f ms per token",
                     self._step_cost.per_ubatch * 1000, self._step_cost.per_token * 1000)
        return proposer(kind, self.settings.draft_max, self.settings.draft_min_match)

    def _restores_exactly(self, n_tokens: int) -> bool:
        """Whether an imported state of ``n_tokens - 1`` cells is promised to give this context's own
        numerics bit for bit (the canary's exact tolerance). Not for a sliding-window model: with flash
        attention past its window it is not bit-exact (docs/sliding-window.md), and without it a Gemma 3
        handoff in the grading calibration run (several requests at once) came out 0.046 away with both
        sides alone in their step; in process, 0.14 at 1,300 tokens once the slots had served other
        prompts and the prompt shared its steps with a generating sequence (0 otherwise, and always 0
        for SmolLM2). So those models are checked at the same-engine tolerance."""
        return not (self._fingerprint.get("n_swa") or 0)

    def _row_logits(self, row: int):
        """The next-token logits of batch row ``row`` of the last step (a view, valid until the next step)."""
        import llama_cpp
        import numpy as np

        ptr = llama_cpp.llama_get_logits_ith(self.ctx.ctx, row)
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab(),))

    def _evaluate_all_but_last(self, seq: int, tokens: list[int], start: int = 0):
        """Generator: evaluate ``tokens[start:-1]`` into ``seq`` (which holds ``tokens[:start]``)."""
        if len(tokens) - 1 > start:
            yield Eval(seq, tokens[start:-1], start, logits=False)

    # -- the handoff -----------------------------------------------------------------------------

    def _prepare_buffer(self, n_tokens: int) -> Callable[[], object | None]:
        """Allocate and touch the export buffer on another thread while the prompt is evaluated.

        Fresh memory costs a page fault per page on first touch, which took longer
        than the export itself; done during the (much longer) evaluation it costs
        the export nothing. Sized from the last export's bytes per token; returns a
        function that waits for the buffer (or None when there is no estimate).
        """
        estimate = int(self._state_bytes_per_token * n_tokens * 1.05) + (1 << 20)
        if not self._state_bytes_per_token or estimate < HUGE_THRESHOLD:
            return lambda: None
        ready: list = []

        def touch():
            buf = sendable(estimate)
            ctypes.memset((ctypes.c_uint8 * estimate).from_buffer(buf), 0, estimate)  # releases the GIL
            ready.append(buf)

        worker = threading.Thread(target=touch, name="kv-buffer", daemon=True)
        worker.start()

        def wait():
            worker.join()
            return ready[0] if ready else None
        return wait

    def receive_room(self) -> tuple[int, int]:
        """Spare bytes a received state needs before and after it to be converted in place."""
        return llama_state.extra_room(self.slots) if self.slots > 1 else (0, 0)

    def export_state(self, seq: int, prepared=None) -> memoryview:
        """Sequence ``seq``'s KV as a buffer (the one extra copy on this side), in its single-stream form."""
        import llama_cpp

        size = llama_cpp.llama_state_seq_get_size(self.ctx.ctx, seq)
        # a prepared buffer serves if it is large enough and wastes at most a quarter
        buf = prepared if prepared is not None and size <= len(prepared) <= 1.25 * size + (1 << 20) else sendable(size)
        written = llama_cpp.llama_state_seq_get_data(self.ctx.ctx, (ctypes.c_uint8 * size).from_buffer(buf), size, seq)
        if written == 0 and size:
            raise RuntimeError("llama_state_seq_get_data wrote nothing")
        return llama_state.to_single_stream(memoryview(buf)[:written])

    def import_neutral(self, seq: int, received: Received) -> tuple[float, float]:
        """Load a ``neutral_kv`` bundle (vLLM's, transformers', MLX's) into sequence ``seq``, written as this
        context's own state first (kv/convert.py: checks, K's head-dim order, the cache type, V transposed
        when flash attention is off); returns (the whole import's seconds, the conversion's)."""
        from ..kv.convert import neutral_as_llama_state

        started = time.perf_counter()
        if self._fingerprint.get("n_swa"):
            raise BundleError("this model has sliding-window layers: its llama.cpp state holds two caches, which "
                              "a neutral_kv bundle does not carry; send llama_seq_state or token ids", field="kv")
        s, f = self.settings, self._fingerprint
        state = neutral_as_llama_state(received.meta.get("neutral"), received.payload, self.metadata(),
                                       {"model_sha256": f["model_sha256"], "arch": f["arch"]},
                                       n_kv_tokens=len(received.tokens) - 1, type_k=s.type_k, type_v=s.type_v,
                                       v_trans=not s.flash_attn)
        converted = time.perf_counter() - started
        self.import_state(seq, received, state)
        return time.perf_counter() - started, converted

    def _set_state(self, seq: int, payload) -> bool:
        """Load a single-stream state into ``seq`` (converted to this context's streams in place, in the
        room received buffers have around them); llama.cpp's verdict."""
        import llama_cpp

        payload = memoryview(payload).cast("B")
        head, tail = self.receive_room()
        try:
            room = buffers.room_around(payload, head, tail)
            if room is None:  # not received with room around it (in-process use): one copy
                room = memoryview(bytearray(head + len(payload) + tail))
                room[head:head + len(payload)] = payload
            state = llama_state.to_streams(room, self.slots, head, tail)
        except llama_state.StateLayoutError as exc:
            raise BundleError(f"KV state is not one this server can read: {exc}", field="kv") from None
        n = len(state)
        try:
            src = (ctypes.c_uint8 * n).from_buffer(state)  # writable buffers: no copy
        except TypeError:
            src = (ctypes.c_uint8 * n).from_buffer_copy(state)
        return bool(llama_cpp.llama_state_seq_set_data(self.ctx.ctx, src, n, seq))

    def _check_positions(self, seq: int, n_tokens: int) -> None:
        """The imported cache must end where the bundle's token ids say (all but the last evaluated)."""
        import llama_cpp

        mem = llama_cpp.llama_get_memory(self.ctx.ctx)
        pos_max = llama_cpp.llama_memory_seq_pos_max(mem, seq)
        if pos_max != n_tokens - 2:
            llama_cpp.llama_memory_seq_rm(mem, seq, -1, -1)
            raise BundleError(f"KV state covers positions up to {pos_max}, but the bundle's {n_tokens} "
                              f"token ids need {n_tokens - 2}", field="kv")

    def import_state(self, seq: int, received: Received, state=None) -> float:
        """Load a bundle's KV (or ``state``, the llama.cpp state made from it) into sequence ``seq``;
        afterwards ``received.payload`` is dropped."""
        import llama_cpp

        started = time.perf_counter()
        if self.slots > 1:
            # the conversion rewrites the state's first bytes, which the checksum may still be reading:
            # with one slot there is nothing to convert, and the check overlaps the import instead
            received.verify()
        ok = self._set_state(seq, received.payload if state is None else state)
        state = None
        received.payload = None  # free the received copy as soon as llama.cpp holds the state
        mem = llama_cpp.llama_get_memory(self.ctx.ctx)
        try:
            received.verify()  # its checksum ran alongside the import: nothing is generated from bytes it refuses
        except BundleError:
            llama_cpp.llama_memory_seq_rm(mem, seq, -1, -1)
            raise
        if not ok:
            raise BundleError("llama.cpp refused the KV state (layout does not match this context)", field="kv")
        self._check_positions(seq, len(received.tokens))
        return time.perf_counter() - started

    def _import_streamed(self, seq: int, received: Received):
        """Generator (yields ``Wait``): import a streamed state while it arrives; returns (seconds spent
        importing on this thread, how: "progressive" or "at_end").

        Progressive: its first piece is the state's skeleton (``SeqLayout``): once it is in, the state is
        imported as it stands (every row not arrived yet zero or stale), which lays the cells out; each
        later piece's rows are then written into the cache as they land. Pieces complete before that
        import went in with it. With no direct row access here, or a layout that is not this context's,
        the whole state is imported once it is all in. A stream that fails leaves nothing imported
        (``decode``'s cleanup empties the slot)."""
        incoming, n = received.incoming, len(received.tokens) - 1
        self.probe_kv_streaming(seq)
        yield Wait(lambda: bool(incoming.pieces) or incoming.settled())
        if not incoming.pieces:
            received.verify()  # the pull's error
        layout = self._cells.layout if self._cells is not None else None
        if (layout is not None and incoming.header.payload_bytes == layout.size(n)
                and list(incoming.pieces[0].segments) == layout.skeleton_segments(n)):
            spent, t = 0.0, time.perf_counter()
            seen = len(incoming.pieces)  # complete before the import reads the buffer: they go in with it
            if not self._set_state(seq, received.payload):
                raise BundleError("llama.cpp refused the KV state (layout does not match this context)", field="kv")
            self._check_positions(seq, len(received.tokens))
            spent += time.perf_counter() - t
            while True:
                new = incoming.pieces_since(seen)
                t = time.perf_counter()
                for piece in new:
                    try:
                        self._cells.write(seq, n, received.payload, piece.segments)
                    except llama_state.StateLayoutError as exc:
                        raise BundleError(f"a KV piece is not rows of this state: {exc}", field="kv") from None
                spent += time.perf_counter() - t
                seen += len(new)
                if (incoming.complete or incoming.settled()) and len(incoming.pieces) == seen:
                    break
                yield Wait(lambda: len(incoming.pieces) > seen or incoming.settled())
            if incoming.error is not None:
                received.verify()
            return spent, "progressive"  # every row is in; the end marker (and the canary) may still come
        yield Wait(incoming.settled)
        received.verify()
        return self.import_state(seq, received), "at_end"

    def _last_token_meanwhile(self, seq: int, received: Received):
        """Generator: with every row of a streamed state in place but its end (the canary, which the
        prefill side computes from its last token) still on its way, evaluate the last token now rather
        than after it; returns that ``Eval`` for ``_continue``, or None when other requests' steps ran
        while the end was awaited (the row's logits are gone: the token is evaluated again)."""
        import llama_cpp

        incoming, last = received.incoming, len(received.tokens) - 1
        ev = Eval(seq, [received.tokens[-1]], last)
        yield ev
        mark = self._batches
        yield Wait(incoming.settled)
        received.verify()
        if self._batches == mark:
            return ev
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self.ctx.ctx), seq, last, -1)
        return None

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
                                          threads=self._threads, deterministic=self.settings.deterministic)
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
                         meta=meta, metrics=metrics)

    def _prefill_streamed(self, seq: int, tokens: list[int], cached: int, header_meta: dict, sink):
        """Generator: evaluate ``tokens[cached:-1]`` into ``seq`` chunk by chunk (the boundaries
        ``evaluate`` keeps: multiples of ``n_batch``, so the numerics are the whole evaluation's), handing
        ``sink`` the state's skeleton first, then each chunk's rows (the cached ones at once) as soon as
        they are final. Returns (the payload, seconds spent reading rows)."""
        n, chunk = len(tokens) - 1, self.settings.n_batch
        layout = self._cells.layout
        payload = sendable(layout.size(n))
        buffers.populate(payload)  # its pages fault in beside the first chunk's evaluation, not in its reads
        skeleton = layout.skeleton(n, seq, payload)
        sink.open(KIND_LLAMA_SEQ_STATE, tokens, payload, self.fingerprint(), header_meta)
        sink.ready(skeleton)
        read = 0.0

        def publish(c0: int, c1: int) -> None:
            nonlocal read
            t = time.perf_counter()
            for segments in self._cells.read(seq, n, c0, c1, payload):  # a piece per layer: K rows, V rows
                sink.ready(segments)
            read += time.perf_counter() - t
            sink.progress(c1)

        if cached:
            publish(0, cached)
        start = cached
        while start < n:
            end = min(n, (start // chunk + 1) * chunk)
            ev = Eval(seq, tokens[start:end], start, logits=False)
            yield ev
            publish(start, end)
            start = end
        sink.ended()
        return payload, read

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
                                      extra={"kv_load_time": round(load_time, 6), "method": method,
                                             "prompt_tokens_cached": cached, **streamed, **converted},
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
                                      extra={"kv_load_time": 0.0, "method": "decode_only",
                                             "prompt_tokens_cached": cached})
            keep = tokens
        finally:
            sampler.close()
            self._release(seq, keep)

    # -- the token loop --------------------------------------------------------------------------

    def _output(self, sampling: Sampling, chat_name: str | None, stops, tokens) -> chat.Output:
        """How this request's answer is read: by the chat format its prompt was rendered with (``chat_name``,
        from the prefill side; None: this model's own), with the request's tools, schema, stop strings and
        reasoning budget. A schema that cannot become a grammar is refused here, before anything runs."""
        output = chat.Output(chat.for_output(chat_name, self.chat),
                             budget=min(sampling.max_new_tokens, self.settings.n_ctx - len(tokens)),
                             tools=sampling.tools, json_schema=sampling.json_schema,
                             stop=tuple(sampling.stop) + tuple(s for s in stops if s not in sampling.stop),
                             reasoning_budget=sampling.reasoning_budget)
        for schema in (output.start_schema, output.answer_schema):
            if schema is not None:
                self._grammar(schema)
        return output

    def _grammar(self, schema: dict):
        from llama_cpp.llama_grammar import LlamaGrammar

        try:
            return LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)
        except Exception as exc:
            raise BadRequest(f"json_schema cannot be turned into a grammar: {exc}", field="json_schema") from None

    def _sampler(self, sampling: Sampling, output: chat.Output, schema: dict | None = None):
        """A sampler chain for one request: ``schema``'s grammar first (None: no grammar; the loop makes a new
        chain when a schema that constrains only the answer comes due), then greedy, or
        top-k/top-p/temperature/seed."""
        from llama_cpp import _internals

        sampler = _internals.LlamaSampler()
        if sampling.ignore_eos:  # every end-of-generation token out of reach, before anything else samples
            sampler.add_logit_bias(self.model.n_vocab(), {t: float("-inf") for t in self._end_ids(output.format)})
        if schema is not None:
            sampler.add_grammar(self.model, self._grammar(schema))
        if sampling.temperature <= 0:
            sampler.add_greedy()
        else:
            if sampling.top_k > 0:
                sampler.add_top_k(sampling.top_k)
            sampler.add_top_p(sampling.top_p, 1)
            sampler.add_temp(sampling.temperature)
            seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(4), "little")
            sampler.add_dist(seed & 0xFFFFFFFF)
        return sampler

    def _eog_tokens(self) -> list[int]:
        """The vocabulary's end-of-generation token ids (computed once)."""
        import llama_cpp

        if self._eog is None:
            vocab = self.model.vocab
            self._eog = [t for t in range(self.model.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)]
        return self._eog

    def _end_ids(self, fmt) -> frozenset:
        """The token ids that end a generation read by chat format ``fmt`` (computed once per format)."""
        if fmt.name not in self._ends:
            def single(text):
                ids = self._special_tokens(text)
                return ids[0] if len(ids) == 1 else None
            self._ends[fmt.name] = end_tokens(fmt, set(self._eog_tokens()), single)
        return self._ends[fmt.name]

    def _special_tokens(self, text: str) -> list[int]:
        """The ids of ``text``, special tokens' text read as those tokens (what the loop feeds the model)."""
        return self.model.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    def _continue(self, seq, tokens, sampler, output: chat.Output, sampling: Sampling, *, cancelled, started,
                  recomputed, extra, canary: dict | None = None, evaluated: Eval | None = None, drafts=None):
        """Evaluate the prompt's last token in ``seq`` (which holds the rest), then sample the answer.

        Each sampled token goes to ``output`` (``take``: the chat format's reading of it) and what it reads
        is yielded; a token that ends the generation by the format's rules ends it, unless the format would
        rather move the model on to its answer. Text the format has the model go on with (that opening, or
        after a spent reasoning budget) is evaluated with the next step, and a schema that constrains only
        the answer gets its grammar when ``schema_due`` says so.

        With ``canary`` (a handed-over state; ``{}`` when its bundle carried none), the next-token
        distribution is checked against the prefill side's first: ``CanaryMismatch`` before anything
        is sampled when it is beyond tolerance. ``evaluated``: that token's ``Eval``, already done
        (a streamed state's, while its canary was on its way), its row still valid. The caller closes the
        sampler it passed; one made here is closed here.

        The steps come from a ``speculate.Lookahead``: with a proposer (``drafts``) a step may verify
        guesses, and while the token sampled from a row is the guess after it the next row is sampled
        without a step; everything else (the format's end, stop strings, the budget, cancellation, text
        the format feeds) is decided per token as without. Fed text ends a draft: its guesses' cells go."""
        import llama_cpp

        ends = self._end_ids(output.format)
        special = output.format.special_text
        budget = min(sampling.max_new_tokens, self.settings.n_ctx - len(tokens))
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        generated, fed, finish = 0, 0, "length"
        t_gen = time.perf_counter()
        look = Lookahead(seq, tokens, drafts, self._drop_cells)
        ev = look.first(evaluated)
        if evaluated is None:
            yield ev
        recomputed += 1
        if canary is not None:
            extra = {**extra, **self.canary.check(canary, self._row_logits(ev.row), self.engine,
                                                  exact=ev.alone and self._restores_exactly(len(tokens)),
                                                  threads=self._threads, deterministic=self.settings.deterministic)}
        first_at = time.perf_counter()
        own = None  # a sampler this loop made (the answer's grammar)
        try:
            while True:
                token = llama_cpp.llama_sampler_sample(sampler.sampler, self.ctx.ctx, look.row)
                kept = look.sampled(token)  # a guess the step evaluated: its KV is in place, the next row ready
                step = output.take(None if token in ends else
                                   decoder.decode(self.model.detokenize([token], special=special)))
                for part in step.parts:
                    yield Event.of(part)
                if step.done:
                    finish = "stop"
                    break
                if step.sampled:
                    generated += 1
                    if generated + fed >= budget or cancelled():
                        finish = "cancelled" if cancelled() else "length"
                        break
                elif kept:  # the format replaces the token with text: its cell goes
                    look.unkeep()
                    kept = False
                evaluate = [token] if step.sampled and not kept else []
                if step.feed is not None:  # text the format has the model go on with (chat/output.py)
                    ids = self._special_tokens(step.feed)
                    if generated + fed + len(ids) >= budget:  # no room left for an answer after them
                        break
                    fed += len(ids)
                    evaluate += ids
                    for part in output.fed(step.feed, len(ids)):
                        yield Event.of(part)
                schema = output.schema_due()
                if schema is not None:  # the answer opened: its grammar from the next token on
                    if own is not None:
                        own.close()
                    sampler = own = self._sampler(sampling, output, schema)
                if not kept or step.feed is not None:  # else the next row is ready without a step
                    yield look.step(evaluate, budget - generated - fed, draft=step.feed is None)
        finally:
            if own is not None:
                own.close()
        for part in output.close(decoder.decode(b"", final=True)):
            yield Event.of(part)
        ended = time.perf_counter()
        decode_time = ended - t_gen
        metrics = {
            "prompt_tokens": len(tokens),
            "prompt_tokens_recomputed": recomputed,
            "completion_tokens": generated + fed,
            "decode_time": round(decode_time, 6),
            "decode_speed": rate(generated, decode_time),
            "first_token_time": round(first_at - t_gen, 6),
            "backend_time": round(ended - started, 6),
            "finish_reason": output.finish_reason(finish),
            **output.metrics(),
            **extra,
        }
        if drafts is not None:
            metrics.update(speculation=sampling.speculation or self.settings.speculation, **look.finish())
        if extra["method"] != "kv_handoff":  # the prompt was computed here: say how long it took
            metrics["prefill_time"] = round(t_gen - started, 6)
            metrics["prefill_speed"] = rate(recomputed, t_gen - started)  # the tokens evaluated here
        yield Event(metrics=metrics)


def _shared_start(a, b) -> int:
    """How many leading items ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _aligned_reuse(reuse: int, m: int, chunk: int) -> int:
    """How much of a shared start of ``reuse`` tokens to reuse for a prompt of ``m`` tokens to evaluate
    (all but its last) in chunks of ``chunk``, so that every row left is computed as without the cache.

    Without the cache the rows lie in chunks ``[0, chunk), [chunk, 2 chunk), ...``: full ones, and a
    last one that may be short. ``evaluate`` keeps those boundaries after a reused prefix, so only the
    first chunk of the rest differs, ``[reuse, next boundary)``; it must have ``PREFIX_MIN_TOKENS``
    rows or more when its rows were in a long chunk, and a short last chunk (fewer than that) must be
    evaluated whole, as it was. 0 when too little is left to reuse."""
    if chunk < PREFIX_MIN_TOKENS:
        return 0
    last = ((m - 1) // chunk) * chunk  # where the cache-less evaluation's last chunk starts
    if m - last < PREFIX_MIN_TOKENS:  # a short last chunk: evaluated whole
        reuse = min(reuse, last)
    end = min(m, reuse - reuse % chunk + chunk)  # the first chunk of the rest ends here
    if reuse % chunk and end - reuse < PREFIX_MIN_TOKENS:
        reuse = end - PREFIX_MIN_TOKENS
    return reuse if reuse >= PREFIX_MIN_TOKENS else 0
