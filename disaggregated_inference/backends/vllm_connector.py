"""The project's vLLM KV connector: a request's K/V, as vLLM writes it, into a ``neutral_kv`` payload.

vLLM loads it by name (``kv_connector_module_path``); nothing of vLLM is patched.
It is one ``KVConnectorBase_V1`` with both of its roles:

- **scheduler side** (``build_connector_meta``): a request whose sampling
  params carry ``extra_args["kv_transfer_params"]["disagg_capture"]`` (a key,
  and ``n_tokens``: how many prompt tokens to capture) is followed step by
  step (its blocks; chunked prefill and preemption included). Each step that
  computes some of its first ``n_tokens`` tokens names, in the step's
  metadata, the tokens it makes final (from the first not saved yet: a prefix
  cache hit's tokens go with the first step) and the blocks that hold them.
- **worker side** (``save_kv_layer``, called by vLLM after each attention layer
  has written its KV): for each request the metadata names, that layer's K and
  V of those tokens, copied straight into the ``Capture`` the backend
  registered under the key: the neutral payload itself (kv/neutral.py: layer
  after layer, K then V, each (n_kv_heads, n_tokens, head_dim)), so the
  bundle needs no further encoding. The capture then tells ``on_layer``,
  which is how the streamed handoff hands each layer's tokens over as soon as
  that layer's forward is done (``vllm.py``).

Every byte of the payload is written once: a layer's tokens are saved in
order, and a request preempted and recomputed does not save again what it
saved before (its K/V of those tokens is what it was, and may already be on
its way to the decode server). The saves run in the forward pass's Python, so
the connector asks vLLM for piecewise CUDA graphs (attention, and with it this
hook, outside the graphs: a full graph would replay without calling it).

The backend (``vllm.py``) runs vLLM's engine core in its own process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor), so both roles and
the backend share this module's ``Capture`` registry. An error here is recorded
in the capture (the request's prefill then fails with it), never raised into
vLLM's forward pass, which would take the engine down.

The vLLM internals this depends on, beyond the connector API itself
(``KVConnectorBase_V1``, ``SchedulerOutput``'s new and cached requests): the
paged cache's per-layer view ``[blocks, kv_heads, block_size, 2 * head_dim]``
and how each attention backend lays K and V out in it (``_split``: CPU_ATTN's
"vec" kernels hold each block's K transposed, (head_dim, block_size), then its
V, (block_size, head_dim), as measured against transformers' K/V of the same
prompt in tests/test_vllm_e2e.py; FLASH_ATTN and TRITON_ATTN put K then V along
the last axis, as their own ``split(head_size, dim=-1)`` reads it: from vLLM's
source, not run here), and the layer's ``attn_backend`` and ``isa`` in the
forward context. Other attention backends and kernels (FlashInfer, MLA models,
CPU AMX), hybrid caches (sliding-window layers as in gpt-oss, Mamba) and
quantized (fp8) caches are refused with a message.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)

CAPTURE_KEY = "disagg_capture"
# CPU_ATTN with its "vec" kernels (AVX2/AVX-512, float32 or bfloat16 without AMX): per block and head, K as
# (head_dim, block_size) then V as (block_size, head_dim); its other kernels (amx, neon, vec16...) tile otherwise
CPU_ISAS = ("vec",)
SPLIT_K_THEN_V_LAST = ("FLASH_ATTN", "TRITON_ATTN")  # per token and head: K then V along the last axis
_TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
_NUMPY_DTYPES = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2"), "bf16": np.dtype("<u2")}  # bf16 as raw bits


class Capture:
    """One request's K/V as the neutral payload, filled layer by layer (and step by step) by the worker side.

    ``on_layer(il, start, end)`` runs (on the engine's thread) once layer ``il``'s K and V of prompt tokens
    ``start..end-1`` are in the payload; what it raises fails the capture like a copy that failed."""

    def __init__(self, n_layer: int, n_kv_heads: int, head_dim: int, n_tokens: int, dtype: str, allocate=bytearray,
                 on_layer=None):
        self.n_layer, self.n_kv_heads, self.head_dim, self.n_tokens, self.dtype = (
            n_layer, n_kv_heads, head_dim, n_tokens, dtype)
        item = _NUMPY_DTYPES[dtype]
        per = n_kv_heads * n_tokens * head_dim
        self.payload = allocate(2 * n_layer * per * item.itemsize)
        view = memoryview(self.payload).cast("B")
        self.keys, self.values = [], []
        for il in range(n_layer):
            for out, at in ((self.keys, 2 * il), (self.values, 2 * il + 1)):
                out.append(np.frombuffer(view, dtype=item, count=per, offset=at * per * item.itemsize)
                           .reshape(n_kv_heads, n_tokens, head_dim))
        self.saved = [0] * n_layer  # per layer: its first tokens in the payload
        self.on_layer = on_layer or (lambda il, start, end: None)
        self.copy_seconds = 0.0
        self.error: str | None = None

    def write(self, il: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer ``il``'s K and V of tokens ``start..``, each (n_kv_heads, tokens, head_dim), copied into the
        payload right after what that layer holds already, then handed on (``on_layer``)."""
        if not 0 <= il < self.n_layer:
            raise ValueError(f"layer {il}: the capture holds {self.n_layer} layers")
        n = int(k.shape[1]) if k.dim() == 3 else -1
        want = (self.n_kv_heads, n, self.head_dim)
        if n < 1 or tuple(k.shape) != want or tuple(v.shape) != want:
            raise ValueError(f"layer {il}: K {tuple(k.shape)} and V {tuple(v.shape)}; the capture holds "
                             f"(n_kv_heads {self.n_kv_heads}, tokens, head_dim {self.head_dim})")
        if start != self.saved[il] or start + n > self.n_tokens:
            raise ValueError(f"layer {il}: tokens {start}..{start + n - 1} after {self.saved[il]} saved of "
                             f"{self.n_tokens}: saves must follow each other")
        if _TORCH_DTYPES[self.dtype] != k.dtype:
            raise ValueError(f"the cache holds {k.dtype}; the capture was made for {self.dtype}")
        for dst, src in ((self.keys[il], k), (self.values[il], v)):
            target = torch.from_numpy(dst[:, start:start + n])
            if self.dtype == "bf16":
                target = target.view(torch.bfloat16)
            target.copy_(src)
        self.saved[il] = start + n
        self.on_layer(il, start, start + n)

    @property
    def layers_done(self) -> int:
        return sum(1 for n in self.saved if n == self.n_tokens)

    @property
    def complete(self) -> bool:
        return self.error is None and self.layers_done == self.n_layer


_captures: dict[str, Capture] = {}
_lock = threading.Lock()


def expect(key: str, capture: Capture) -> None:
    """Register where the request carrying ``key`` has its K/V written."""
    with _lock:
        _captures[key] = capture


def forget(key: str) -> Capture | None:
    with _lock:
        return _captures.pop(key, None)


def _lookup(key: str) -> Capture | None:
    with _lock:
        return _captures.get(key)


@dataclass
class _Save:
    key: str
    start: int  # the step makes tokens start..end-1 final (in every layer, one after the other)
    end: int
    block_ids: list  # the request's blocks from the one holding token ``start`` to the one holding ``end - 1``
    offset: int  # where token ``start`` lies in the first of them


@dataclass
class CaptureMetadata(KVConnectorMetadata):
    saves: list = field(default_factory=list)


@dataclass
class _Followed:
    key: str
    n_tokens: int
    block_ids: list
    saved: int = 0  # tokens named in a save already


class NeutralKVConnector(KVConnectorBase_V1):
    """Captures the prompt KV of the requests that ask for it (see the module's docstring)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        if groups is not None and len(groups) != 1:
            raise ValueError(f"this model's KV cache has {len(groups)} groups (sliding-window or hybrid layers): "
                             "the neutral layout carries one full-attention cache per layer")
        cache_dtype = str(vllm_config.cache_config.cache_dtype)
        if cache_dtype != "auto":
            raise ValueError(f"kv cache dtype {cache_dtype!r}: only the model's own dtype (auto) is captured")
        self._block_size = vllm_config.cache_config.block_size
        self._followed: dict[str, _Followed] = {}
        self._layers: dict[str, tuple] = {}  # layer name -> (index, attention backend, its CPU kernels, head_dim)

    # -- scheduler side --------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return 0, False  # this connector only saves; vLLM's own prefix cache finds what is cached

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output) -> CaptureMetadata:
        meta = CaptureMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            followed = self._followed.get(new.req_id)  # followed already: resumed after preemption (v2 runner)
            if followed is None:
                params = (getattr(new.sampling_params, "extra_args", None) or {}).get("kv_transfer_params") or {}
                if CAPTURE_KEY not in params:
                    continue
                followed = self._followed[new.req_id] = _Followed(params[CAPTURE_KEY], int(params["n_tokens"]), [])
            followed.block_ids = list(new.block_ids[0])
            self._advance(meta, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            followed = self._followed.get(req_id)
            if followed is None:
                continue
            added = cached.new_block_ids[i]
            if added is not None:  # a resumed (preempted) request gets all of its blocks anew
                followed.block_ids = (list(added[0]) if req_id in cached.resumed_req_ids
                                      else followed.block_ids + list(added[0]))
            self._advance(meta, req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _advance(self, meta: CaptureMetadata, req_id: str, computed_after_step: int) -> None:
        """After this step the request's first ``computed_after_step`` tokens are in its blocks: the step
        saves those of them not saved yet (a recomputation after preemption saves nothing twice; the request
        is followed until it finishes)."""
        followed = self._followed[req_id]
        end = min(computed_after_step, followed.n_tokens)
        if end > followed.saved:
            first, last = followed.saved // self._block_size, -(-end // self._block_size)
            meta.saves.append(_Save(followed.key, followed.saved, end, followed.block_ids[first:last],
                                    followed.saved - first * self._block_size))
            followed.saved = end

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config) -> bool:
        return True  # the saves are Python in the forward pass: a full CUDA graph would replay without them

    def request_finished(self, request, block_ids):
        self._followed.pop(request.request_id, None)
        return False, None

    # -- worker side -----------------------------------------------------------------------------

    def start_load_kv(self, forward_context, **kwargs) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, CaptureMetadata) or not meta.saves:
            return
        for save in meta.saves:
            capture = _lookup(save.key)
            if capture is None or capture.error is not None:
                continue  # the request was given up, or failed already
            started = time.perf_counter()
            try:
                il, backend, isa, head_dim = self._layer(layer_name)
                k, v = _split(kv_layer, backend, isa, head_dim)
                capture.write(il, save.start, *(_tokens(x, save.block_ids, save.offset, save.end - save.start)
                                                for x in (k, v)))
            except Exception as exc:  # recorded for the backend: vLLM's forward pass must go on
                capture.error = f"{layer_name}: {type(exc).__name__}: {exc}"
            capture.copy_seconds += time.perf_counter() - started

    def _layer(self, layer_name: str) -> tuple:
        known = self._layers.get(layer_name)
        if known is None:
            from vllm.forward_context import get_forward_context

            layer = get_forward_context().no_compile_layers[layer_name]
            known = (_layer_number(layer_name), layer.attn_backend.get_name(), getattr(layer, "isa", None),
                     int(layer.head_size))
            self._layers[layer_name] = known
        return known


def _layer_number(layer_name: str) -> int:
    """``model.layers.12.self_attn.attn`` -> 12 (the one integer in the name, as vLLM names decoder layers)."""
    numbers = [int(part) for part in layer_name.split(".") if part.isdigit()]
    if len(numbers) != 1:
        raise ValueError(f"cannot tell the layer number of {layer_name!r}")
    return numbers[0]


def _split(kv_layer: torch.Tensor, backend: str, isa: str | None, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's paged cache ``[blocks, kv_heads, block_size, 2 * head_dim]`` as K and V, each
    ``[blocks, kv_heads, block_size, head_dim]``, as the attention backend itself reads them."""
    blocks, heads, size, content = kv_layer.shape
    if content != 2 * head_dim:
        raise ValueError(f"a cache entry of {content} values is not K and V of head_dim {head_dim}")
    if backend == "CPU_ATTN" and isa in CPU_ISAS:
        block = kv_layer.view(blocks, heads, 2, size * head_dim)  # each block and head: K, then V
        return (block[:, :, 0].view(blocks, heads, head_dim, size).transpose(2, 3),
                block[:, :, 1].view(blocks, heads, size, head_dim))
    if backend in SPLIT_K_THEN_V_LAST:
        return kv_layer[..., :head_dim], kv_layer[..., head_dim:]
    raise ValueError(f"attention backend {backend}{f' ({isa} kernels)' if isa else ''} lays its cache out in a way "
                     f"this connector does not read (it reads CPU_ATTN with {', '.join(CPU_ISAS)} kernels, "
                     f"{', '.join(SPLIT_K_THEN_V_LAST)})")


def _tokens(x: torch.Tensor, block_ids: list, offset: int, n_tokens: int) -> torch.Tensor:
    """``n_tokens`` tokens of a request's blocks ``block_ids`` (in order), from ``offset`` in the first, as
    (kv_heads, n_tokens, head_dim)."""
    index = torch.tensor(block_ids, dtype=torch.long, device=x.device)
    picked = x.index_select(0, index)  # (blocks, heads, block_size, head_dim)
    blocks, heads, size, dim = picked.shape
    return picked.transpose(0, 1).reshape(heads, blocks * size, dim)[:, offset:offset + n_tokens]
