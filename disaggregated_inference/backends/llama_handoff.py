"""llama.cpp's state export and import: a sequence's KV out of the context, and into a slot of another.

Prefill exports the state of every prompt token but the last with the per-sequence
state API (``export_state``); decode imports it (``import_state``), or another
engine's ``neutral_kv`` written as this context's own state first
(``import_neutral``; ``kv/convert.py``: K's head-dim order, the cache type, V
transposed or not).

**Streamed handoff.** Given a sink (``kv/stream.py``), ``prefill`` lays the
state out at its final size at once and hands over each chunk's rows as soon as
the chunk is evaluated (cached cells at once), read straight from the cache
tensors (``llama_cells.py``); ``decode`` of a streamed bundle imports the
state's skeleton when it arrives and writes each later piece's rows into the
cache as it lands, so that when the prefill ends only its last chunk is left
to move. Models whose state the cache tensors do not reproduce (sliding-window
models) hand over the whole state (``kv_streaming`` says why).
"""
from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import replace
from typing import Callable

from ..errors import BundleError
from ..kv import buffers, llama_state
from ..kv.buffers import HUGE_THRESHOLD, sendable
from ..kv.bundle import KIND_LLAMA_SEQ_STATE, KIND_NEUTRAL_KV
from . import llama_cells
from .base import Eval, Prefilled, Received, Wait


class StateHandoff:
    """The state export and import of ``LlamaCppBackend`` (a part of that class: it reads the context, the
    model, the settings and the fingerprint that ``LlamaCppBackend.load`` sets, and uses its slots)."""

    # tokens evaluated at load to check that the cache tensors reproduce the state API's export
    PROBE_TEXT = b"The cells of one sequence, laid out from the cache tensors and exported."

    # -- direct row access (streamed handoffs) ----------------------------------------------------

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

    def convert(self, prefilled: Prefilled, kind: str) -> Prefilled | None:
        """A sequence state as ``neutral_kv`` (kv/convert.py), for decode servers that read no llama.cpp state."""
        if kind != KIND_NEUTRAL_KV or prefilled.kind != KIND_LLAMA_SEQ_STATE:
            return None
        from ..kv.convert import llama_state_as_neutral

        meta, payload = llama_state_as_neutral(prefilled.payload, self.metadata(), prefilled.fingerprint["model_sha256"])
        return replace(prefilled, kind=KIND_NEUTRAL_KV, payload=payload, meta={**prefilled.meta, "neutral": meta})

    def _restores_exactly(self, n_tokens: int) -> bool:
        """Whether an imported state of ``n_tokens - 1`` cells is promised to give this context's own
        numerics bit for bit (the canary's exact tolerance). Not for a sliding-window model: with flash
        attention past its window it is not bit-exact (docs/sliding-window.md), and without it a Gemma 3
        handoff in the grading calibration run (several requests at once) came out 0.046 away with both
        sides alone in their step; in process, 0.14 at 1,300 tokens once the slots had served other
        prompts and the prompt shared its steps with a generating sequence (0 otherwise, and always 0
        for SmolLM2). So those models are checked at the same-engine tolerance."""
        return not (self._fingerprint.get("n_swa") or 0)

    # -- export -----------------------------------------------------------------------------------

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

    # -- import -----------------------------------------------------------------------------------

    def receive_room(self) -> tuple[int, int]:
        """Spare bytes a received state needs before and after it to be converted in place."""
        return llama_state.extra_room(self.slots) if self.slots > 1 else (0, 0)

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
