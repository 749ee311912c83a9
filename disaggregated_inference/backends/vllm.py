"""vLLM in process: the prefill engine of the DGX (CUDA build), and its CPU build here and in CI.

**The model.** ``model`` is a GGUF, as for every engine (a built-in name, a path,
``ollama:NAME``): its vocabulary and chat template tokenize the prompts
(``gguf_vocab.py``: exactly a llama.cpp server's ids; vLLM is fed token ids,
``skip_tokenizer_init``) and its digest and architecture are the identity every
bundle names. vLLM runs either that file's weights, dequantised once into the
Hugging Face directory the transformers backend makes (``transformers.model_dir``,
float32), or, with ``weights``, a Hugging Face model directory of the same
checkpoint (the DGX: ``Qwen/Qwen3-Coder-30B-A3B-Instruct`` as downloaded there, in
its own dtype). That the directory and the GGUF are the same checkpoint is the
operator's claim; the canary checks it on every handoff.

**Prefill** sends the whole prompt with ``max_tokens=1`` and ``logprobs=k``.
The project's KV connector (``vllm_connector.py``, loaded by vLLM through
``kv_connector_module_path``) copies the K/V of every prompt token but the last,
as vLLM writes each layer, straight into a ``neutral_kv`` payload; the one
generated token's top-k log-probabilities (the distribution after the last
prompt token, from the raw logits) are the canary. K is in "halves" order (vLLM
rotates halves, RoPE "neox", on checkpoint-order weights): a llama.cpp decode
server of a llama-family GGUF permutes it on import, an MLX one takes it as is.
vLLM's automatic prefix caching is on; its hits are ``prompt_tokens_cached``.

**Streamed** (the overlapped handoff, ``kv/stream.py``): the payload is laid
out and the bundle opened before the request enters the engine; the
connector's per-layer hook (``save_kv_layer``) copies each layer's K and V of
the tokens an engine step computes and hands them to the stream as one piece
while the layers above still run, so a prompt that vLLM's chunked prefill
splits over several steps leaves chunk by chunk, layer by layer (the cached
prefix with the first chunk). The canary and the prefill's figures follow in
the trailer; a prefill that fails half-way (a layer the connector cannot read,
an engine that fails, a request refused) ends the stream with an error frame.

**Serving.** vLLM batches inside itself: the server's ``parallel`` requests run
on as many worker threads (``slots``), each handing its request to the one
thread that owns the engine (``_EngineThread``: it builds the engine, adds the
requests, steps it and routes each output) and waiting for its outputs. That
engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni``
executor), so the connector's captures are this process's memory: one GPU per
server (no tensor parallelism), as a DGX runs one prefill server per H100.
``decode`` continues ``token_ids`` (it recomputes, with the prefix cache) and
``generate`` is the decode-only fallback; ``json_schema`` is refused (400).
"""
from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from ..metrics import ServerFigures
from ..errors import BackendUnavailable, BadRequest, BundleError, ConfigError, FingerprintMismatch
from ..kv import fingerprint as fp
from ..kv import neutral
from ..kv.buffers import populate, sendable
from ..kv.bundle import KIND_NEUTRAL_KV, KIND_TOKEN_IDS
from .base import Backend, Event, ModelSettings, Prefilled, Prompt, Received, Sampling, check_fits, rate
from .gguf import resolve_gguf
from .gguf_vocab import GgufVocab
from .neutral_engine import generation_metrics, stream_text
from .options import option

CONNECTOR_MODULE = "disaggregated_inference.backends.vllm_connector"
CONNECTOR_CLASS = "NeutralKVConnector"
_NEUTRAL_DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
# set before vLLM is imported: no usage reports, no hub, quiet logs, the engine core in this process
_ENVIRONMENT = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_LOGGING_LEVEL": "ERROR", "TQDM_DISABLE": "1"}


@dataclass(frozen=True)
class VllmSettings(ModelSettings):
    weights: str = option("", "a Hugging Face model directory of the same checkpoint as the model's GGUF, run instead "
                              "of the GGUF's weights (the GGUF still tokenizes and names the weights)")
    dtype: str = option("auto", "weights and KV dtype (auto: float32 for weights from a GGUF, else the checkpoint's)",
                        choices=("auto", "float32", "bfloat16", "float16"))
    kv_cache_gib: int = option(1, "GiB of KV cache of vLLM's CPU build (its VLLM_CPU_KVCACHE_SPACE)", low=1)
    gpu_memory_utilization: float = option(0.9, "the share of the GPU's memory vLLM takes (its CUDA build)", above=0)
    max_num_batched_tokens: int | None = option(None, "prompt tokens per engine step, vLLM's chunked prefill "
                                                      "(unset: vLLM's default)", low=1)
    enforce_eager: bool = option(True, "no CUDA graphs or torch.compile: start-up in seconds, not minutes "
                                       "(prefill gains little from graphs)")


class VllmBackend(Backend):
    name = "vllm"
    handoff_kind = KIND_NEUTRAL_KV
    accepts = (KIND_TOKEN_IDS,)
    Settings = VllmSettings
    # the overlapped handoff: each layer's K/V of the tokens an engine step computes leaves once that layer ran
    kv_streaming = {"enabled": True, "reason": None}

    def __init__(self, settings):
        super().__init__(settings)
        self.vocab: GgufVocab | None = None
        self._engine: _EngineThread | None = None
        self._fingerprint: dict = {}
        self._layout: dict = {}
        self._kv_dtype = "f32"
        self._eog: list[int] = []
        self._device = "cpu"

    @classmethod
    def compute_threads(cls, settings) -> int:
        """torch's CPU threads in vLLM's CPU build (OMP_NUM_THREADS): ``n_threads``, by default every core."""
        return settings.n_threads or os.cpu_count() or 2

    @property
    def engine(self) -> str:
        return f"vllm/{'cpu' if self._device == 'cpu' else 'gpu'}"

    # -- loading ---------------------------------------------------------------------------------

    def load(self, progress: Callable[[str], None] = lambda message: None) -> None:
        for key, value in _ENVIRONMENT.items():
            os.environ.setdefault(key, value)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the connector's captures live in this process
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(self.settings.kv_cache_gib)
        if self.settings.n_threads or "OMP_NUM_THREADS" not in os.environ:  # vLLM sets torch's threads from it
            os.environ["OMP_NUM_THREADS"] = str(self.compute_threads(self.settings))
        directory, gguf_path, weights_from = self._source(progress)
        digest = fp.file_sha256(gguf_path, progress)
        if weights_from == "gguf":
            from .transformers import model_dir

            directory = model_dir(gguf_path, digest, progress)
        self.vocab = GgufVocab(gguf_path)
        self._eog = self.vocab.eog_tokens()
        progress(f"starting vLLM on {directory.name} (its engine takes tens of seconds to start)")
        started = time.perf_counter()
        dtype = self.settings.dtype if self.settings.dtype != "auto" or weights_from != "gguf" else "float32"
        self._engine = _EngineThread(lambda: self._make_engine(directory, dtype))
        self._engine.start()
        self._describe_model(gguf_path, digest, weights_from, directory)
        progress(f"vLLM {self._fingerprint['library_version']} ready on {self._device} in "
                 f"{time.perf_counter() - started:.1f}s")

    def _source(self, progress) -> tuple[Path | None, Path, str]:
        """(the Hugging Face directory to run, or None: the GGUF's own weights; the GGUF; where the weights come
        from)."""
        gguf = resolve_gguf(self.settings.model, progress)
        if not self.settings.weights:
            return None, gguf, "gguf"
        path = Path(self.settings.weights).expanduser()
        if not (path / "config.json").is_file():
            raise ConfigError(f"weights {self.settings.weights!r} is not a Hugging Face model directory (no "
                              "config.json there)", field="weights")
        return path, gguf, "huggingface"

    def _make_engine(self, directory: Path, dtype: str):
        """Runs on the engine's thread."""
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        s = self.settings
        extra = {} if s.max_num_batched_tokens is None else {"max_num_batched_tokens": s.max_num_batched_tokens}
        args = EngineArgs(
            model=str(directory), skip_tokenizer_init=True, dtype=dtype, max_model_len=s.n_ctx,
            max_num_seqs=self.slots, enable_prefix_caching=True, enforce_eager=s.enforce_eager,
            gpu_memory_utilization=s.gpu_memory_utilization, distributed_executor_backend="uni",
            max_logprobs=max(20, self.canary.top_k), seed=0,
            kv_transfer_config={"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE,
                                "kv_role": "kv_producer"},
            **extra)
        return LLMEngine.from_engine_args(args)

    def _describe_model(self, gguf_path: Path, digest: str, weights_from: str, directory: Path) -> None:
        import torch
        import vllm
        from vllm.platforms import current_platform

        engine = self._engine.engine
        c = engine.model_config.hf_config
        self._device = str(current_platform.device_type)
        self._kv_dtype = _NEUTRAL_DTYPES[str(engine.model_config.dtype).removeprefix("torch.")]
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        rope = getattr(c, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(c, "rope_theta", None))
        self._layout = {"n_layer": c.num_hidden_layers, "n_kv_heads": c.num_key_value_heads, "head_dim_k": head_dim,
                        "head_dim_v": head_dim, "head_dim_order": "halves",
                        "rope": {"style": "neox", "theta": float(theta if theta is not None else 10000.0)}}
        n_vocab = self.vocab.llama.n_vocab()
        if n_vocab > c.vocab_size:
            raise ConfigError(f"the GGUF's vocabulary has {n_vocab} tokens, the weights' embedding {c.vocab_size}: "
                              "not the same checkpoint", field="weights")
        self._fingerprint = {
            "backend": self.name, "library": "vllm", "library_version": vllm.__version__,
            "torch_version": torch.__version__, "model_sha256": digest, "model_file": gguf_path.name,
            "weights_from": weights_from, "weights_dir": directory.name,
            "arch": self.vocab.llama.metadata.get("general.architecture"), "hf_model_type": c.model_type,
            "n_layer": c.num_hidden_layers, "n_embd": c.hidden_size, "n_vocab": n_vocab, "n_ctx": self.settings.n_ctx,
            "device": self._device, "dtype": str(engine.model_config.dtype).removeprefix("torch."),
            "block_size": engine.vllm_config.cache_config.block_size,
        }

    def fingerprint(self) -> dict:
        return dict(self._fingerprint)

    def identity(self) -> dict:
        """What a decode side checks a neutral bundle's weights against (kv/neutral.py, ``check_model``)."""
        return {"model_sha256": self._fingerprint["model_sha256"], "arch": self._fingerprint["arch"]}

    def describe(self) -> dict:
        return {"model_sha256": self._fingerprint.get("model_sha256"),
                "weights_from": self._fingerprint.get("weights_from"), "weights": self.settings.weights or None,
                "n_ctx": self.settings.n_ctx,
                "parallel": self.slots, "device": self._device, "prefix_cache": True,
                "vllm_version": self._fingerprint.get("library_version"), "kv_streaming": self.kv_streaming,
                "engine": None if self._engine is None else self._engine.state,
                **({"ready": False} if self._engine is not None and self._engine.state != "running" else {})}

    def close(self) -> None:
        if self._engine is not None:
            self._engine.stop()
            self._engine = None
        if self.vocab is not None:
            self.vocab.close()
            self.vocab = None

    # -- the verbs -------------------------------------------------------------------------------

    def prefill(self, prompt: Prompt, kv_stream=None) -> Prefilled:
        """Evaluate the prompt (one generated token: the canary) capturing the KV of all but its last token;
        with ``kv_stream`` (a sink of ``kv/stream.py``) each layer's K and V of the tokens an engine step
        computed go to the sink as soon as that layer's attention has written them (``vllm_connector.py``)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        from . import vllm_connector

        t0 = time.perf_counter()
        tokens, stops = self.vocab.tokenize(prompt)
        tokenize_time = time.perf_counter() - t0
        check_fits(len(tokens), self.settings.n_ctx)
        n_kv = len(tokens) - 1
        layout = self._layout
        capture = vllm_connector.Capture(layout["n_layer"], layout["n_kv_heads"], layout["head_dim_k"],
                                         n_kv, self._kv_dtype, allocate=sendable)
        populate(capture.payload)  # its pages fault in beside the prefill, not in the layers' copies
        kv = neutral.NeutralKV(capture.keys, capture.values, dtype=self._kv_dtype, pos_start=0, rope=layout["rope"],
                               head_dim_order=layout["head_dim_order"], model=self.identity())
        meta = {"stop": list(stops), "neutral": neutral.validate_meta(kv.meta())}
        if kv_stream is not None:
            kv_stream.open(KIND_NEUTRAL_KV, tokens, capture.payload, self.fingerprint(), meta)
            capture.on_layer = _publisher(kv_stream, capture, meta["neutral"])
            if not n_kv:
                kv_stream.ended()
        key = uuid.uuid4().hex
        extra = {"kv_transfer_params": {vllm_connector.CAPTURE_KEY: key, "n_tokens": n_kv}} if n_kv else None
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=max(1, self.canary.top_k), detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY, extra_args=extra)
        vllm_connector.expect(key, capture)
        t1 = time.perf_counter()
        try:
            final = self._engine.run(tokens, params)
        finally:
            vllm_connector.forget(key)
        prefill_time = time.perf_counter() - t1
        if n_kv and not capture.complete:
            raise BundleError(f"vLLM's KV of this prompt was not captured ({capture.layers_done} of "
                              f"{layout['n_layer']} layers): {capture.error or 'the request ended first'}", field="kv")
        t2 = time.perf_counter()
        if self.canary.top_k > 0:
            meta["canary"] = canary_of(final.outputs[0].logprobs[0], self.canary.top_k, self.engine)
        canary_time = time.perf_counter() - t2
        cached = final.num_cached_tokens or 0
        evaluated = len(tokens) - cached
        streamed = kv_stream is not None
        return Prefilled(
            kind=KIND_NEUTRAL_KV, tokens=tokens, payload=capture.payload, fingerprint=self.fingerprint(), meta=meta,
            metrics=ServerFigures.of(**{"prompt_tokens": len(tokens), "prompt_tokens_evaluated": evaluated,
                     "prompt_tokens_cached": cached, "tokenize_time": round(tokenize_time, 6),
                     "prefill_time": round(prefill_time, 6), "prefill_speed": rate(evaluated, prefill_time),
                     # the layers' copies out of vLLM's cache, made during the prefill (part of prefill_time)
                     "kv_read_time" if streamed else "kv_export_time": round(capture.copy_seconds, 6),
                     "kv_bytes": len(capture.payload), "handoff_mode": "streamed" if streamed else "whole",
                     "canary_ms": round(canary_time * 1000, 3) if "canary" in meta else None}),
        )

    def decode(self, received: Received, sampling: Sampling, cancelled) -> Iterator[Event]:
        if received.kind != KIND_TOKEN_IDS:
            raise FingerprintMismatch(f"this vllm server cannot continue a {received.kind!r} bundle (it accepts "
                                      f"{', '.join(self.accepts)}: it recomputes the prompt)", field="kv")
        yield from self._generate(received.tokens, tuple(received.meta.get("stop", ())), sampling, cancelled,
                                  time.perf_counter(), "token_ids_recompute")

    def generate(self, prompt: Prompt, sampling: Sampling, cancelled) -> Iterator[Event]:
        started = time.perf_counter()
        self._refuse_schema(sampling)
        tokens, stops = self.vocab.tokenize(prompt)
        yield from self._generate(tokens, stops, sampling, cancelled, started, "decode_only")

    def _refuse_schema(self, sampling: Sampling) -> None:
        if sampling.json_schema is not None:
            raise BadRequest("the vllm backend here runs without a tokenizer (token ids of the GGUF's vocabulary), "
                             "so it cannot constrain output to a JSON schema; send the request to a llama_cpp "
                             "server or leave json_schema out", field="json_schema")

    def _generate(self, tokens, stops, sampling: Sampling, cancelled, started: float, method: str):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._refuse_schema(sampling)
        check_fits(len(tokens), self.settings.n_ctx)
        stop = tuple(sampling.stop) + tuple(s for s in stops if s not in sampling.stop)
        budget = min(sampling.max_new_tokens, self.settings.n_ctx - len(tokens))
        params = SamplingParams(
            max_tokens=max(1, budget), temperature=max(0.0, sampling.temperature), top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.temperature > 0 and sampling.top_k > 0 else 0, seed=sampling.seed,
            stop_token_ids=list(self._eog), detokenize=False, output_kind=RequestOutputKind.DELTA)
        request = self._engine.submit(tokens, params)
        try:
            first = request.next_token()
            t_gen = time.perf_counter()
            if first is None:
                first = self._eog[0] if self._eog else 0
            generated, finish, first_at = yield from stream_text(
                self.vocab, first, lambda token: token, lambda token: request.next_token(self._eog),
                budget=budget, stop=stop, cancelled=cancelled)
        finally:
            request.close()
        cached = request.cached_tokens
        yield Event(metrics=generation_metrics(
            tokens, len(tokens) - cached, generated, finish, started=started, t_gen=t_gen, first_at=first_at,
            extra=ServerFigures(kv_load_time=0.0, method=method, prompt_tokens_cached=cached)))


def _publisher(sink, capture, meta: dict) -> Callable[[int, int, int], None]:
    """The capture's ``on_layer`` for a streamed handoff: each layer's tokens, once copied, are one piece of
    the sink; the last layer's are the prompt's progress, and the last of all ends the payload."""
    last = meta["n_layer"] - 1

    def on_layer(il: int, start: int, end: int) -> None:
        sink.ready(neutral.token_segments(meta, il, start, end))
        if il == last:
            sink.progress(end)
        if capture.layers_done == capture.n_layer:
            sink.ended()

    return on_layer


def canary_of(logprobs: dict, k: int, engine: str) -> dict:
    """The canary (kv/canary.py) from vLLM's top log-probabilities of one position: ``{token id: Logprob}``."""
    ranked = sorted(logprobs.items(), key=lambda item: (item[1].rank, -item[1].logprob))[:k]
    return {"k": len(ranked), "ids": [int(i) for i, _ in ranked], "logprobs": [float(lp.logprob) for _, lp in ranked],
            "engine": engine, "alone": False}


@contextlib.contextmanager
def _flask_context():
    """A throwaway Flask request context on the engine's thread. vLLM's CPU platform scans every loaded
    module's globals when it registers its kernels (``vllm/triton_utils/dispatcher.py``), calling
    ``hasattr(value, "__dict__")``, which Flask's context-local proxies (``flask.request``,
    ``current_app``) answer with RuntimeError outside a request: the engine would not start inside a
    server. In this context they resolve (to objects of an app that serves nothing)."""
    try:
        from flask import Flask
    except ImportError:  # not in a server
        yield
        return
    with Flask("vllm-engine").test_request_context():
        yield


class _Request:
    """One request inside the engine: its outputs, as the engine's thread hands them over."""

    def __init__(self, engine: "_EngineThread", tokens: list, params):
        self.id = uuid.uuid4().hex
        self.tokens, self.params, self._engine = tokens, params, engine
        self.outputs: queue.SimpleQueue = queue.SimpleQueue()
        self.cached_tokens = 0
        self.finished = False
        self._pending: list[int] = []
        self._ended = False

    def get(self):
        kind, value = self.outputs.get()
        if kind == "error":
            self._ended = True
            raise value
        self.cached_tokens = value.num_cached_tokens or self.cached_tokens
        if value.finished:
            self._ended = True
        return value

    def next_token(self, eog=()) -> int | None:
        """The next generated token id; at the end, an end-of-generation id when vLLM stopped at one it did
        not hand over (``eog``'s first), else None."""
        while not self._pending:
            if self._ended:
                return None
            out = self.get()
            self._pending.extend(out.outputs[0].token_ids)
            if self._ended and not self._pending and out.outputs[0].finish_reason == "stop" and eog:
                return eog[0]
        return self._pending.pop(0)

    def close(self) -> None:
        """Give the request up if it is still running (a stop string, a cancelled client)."""
        if not self._ended:
            self._engine.abort(self)


class _EngineThread:
    """The one thread that owns the vLLM engine: it builds it, adds and aborts requests, steps it and hands
    each request its outputs."""

    def __init__(self, make: Callable):
        self._make, self.engine, self.error = make, None, None
        self.state = "starting"
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._running: dict[str, _Request] = {}
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self.error is not None:
            raise self.error

    def submit(self, tokens: list, params) -> _Request:
        if self.state != "running":
            raise BackendUnavailable(f"the vLLM engine is {self.state}{f': {self.error}' if self.error else ''}")
        request = _Request(self, tokens, params)
        self._inbox.put(("add", request))
        return request

    def run(self, tokens: list, params):
        """Submit and wait for the request's final output."""
        request = self.submit(tokens, params)
        while True:
            out = request.get()
            if out.finished:
                return out

    def abort(self, request: _Request) -> None:
        self._inbox.put(("abort", request))

    def stop(self, timeout: float = 30.0) -> None:
        self._inbox.put(("stop", None))
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        with _flask_context():
            self._serve()

    def _serve(self) -> None:
        try:
            self.engine = self._make()
        except BaseException as exc:  # reported by start() on the loading thread
            self.error, self.state = exc, "failed"
            self._ready.set()
            return
        self.state = "running"
        self._ready.set()
        try:
            while self._take(block=not self._running):
                if self._running:
                    self._step()
        finally:
            if self.state == "running":
                self.state = "stopped"
            for request in self._running.values():
                request.outputs.put(("error", BackendUnavailable("the vLLM engine stopped")))
            self._running.clear()
            core = getattr(self.engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            self.engine = None

    def _take(self, block: bool) -> bool:
        """Add and abort what the inbox holds (waiting for something when ``block``); False on stop."""
        while True:
            try:
                kind, request = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "add":
                try:
                    from vllm.inputs import TokensPrompt

                    self.engine.add_request(request.id, TokensPrompt(prompt_token_ids=request.tokens), request.params)
                    self._running[request.id] = request
                except Exception as exc:
                    request.outputs.put(("error", BadRequest(f"vLLM refused the request: {exc}", field="prompt")))
            elif kind == "abort" and self._running.pop(request.id, None) is not None:
                self.engine.abort_request([request.id])

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # the engine is broken: every request in it fails, and the server says so
            self.error, self.state = exc, "failed"
            for request in self._running.values():
                request.outputs.put(("error", BackendUnavailable(f"the vLLM engine failed: {exc}")))
            self._running.clear()
            raise
        for out in outputs:
            request = self._running.get(out.request_id)
            if request is None:
                continue  # aborted meanwhile
            request.outputs.put(("output", out))
            if out.finished:
                del self._running[out.request_id]
