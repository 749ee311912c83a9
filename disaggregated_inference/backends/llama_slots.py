"""llama.cpp's slots and steps: the sequences of one context, and the ``llama_decode`` calls that evaluate them.

**Slots and continuous batching.** One context holds ``parallel`` sequences,
each in a KV stream of its own of ``n_ctx`` cells (so a request's numerics do
not depend on its neighbours: ``kv/llama_state.py``). Every request is a
generator that yields ``Eval`` requests; the owner thread (``server/owner.py``)
gathers them and calls ``evaluate`` once per step: one ``llama_decode`` with a
token for every generating sequence and, within ``n_batch``, the next fixed-size
chunk of each prompt being evaluated (prefill, decode-only, recompute), so a
long prompt never freezes the other streams. Requests join and leave between
steps.

**Prefix cache.** A slot that finishes keeps its prompt's KV while it is free;
a request whose prompt starts with the same tokens (a shared system prompt, a
rubric, an earlier chat turn) takes that slot and evaluates only the rest, as
llama.cpp's server does with ``cache_prompt``. See ``_acquire``.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import statistics
import time

from ..tuning import STEP_ON_CPU
from .base import Eval
from .speculate import StepCost, cut_drafts, split

# A reused prefix counts only from this many tokens on (below it the lowest free slot is worth more:
# see ``evaluate``). ggml's CPU matmul takes another path for fewer than 64 rows: a prompt's last rows
# computed that way after a reused prefix came out up to 0.96 apart in the logits (SmolLM2, 17-63 rows;
# bit-identical at 64-200). ``_aligned_reuse`` therefore keeps every row in a chunk of the same kind
# as without the cache, and the KV and logits come out bit for bit the same (tests/test_prefix_cache.py).
PREFIX_MIN_TOKENS = 64

# While the cores are shared with another server (``set_threads``), a prompt's chunk goes in steps of this many
# tokens (on SmolLM2 at 2 cores: 0.3 s at 2 threads, 0.5 s at one), so that its thread count is taken again soon.
# A 512-token chunk at one thread took about a second, and kept that one thread after the other server went idle;
# and a peer that becomes busy waits for the step under way to end (server/cores.py). Steps of 256 tokens at 2
# threads were no faster per token here (the 8-long-prompts gateway cell's cycle: 2.75 s against 2.65).
# Rows of a chunk computed in pieces of PREFIX_MIN_TOKENS or more come out bit for bit as in the whole chunk (the
# prefix cache relies on the same), so a piece is cut only where both sides keep that many rows.
SHARED_PIECE = 128
# A step cost measurement counts a step only if the thread that ran it was on a CPU ``tuning.STEP_ON_CPU`` of its
# time, for this long at most (``Slots._measure_step_cost``)
MEASURE_SECONDS = 2.0
# where a step's time cannot be told from a wait (layers on a GPU, partners that sleep), the step cost is measured
# this often in all (at load, then while idle), each keeping the lowest medians so far; on a CPU, until one is found
MEASURES_OFF_CPU = 4

log = logging.getLogger(__name__)


@functools.cache
def _logits_address():
    """``llama_get_logits_ith`` giving the row's address as an int (None for a row without logits): a prototype
    of its own, as the binding's function returns a float pointer and is shared with llama-cpp-python."""
    from llama_cpp import llama_cpp as binding

    return ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32)(("llama_get_logits_ith", binding._lib))


def batch_rows(batch, capacity: int) -> tuple:
    """A ``llama_batch``'s per-row arrays, read once (``tokens``, ``positions``, each row's ``seq_id`` array,
    ``logits``), with every row's sequence count set to 1 for good: a step fills only what changes, without a
    ctypes pointer object made for every field of every row (``Slots._decode``)."""
    for i in range(capacity):
        batch.n_seq_id[i] = 1
    return batch.token, batch.pos, [batch.seq_id[i] for i in range(capacity)], batch.logits


class Slots:
    """The slots and steps of ``LlamaCppBackend`` (a part of that class: it reads the context, the model, the
    settings and the slot lists that ``LlamaCppBackend.load`` sets)."""

    # -- slots ------------------------------------------------------------------------------------

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

    def set_threads(self, threads: int, shared: bool = False) -> None:
        """Compute with ``threads`` CPU threads from the next step on (the owner shares the machine's
        cores between the servers on it: ``server/cores.py``). Canaries name the count in use.

        ``shared``: another server on these cores computed a moment ago, so the share may change at any
        moment; a step keeps the count it started with, so prompt chunks go in pieces of ``SHARED_PIECE``
        tokens, each a step of its own (see ``evaluate``)."""
        import llama_cpp

        llama_cpp.llama_set_n_threads(self.ctx.ctx, threads, threads)
        if self._threads is not None:
            self._threads = threads
        self._piece = min(SHARED_PIECE, self.settings.n_batch) if shared else self.settings.n_batch

    @property
    def _free_row(self) -> bool:
        """Whether a lone generating sequence's step carries a padding row that a guess may take instead
        (``_evaluate_invariant``; a verify step of one sequence alone needs no padding, and its rows compute as
        one-token steps do): deterministic steps on a model without a sliding window, where a row past the
        window's end may take a cell the window still needs."""
        if self._paired:  # every sequence's step carries a second row, in its own stream
            return True
        return (bool(self.settings.deterministic) and not self._fingerprint.get("n_swa") and not self._lone_exact
                and self._verify_exact)

    def _draft_layout(self, evals: list[Eval]) -> tuple[int, bool]:
        """How ``cut_drafts`` counts this step's rows: (the fewest rows a sequence's step evaluates, whether no
        ubatch computes one row: ``StepCost.of``'s ``padded``).

        A lone sequence's padding row has logits under unpadded-exact deterministic steps (``_free_row``), and
        so does a paired step's throwaway row where one row computes otherwise than several: a guess takes it
        for nothing (2). Where the throwaway rows of paired steps have no logits (``_lone_exact``) a guess costs
        a row with logits: a lone single's step is then the step cost's one-token step, which the load measured
        paired (a row and its throwaway row), and a guess makes it two rows with logits (1, unpadded). Beside
        others, paired steps give every stream two rows or more (2, padded)."""
        deterministic = bool(self.settings.deterministic)
        if self._paired:
            return (1, False) if self._lone_exact and len(evals) == 1 else (2, True)
        return (2 if deterministic and len(evals) == 1 and self._free_row else 1), deterministic

    def _lone_rows_exact(self, context: int = 96) -> bool:
        """Whether a generating token alone in its ``llama_decode`` (one row) gets, bit for bit, the logits it
        gets beside another sequence's token: then ``_evaluate_invariant`` gives it no padding row.

        Without flash attention nothing in the step splits a lone row's work across threads (ggml's flash
        attention splits a lone query's cells from 512 on), and then what is left is the weights' matmul
        path for one row against several: the same for SmolLM2's Q4_1/Q8_0 weights (measured: 0.0 beside
        1, 3 and 7 others at 2 threads and 600 cells), another for the tiny llama's F16 ones (5e-7), so it is
        measured here, at load, on the loaded model: two adjacent free slots, a ``context``-token prompt
        in each, one step alone and then the same step beside the other's. Gemma 3's Q4_K/Q6_K weights (repacking
        and the tiled matmul off) measure equal too, and its sliding window does not matter here: an unpadded
        step has no throwaway row to take a cell the window still needs (``_pads``). Flash attention or one
        slot: False without measuring."""
        import llama_cpp
        import numpy as np

        if (self.settings.flash_attn or self.slots < 2 or len(self._free) < 2
                or self.settings.n_ctx < context + 2):
            return False
        text = b"Each region's quarterly revenue, margin and churn are listed with the variance to forecast. "
        ids = self.model.tokenize(text * (1 + context // 12), add_bos=True, special=False)[:context]
        mem = llama_cpp.llama_get_memory(self.ctx.ctx)
        a, _ = self._acquire()
        b, _ = self._acquire()
        try:
            if abs(a - b) != 1:
                return False
            for seq, shift in ((a, 0), (b, 1)):
                self._fill(seq, ids[shift:context - 1 + shift])
            nxt = ids[context - 1]
            alone = Eval(a, [nxt], context - 1)
            self._decode([(alone, 1)], [])
            lone = self._row_logits(alone.row).copy()
            llama_cpp.llama_memory_seq_rm(mem, a, context - 1, -1)
            pair = [(Eval(a, [nxt], context - 1), 1), (Eval(b, [ids[0]], context - 1), 1)]
            self._decode(pair, [])
            return bool(np.array_equal(lone, self._row_logits(pair[0][0].row)))
        finally:
            self._release(a)
            self._release(b)

    def _fill(self, seq: int, tokens: list[int]) -> None:
        """Evaluate ``tokens`` into ``seq`` from position 0, in chunks of ``n_batch`` (what the batch holds), no
        logits (the load's measurements)."""
        prompt = Eval(seq, list(tokens), 0, logits=False)
        while not prompt.complete:
            self._decode([(prompt, min(self.settings.n_batch, len(prompt.tokens) - prompt.done))])

    def _verify_rows_exact(self, context: int = 96, guesses: int = 2) -> bool:
        """Whether, with deterministic steps, a verify step computes every row as the sequence's one-token steps
        do, bit for bit, alone and beside a single in the next slot (``_evaluate_invariant``'s ubatches): else
        deterministic steps verify no guesses at all (``evaluate``). Measured here, at load, on the loaded
        model: true for the tiny llama (with flash attention and without), SmolLM2 and Gemma 3 with it; not
        for SmolLM2 without it (the rows after the first 0.46 apart at 96 cells) nor Gemma 3 without it (alone:
        1.13), where a query of several rows of one sequence takes another attention path than one row."""
        import llama_cpp
        import numpy as np

        if self.settings.n_ctx < context + guesses + 2 or not self._free:
            return False
        text = b"Each region's quarterly revenue, margin and churn are listed with the variance to forecast. "
        ids = self.model.tokenize(text * (1 + context // 12), add_bos=True, special=False)[:context + guesses]
        mem = llama_cpp.llama_get_memory(self.ctx.ctx)
        taken = [self._acquire()[0] for _ in range(min(2, len(self._free)))]
        a = taken[0]
        b = next((s for s in taken[1:] if abs(s - a) == 1), None)
        try:
            for seq in taken:
                self._fill(seq, ids[:context - 1])
            singles = []
            for i in range(guesses + 1):
                ev = Eval(a, [ids[context - 1 + i]], context - 1 + i)
                self._evaluate_invariant([(ev, 1)])
                singles.append(self._row_logits(ev.row).copy())
            ways = [[]] + ([[(Eval(b, [ids[0]], context - 1), 1)]] if b is not None else [])
            for beside in ways:
                llama_cpp.llama_memory_seq_rm(mem, a, context - 1, -1)
                if b is not None:
                    llama_cpp.llama_memory_seq_rm(mem, b, context - 1, -1)
                verify = Eval(a, ids[context - 1:context + guesses], context - 1, draft_acceptance=1.0)
                rows = [(verify, guesses + 1)] + beside
                self._evaluate_invariant(rows)
                if len(verify.tokens) < 2:  # cut to a single: this arrangement verifies nothing to compare
                    continue
                if not all(np.array_equal(singles[i], self._row_logits(verify.row_of(i)))
                           for i in range(len(verify.tokens))):
                    return False
            return True
        finally:
            for seq in taken:
                self._release(seq)

    # -- the batch --------------------------------------------------------------------------------

    def evaluate(self, evals: list[Eval], waiting: int = 0) -> int:
        """One step over the pending requests; returns the tokens evaluated (padding not counted).

        Single tokens (generating sequences) all go in; then each prompt's next
        chunk of up to ``n_batch`` tokens (chunk boundaries at multiples of
        ``n_batch`` from position 0, so a prompt's numerics depend neither on what
        ran beside it nor on a cached prefix) while room is left, the oldest
        request's first (``evals`` come in the order the requests started). An ``Eval``
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
        guesses are cut to what pays in this step (``speculate.cut_drafts``; with no request ``waiting``
        for a slot, a token of an answer ahead of the others is worth less: ``speculate.shares``).
        """
        deterministic = self.settings.deterministic
        room, used, chosen = self._batch_capacity, 0, []
        chunk, piece, prompt_rows = self.settings.n_batch, self._piece, 0
        exact = not deterministic or self._verify_exact  # measured at load (_verify_rows_exact)
        if exact and self._step_cost is not None:  # alone with deterministic steps, a guess may take the padding row
            rows, padded = self._draft_layout(evals)
            cut_drafts(evals, self._step_cost, self._n_ubatch, rows=rows, padded=padded, drain=not waiting)
        if not exact or (deterministic and self._step_cost is None and len(evals) > 1):
            # a verify step's rows would not compute as one-token steps; or no step cost to weigh guesses with
            # (speculation off: a lone sequence's guess in its padding row, which costs nothing), and beside
            # others a guess would cost a row of its own
            for ev in evals:
                if ev.draft_acceptance is not None:
                    del ev.tokens[1:]
                    ev.draft_acceptance = None
        # singles and speculative steps first, then prompt chunks in the order their requests came (the
        # owner lists them so): by fewest tokens left, a prompt whose slot kept being refilled with newer
        # prompts of a lower id waited for all of them (two of sixteen at 8 at once took 45 s, not 18)
        for ev in sorted(evals, key=lambda e: 0 if e.draft_acceptance is not None or len(e.tokens) - e.done <= 1
                         else 1):
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
                if piece < chunk and take > 1:  # the cores are shared: a short step, of one piece of prompt
                    take = _piece_of(take, ev.pos + ev.done, piece)
                    if prompt_rows and prompt_rows + take > piece:
                        continue
            if take <= room - used:
                chosen.append((ev, take))
                used += take
                if piece < chunk and take > 1 and ev.draft_acceptance is None:
                    prompt_rows += take  # only a piece that went in keeps a later prompt's piece out
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
        single tokens and verify steps in one ``llama_decode`` where no ubatch holds a lone row.
        A single whose neighbouring ids bring no row (``split_equal`` groups only
        consecutive ids) gets a throwaway row in a neighbouring slot's stream, one
        position past what that stream holds (with one slot: in its own, the next
        position), whose cell is dropped after the step. A ubatch of one sequence's
        rows, or of a row from each of several, computes every row as a one-token step
        does; a verify step whose last row would be left alone in a ubatch (one row
        past its neighbours') gives up its last guess (``_cut_lone_rows``).
        Only singles and verify steps want logits (``evaluate``), and they go last, so
        their rows stay readable until the next step."""
        import llama_cpp

        mem = llama_cpp.llama_get_memory(self.ctx.ctx)
        total, unpadded = 0, set()
        for ev, take in chosen:
            if take > 1 and ev.draft_acceptance is None:  # a prompt chunk
                self._decode([(ev, take)])
                total += take
        rows = [(ev, take) for ev, take in chosen if take == 1 or ev.draft_acceptance is not None]
        if rows:
            pads = self._pads(rows, unpadded)
            while self._cut_lone_rows(rows, pads):
                pads = self._pads(rows, unpadded)
            self._decode(rows, pads, pad_logits=not (self._paired and self._lone_exact))
            total += sum(take for _, take in rows)
            for seq, pos, _ in pads:
                llama_cpp.llama_memory_seq_rm(mem, seq, pos, -1)
        for ev, _ in chosen:
            ev.alone = ev.seq not in unpadded or self.slots == 1  # its numerics are those of a step of its own
        return total

    def _pads(self, rows: list[tuple[Eval, int]], unpadded: set) -> list[tuple[int, int, int]]:
        """The throwaway rows (``(seq, pos, token)``) that keep every single of ``rows`` beside another row
        (``_evaluate_invariant``); a single left alone goes in ``unpadded``. Paired steps: every single gets a
        second row in its own stream, and a verify step of an odd number of rows one more, so that llama.cpp's
        ubatches give every stream two rows or more (``_cut_lone_rows`` checks)."""
        import llama_cpp

        if self._paired:
            pads = []
            for ev, take in rows:
                end = ev.pos + ev.done + take  # the position after the step's rows
                if take % 2 and end < self.settings.n_ctx:
                    pads.append((ev.seq, end, ev.tokens[ev.done + take - 1]))
                elif take == 1:  # its stream is full: its last token goes unpaired, and no row of this step
                    unpadded.update(e.seq for e, _ in rows)  # is held to compute as alone (Eval.alone)
            return pads
        if self._lone_exact:  # measured at load: no row needs padding
            return []
        mem = llama_cpp.llama_get_memory(self.ctx.ctx)
        ids, pads = {ev.seq for ev, _ in rows}, []
        for ev, take in rows:
            if take > 1:
                continue  # a verify step: rows of its own sequence beside each other
            beside = ids | {p[0] for p in pads}
            if ev.seq - 1 in beside or ev.seq + 1 in beside:
                continue  # beside another sequence's row or a padding row
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
        return pads

    def _cut_lone_rows(self, rows: list[tuple[Eval, int]], pads: list) -> bool:
        """Whether a verify step of ``rows`` would leave a row alone in a ubatch of the step with ``pads``
        (``speculate.split``): then it gives up its last guess (``rows`` changed in place). Not where a lone
        row was measured at load to compute as one beside others (``_lone_exact``). Paired steps: a stream's
        one row in any ubatch, beside others or not."""
        if self._lone_exact and not self._paired:
            return False
        counts: dict[int, int] = {}
        for seq, n in [(ev.seq, take) for ev, take in rows] + [(seq, 1) for seq, _, _ in pads]:
            counts[seq] = counts.get(seq, 0) + n  # a padding row in a single's own stream: its second row
        for ubatch in split(sorted(counts.items()), self._n_ubatch):
            if self._paired:
                lone = {seq for seq, n in ubatch if n == 1}
            else:
                lone = {ubatch[0][0]} if len(ubatch) == 1 and ubatch[0][1] == 1 else set()
            if lone:
                for i, (ev, take) in enumerate(rows):
                    if ev.seq in lone and take > 1:
                        del ev.tokens[-1]
                        if len(ev.tokens) == 1:
                            ev.draft_acceptance = None
                        rows[i] = (ev, take - 1)
                        return True
        return False

    def _decode(self, chosen: list[tuple[Eval, int]], pads=None, pad_logits: bool = True) -> None:
        """One ``llama_decode`` of ``take`` tokens of each ``Eval`` and the throwaway rows ``pads``
        (``(seq, pos, token)``), in ascending sequence ids; advances the ``Eval``s and sets ``row``.
        With ``pads`` (a list, maybe empty: the singles of a deterministic step) every row is an output:
        llama.cpp computes the last layer's feed-forward and the output matrix for the output rows
        only, and one output row takes another matmul path than two or more (5e-7 on the tiny llama).
        ``pad_logits`` false: the throwaway rows are not outputs (paired steps on weights measured to compute
        one row as several, ``_lone_exact``: a row without logits skips the output matrix, most of a small
        model's row)."""
        import llama_cpp

        b, n = self._batch, 0
        tokens, positions, seq_ids, logits = self._batch_rows
        placed = []
        every = pads is not None
        rows = [(ev.seq, ev, take) for ev, take in chosen] + [(seq, (pos, token), 0) for seq, pos, token in pads or ()]
        for seq, ev, take in sorted(rows, key=lambda r: r[0]):
            if not take:  # padding
                pos, token = ev
                tokens[n], positions[n], logits[n] = token, pos, pad_logits
                seq_ids[n][0] = seq
                n += 1
                continue
            for i in range(ev.done, ev.done + take):
                tokens[n] = ev.tokens[i]
                positions[n] = ev.pos + i
                seq_ids[n][0] = seq
                logits[n] = every or (ev.logits and (i == len(ev.tokens) - 1 or ev.draft_acceptance is not None))
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

    def _row_logits(self, row: int):
        """The next-token logits of batch row ``row`` of the last step (a view, valid until the next step).

        Read through an address and a float array type made once: ``np.ctypeslib.as_array`` of the binding's
        pointer took 9-18 us a row right after a step (the step's buffers had pushed its Python out of the
        caches), about as long as the argmax over SmolLM2's 49,152 logits."""
        import numpy as np

        address = _logits_address()(self.ctx.ctx, row)
        if not address:
            raise RuntimeError(f"llama.cpp has no logits for row {row} of the last step")
        return np.frombuffer(self._row_type.from_address(address), dtype=np.float32)

    def _evaluate_all_but_last(self, seq: int, tokens: list[int], start: int = 0):
        """Generator: evaluate ``tokens[start:-1]`` into ``seq`` (which holds ``tokens[:start]``)."""
        if len(tokens) - 1 > start:
            yield Eval(seq, tokens[start:-1], start, logits=False)

    def _drop_cells(self, seq: int, pos: int) -> None:
        """Remove sequence ``seq``'s KV from position ``pos`` on (speculation's rejected guesses)."""
        import llama_cpp

        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self.ctx.ctx), seq, pos, -1)

    # -- in-process use (tests, benchmarks, tools): one request at a time on the calling thread ---

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

    def _measure_step_cost(self, rounds: int = 5, sizes=(1, 2, 4, 9), context: int = 64,
                           interrupted=lambda: False) -> StepCost | None:
        """What a step costs this model here, for speculation to decide which drafts pay: one sequence's steps
        of ``sizes`` tokens (logits on every row, as a verify step) after a ``context``-token prompt, in a
        free slot, ``rounds`` times each after a warm-up; ``StepCost.fit`` through each size's median, the
        lowest of every measurement so far (``_step_medians``).

        Other work on the same cores only ever adds time, and not in proportion to a step's size: while the
        four embedded servers loaded together, every step took half a second whatever its size, so every
        draft looked free and a lone request's answers came 10-25% slower with speculation than without.
        So where a step's time is this thread's own on a CPU (``_steps_on_cpu``), a step it spent less than
        ``STEP_ON_CPU`` of on a CPU is not counted, for ``MEASURE_SECONDS`` at most; and ``calibrate``
        measures again once this server and the others on its cores are idle. None where some size has no
        step counted yet (speculation waits for one), or ``interrupted()`` turned true between steps."""
        import llama_cpp

        context = max(1, min(context, self.settings.n_ctx - max(sizes)))
        sizes = [n for n in sizes if context + n <= self.settings.n_ctx]
        if len(sizes) < 2:
            return StepCost()
        if not self._free:  # a request's first draft with every slot taken: the next one measures
            return None
        text = b"Every row of the quarterly sales table lists a store, a region and its revenue. "
        ids = self.model.tokenize(text * (1 + (context + max(sizes)) // 8), add_bos=True, special=False)
        mem = llama_cpp.llama_get_memory(self.ctx.ctx)
        on_cpu = STEP_ON_CPU if self._steps_on_cpu else 0.0
        seq, _ = self._acquire()
        timings: dict[int, list[float]] = {n: [] for n in sizes}
        cost, self._step_cost = self._step_cost, None  # each step whole: no cutting its guesses (evaluate)

        def step(n: int) -> tuple[float, float]:  # one verify step of n rows, then its cells dropped: (wall, CPU)
            started, cpu = time.perf_counter(), time.thread_time()
            self.evaluate([Eval(seq, ids[context:context + n], context, draft_acceptance=1.0)])
            wall, cpu = time.perf_counter() - started, time.thread_time() - cpu
            llama_cpp.llama_memory_seq_rm(mem, seq, context, -1)
            return wall, cpu

        try:
            self.logits(seq, ids[:context])
            for n in sizes:  # a warm-up
                step(n)
            deadline, dropped = time.perf_counter() + MEASURE_SECONDS, 0
            while (any(len(ts) < rounds for ts in timings.values()) and time.perf_counter() < deadline
                   and dropped < 2 * len(sizes)):  # every step of two rounds dropped: the cores are not free now
                for n in sizes:
                    if interrupted():
                        return None
                    wall, cpu = step(n)
                    if cpu >= on_cpu * wall:
                        dropped = 0
                        if len(timings[n]) < rounds:
                            timings[n].append(wall)
                    else:
                        dropped += 1
        finally:
            self._step_cost = cost
            self._release(seq)
        for n, ts in timings.items():
            if ts:
                median = statistics.median(ts)
                self._step_medians[n] = min(self._step_medians.get(n, median), median)
        self._step_measures += 1
        if any(n not in self._step_medians for n in sizes):
            log.info("speculation: no step cost yet (other work held the cores while it was measured)")
            return None
        return StepCost.fit({n: [t] for n, t in self._step_medians.items()})

    @property
    def _steps_on_cpu(self) -> bool:
        """Whether the thread that runs a step spends all of it on a CPU when it has one: it computes on the CPU
        (no layers on a GPU, where it would wait for the device) and its partners spin at barriers, not sleep
        (``OMP_WAIT_POLICY=PASSIVE``: ``server.openmp_wait: sleep``)."""
        import llama_cpp

        on_gpu = self.settings.n_gpu_layers != 0 and llama_cpp.llama_supports_gpu_offload()
        sleeps = os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
        return not on_gpu and not sleeps

    def calibrate(self, interrupted=lambda: False) -> bool:
        """Measure the step cost again (``_measure_step_cost``; ``BatchedBackend.calibrate``): the owner asks while
        the server and the other servers on its cores are idle, since the measurement at load may have run beside
        other servers' loads: where it found no step cost yet, or where it cannot tell such steps
        (``_steps_on_cpu``). True while it wants to be asked again: until it has a step cost (without one,
        nothing is drafted), and where it cannot tell such steps, until ``MEASURES_OFF_CPU`` measurements."""
        wanted = self.settings.speculation != "off" or self._step_medians
        if not wanted or (self._step_cost is not None and self._steps_on_cpu):
            return False
        cost = self._measure_step_cost(interrupted=interrupted)
        if cost is not None:
            if cost != self._step_cost:
                log.info("speculation: a step costs %s (measured again while idle; was %s)", cost, self._step_cost)
            self._step_cost = cost
        return self._step_cost is None or (not self._steps_on_cpu and self._step_measures < MEASURES_OFF_CPU)


def _piece_of(take: int, start: int, piece: int) -> int:
    """The rows of a ``take``-row chunk from position ``start`` to evaluate in this step: up to the first multiple of
    ``piece`` that leaves at least ``PREFIX_MIN_TOKENS`` rows on both sides (a row in a chunk of fewer takes another
    matmul path), else all ``take``."""
    if take <= piece:
        return take
    cut = piece - start % piece
    while cut < PREFIX_MIN_TOKENS:
        cut += piece
    return cut if take - cut >= PREFIX_MIN_TOKENS else take


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
