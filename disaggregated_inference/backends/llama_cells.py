"""A sequence's KV rows read from and written to llama.cpp's cache tensors directly.

llama.cpp's state API copies a whole sequence at a time. For a streamed handoff
the prefill side needs each prompt chunk's rows as soon as the chunk is
evaluated, and the decode side wants to put rows in place as they arrive; an
export after every chunk would copy the sequence again each time (quadratic in
the prompt: 16 chunks of an 8k prompt copy 8.5 times its KV). So this module
finds the cache's K and V tensors (``cache_k_l<il>``/``cache_v_l<il>``, 3-D:
row x cell x stream) by name in a graph the context reserves (``llama_graph_reserve``,
from llama.cpp's staging header) and moves rows with ``ggml_backend_tensor_get``
and ``_set`` (host memory, CUDA or Metal alike).

Nothing here is taken on trust: ``CacheCells.probe`` evaluates a short prompt in
a free slot, exports it with the state API, lays out the same state from the
tensors (``kv/llama_state.SeqLayout``) and compares the two byte for byte. Only
a model whose state it reproduces exactly streams; any other (a sliding-window
model's two caches, V transposed without flash attention, a build without the
function) says why and hands over the whole state as before. The cells of a
sequence lie at indices 0..n-1 of its stream in position order (a slot's stream
is emptied or cut back before a prompt, and llama.cpp fills it from its head):
the probe checks that too, and every handoff's canary still checks the result.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from ..kv import llama_state

# llama.cpp's llama-ext.h (C++ linkage): struct ggml_cgraph * llama_graph_reserve(ctx, n_tokens, n_seqs, n_outputs)
_GRAPH_RESERVE = ("llama_graph_reserve", "_Z19llama_graph_reserveP13llama_contextjjj")


class Unavailable(Exception):
    """Rows cannot be moved directly here (the reason is the message)."""


def _ggml():
    from llama_cpp._ggml import libggml as lib

    lib.ggml_graph_get_tensor.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.ggml_graph_get_tensor.restype = ctypes.c_void_p
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    lib.ggml_nbytes.restype = ctypes.c_size_t
    for name in ("ggml_backend_tensor_get", "ggml_backend_tensor_set"):
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        getattr(lib, name).restype = None
    return lib


def _graph_reserve():
    from llama_cpp import llama_cpp

    for name in _GRAPH_RESERVE:
        fn = getattr(llama_cpp._lib, name, None)
        if fn is not None:
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32]
            fn.restype = ctypes.c_void_p
            return fn
    raise Unavailable("this llama.cpp build exports no llama_graph_reserve")


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


@dataclass
class CacheCells:
    """The K and V tensors of every cache layer, and the state layout they were checked against."""

    layout: llama_state.SeqLayout
    k: list  # ggml_tensor pointers, per layer
    v: list
    cells_per_stream: int
    _lib: object

    @classmethod
    def find(cls, ctx, n_layer: int, n_stream: int, layout: llama_state.SeqLayout) -> "CacheCells":
        """The cache tensors of context ``ctx`` (a ``llama_context *``) for ``layout``'s layers."""
        lib = _ggml()
        graph = _graph_reserve()(ctx, n_stream, n_stream, n_stream)  # the context reserves the same shape itself
        if not graph:
            raise Unavailable("llama_graph_reserve returned no graph")
        k = [lib.ggml_graph_get_tensor(graph, f"cache_k_l{il}".encode()) for il in range(n_layer)]
        v = [lib.ggml_graph_get_tensor(graph, f"cache_v_l{il}".encode()) for il in range(n_layer)]
        if not all(k) or not all(v) or layout.n_layer != n_layer:
            raise Unavailable(f"the cache's tensors are not one K and one V for each of {n_layer} layers")
        sizes = {lib.ggml_nbytes(t) // (row * n_stream)
                 for tensors, rows in ((k, layout.k_rows), (v, layout.v_rows)) for t, (_, row) in zip(tensors, rows)}
        if len(sizes) != 1:
            raise Unavailable("the cache's layers do not all hold the same number of cells")
        return cls(layout, k, v, sizes.pop(), lib)

    def _tensor(self, kind: str, layer: int):
        return (self.k if kind == "k" else self.v)[layer]

    def _row(self, kind: str, layer: int) -> int:
        return (self.layout.k_rows if kind == "k" else self.layout.v_rows)[layer][1]

    def read(self, stream: int, n: int, c0: int, c1: int, payload) -> list[list[tuple[int, int]]]:
        """Copy the rows of cells ``c0..c1-1`` of ``stream`` into ``payload`` (the state of ``n`` cells, in
        its layout); return where they went: per layer, a piece's segments."""
        base = _address(memoryview(payload).cast("B"))
        pieces = self.layout.rows(n, c0, c1)
        for layer, segments in enumerate(pieces):
            for kind, (offset, length) in zip("kv", segments):
                row = self._row(kind, layer)
                self._lib.ggml_backend_tensor_get(self._tensor(kind, layer), base + offset,
                                                  (stream * self.cells_per_stream + c0) * row, length)
        return pieces

    def write(self, stream: int, n: int, payload, segments) -> int:
        """Copy the rows that ``segments`` of ``payload`` (the state of ``n`` cells) hold into ``stream``'s
        cells; ``StateLayoutError`` for a segment that is not whole rows. Returns the bytes written."""
        base, written = _address(memoryview(payload).cast("B")), 0
        for offset, length in segments:
            kind, layer, cell, _ = self.layout.locate(n, offset, length)
            self._lib.ggml_backend_tensor_set(self._tensor(kind, layer), base + offset,
                                              (stream * self.cells_per_stream + cell) * self._row(kind, layer), length)
            written += length
        return written


def probe(backend, seq: int, tokens: list[int]) -> CacheCells:
    """Check, on a free slot ``seq`` of ``backend`` (a loaded ``LlamaCppBackend``), that the state of
    ``tokens`` laid out from the cache tensors is byte for byte what the state API exports."""
    import llama_cpp

    from .base import Eval

    ev = Eval(seq, list(tokens), 0, logits=False)
    while not ev.complete:
        backend.evaluate([ev])
    state = backend.export_state(seq)
    try:
        layout = llama_state.SeqLayout.of_state(state)
    except llama_state.StateLayoutError as exc:
        raise Unavailable(str(exc)) from None
    cells = CacheCells.find(backend.ctx.ctx, llama_cpp.llama_model_n_layer(backend.model.model),
                            backend.slots, layout)
    n = len(tokens)
    rebuilt = bytearray(layout.size(n))
    layout.skeleton(n, seq, rebuilt)
    cells.read(seq, n, 0, n, rebuilt)
    if bytes(rebuilt) != bytes(state):
        raise Unavailable("the state laid out from the cache tensors differs from llama.cpp's export")
    return cells
