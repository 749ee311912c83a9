"""What every engine that hands over ``neutral_kv`` shares: the verbs, the token loop, the handoff's checks.

MLX and transformers run a model in process, one request at a time, and hand
over the prompt's K/V arrays in the engine-neutral layout (kv/neutral.py), so
either can continue the other's prompt, or llama.cpp's (converted on its
prefill server). All of that but the model itself lives here, once:
``prefill``, ``decode`` and ``generate``; the token loop (sampling up to the
budget, end of generation, stop strings held back until they can no longer
start, cancellation); the canary; the metrics; a neutral import's checks
(weights, shapes, positions, token count) and the permutation of a K that
arrives in the other head-dim order.

An engine built on ``NeutralKVBackend`` provides the model:

``load()``
    sets ``self.model``, ``self.vocab`` (a ``GgufVocab``: the GGUF's
    vocabulary and chat format, ``prompt_tokens(prompt)``, ``ends(format)``,
    ``piece(token, special) -> bytes``, ``special_tokens(text)``, ``close()``)
    and ``self._fingerprint``, whose ``model_sha256`` and ``arch`` name the
    weights a bundle must come from;
``expected_layout()``
    its cache's ``n_layer``, ``n_kv_heads``, ``head_dim_k``/``head_dim_v``,
    ``head_dim_order`` and ``rope`` (kv/neutral.py);
``new_cache()``, ``evaluate(tokens, cache)``
    an empty cache; the model run over ``tokens`` into the cache, returning the
    last position's logits (in the engine's own array type);
``cache_arrays(cache)``, ``kv_dtype``
    the cache's K and V per layer as numpy arrays (n_kv_heads, n_tokens,
    head_dim), and their neutral dtype name;
``fill_cache(cache, layers, n_kv_tokens)``
    a new cache filled from ``(il, K, V)`` float32 numpy arrays, K already in
    the engine's head-dim order;
``sampler(sampling)``, ``logits_array(logits)``
    ``logits -> token id``; the logits as a float32 numpy vector (the canary);
and may replace ``step(token, cache)``, the next token's logits (``evaluate``
of that one token by default).

An engine whose forward pass can say when a layer is done with a chunk sets
``kv_streaming`` enabled and provides ``evaluate_streamed(tokens, cache,
layer_done)``: the overlapped handoff (``kv/stream.py``) then lays the neutral
payload out before the prompt is evaluated, and each layer's K and V of each
chunk are copied into their place and handed over as one piece while the
layers above still compute. Without it the KV is handed over whole.

Answers are read by the model's chat format (chat/), as llama.cpp's loop reads
them: reasoning, answer and tool calls apart, the format's end tokens, a
reasoning budget that moves the model on to its answer. These engines have no
grammar sampling, so what needs one (``json_schema``, tool calls through the
JSON envelope) is refused with a 400.
"""
from __future__ import annotations

import abc
import codecs
import time
from typing import Iterator

from ..metrics import Method, ServerFigures
from .. import chat
from ..errors import BadRequest, FingerprintMismatch
from ..kv import buffers, neutral
from ..kv.bundle import KIND_NEUTRAL_KV, KIND_TOKEN_IDS
from .base import Backend, ChatSettings, Event, Prefilled, Prompt, Received, Sampling, check_fits, rate


class NeutralKVBackend(Backend):
    handoff_kind = KIND_NEUTRAL_KV
    accepts = (KIND_NEUTRAL_KV, KIND_TOKEN_IDS)
    Settings = ChatSettings

    def __init__(self, settings):
        super().__init__(settings)
        self.model = None
        self.vocab = None
        self._fingerprint: dict = {}
        self.kv_convert_time: float | None = None  # the last import's K permutation, when it needed one

    @property
    def slots(self) -> int:
        """One request at a time: these engines do not batch, and one model is not driven from several
        threads at once here (``parallel`` is ignored; requests beyond it wait for the slot)."""
        return 1

    # -- what the engine provides ----------------------------------------------------------------

    @abc.abstractmethod
    def expected_layout(self) -> dict:
        """The neutral layout of this engine's cache (without ``n_kv_tokens``)."""

    @abc.abstractmethod
    def new_cache(self):
        """An empty cache."""

    @abc.abstractmethod
    def evaluate(self, tokens, cache):
        """Run ``tokens`` through the model into ``cache``; return the last position's logits."""

    @abc.abstractmethod
    def cache_arrays(self, cache) -> tuple[list, list]:
        """The cache's K and V, one numpy array (n_kv_heads, n_tokens, head_dim) per layer each."""

    @property
    @abc.abstractmethod
    def kv_dtype(self) -> str:
        """The neutral dtype (``f32``, ``f16``, ``bf16``) of ``cache_arrays``."""

    @abc.abstractmethod
    def fill_cache(self, cache, layers, n_kv_tokens: int) -> None:
        """Write ``(il, K, V)`` float32 arrays (K in this engine's head-dim order) into a new cache."""

    @abc.abstractmethod
    def sampler(self, sampling: Sampling):
        """``logits -> token id`` for this request's sampling settings (seeded by ``sampling.seed``)."""

    @abc.abstractmethod
    def logits_array(self, logits):
        """One position's logits as a float32 numpy vector."""

    def step(self, token: int, cache):
        """The logits after ``token``, a sampled one, evaluated on ``cache``."""
        return self.evaluate([token], cache)

    # the overlapped handoff: off unless the engine provides ``evaluate_streamed``
    kv_streaming = {"enabled": False, "reason": "this engine hands its KV over once the prompt is evaluated"}

    def evaluate_streamed(self, tokens, cache, layer_done):
        """``evaluate``, calling ``layer_done(il, start, end, read)`` each time layer ``il`` has run on prompt
        tokens ``start..end-1``; ``read()`` returns that layer's K and V of those tokens as numpy arrays
        (n_kv_heads, end - start, head_dim), valid until the layer runs on the next chunk."""
        raise NotImplementedError(f"the {self.name} backend does not stream its KV")

    # -- shared --------------------------------------------------------------------------------

    def fingerprint(self) -> dict:
        return dict(self._fingerprint)

    def close(self) -> None:
        self.model = None
        if self.vocab is not None:
            self.vocab.close()
            self.vocab = None

    def identity(self) -> dict:
        """What a neutral bundle's ``model`` must be to continue here: the weights it came from."""
        return {"model_sha256": self._fingerprint["model_sha256"], "arch": self._fingerprint["arch"]}

    def tokenize(self, prompt: Prompt) -> tuple[list[int], tuple]:
        """Token ids of a prompt and the stop strings its chat template adds (the GGUF's vocabulary, read
        only: safe beside the model's work)."""
        return self.vocab.prompt_tokens(prompt, self.settings.n_ctx)[:2]

    def export_neutral(self, cache, n_kv_tokens: int) -> neutral.NeutralKV:
        """The cache (``n_kv_tokens`` prompt tokens) as neutral K/V arrays."""
        import numpy as np

        layout = self.expected_layout()
        if n_kv_tokens == 0:
            shape = (layout["n_kv_heads"], 0, layout["head_dim_k"])
            keys = [np.zeros(shape, np.float32) for _ in range(layout["n_layer"])]
            values = [k.copy() for k in keys]
        else:
            keys, values = self.cache_arrays(cache)
        return neutral.NeutralKV(keys, values, dtype=self.kv_dtype, pos_start=0, rope=layout["rope"],
                                 head_dim_order=layout["head_dim_order"], model=self.identity())

    def import_neutral(self, meta: dict, payload, n_kv_tokens: int):
        """A cache holding a neutral bundle's K/V, checked against this model first; K arriving in the other
        head-dim order is permuted into this engine's (the time it took: ``kv_convert_time``)."""
        layout = self.expected_layout()
        meta, permute = neutral.check_import(meta, self.identity(), layout, n_kv_tokens)
        perm = neutral.head_dim_permutation(layout["head_dim_order"], meta["head_dim_k"]) if permute else None
        cache = self.new_cache()
        self.kv_convert_time = None if perm is None else 0.0
        if n_kv_tokens:
            self.fill_cache(cache, self._float32_layers(meta, payload, perm), n_kv_tokens)
        return cache

    def _float32_layers(self, meta: dict, payload, perm):
        for il, k, v in neutral.iter_layers(meta, payload):
            k = neutral.to_float32(k, meta["dtype"])
            if perm is not None:
                t = time.perf_counter()
                k = k[..., perm]
                self.kv_convert_time += time.perf_counter() - t
            yield il, k, neutral.to_float32(v, meta["dtype"])

    # -- the verbs -------------------------------------------------------------------------------

    def prefill(self, prompt: Prompt, kv_stream=None) -> Prefilled:
        """Evaluate all but the prompt's last token and hand its KV over as a neutral bundle; with ``kv_stream``
        (a sink of ``kv/stream.py``, given only where ``kv_streaming`` is enabled) piece by piece as the
        layers compute it."""
        t0 = time.perf_counter()
        tokens, stops, chat_name = self.vocab.prompt_tokens(prompt)
        tokenize_time = time.perf_counter() - t0
        check_fits(len(tokens), self.settings.n_ctx)
        cache = self.new_cache()
        t1 = time.perf_counter()
        if kv_stream is not None:
            meta, payload, export_time = self._prefill_streamed(tokens, cache, {"stop": list(stops), "chat": chat_name},
                                                                kv_stream)
            evaluated = max(0, len(tokens) - 1)
            prefill_time = time.perf_counter() - t1
        else:
            evaluated = self._evaluate_all_but_last(tokens, cache)
            prefill_time = time.perf_counter() - t1
            t2 = time.perf_counter()
            meta, payload = neutral.encode(self.export_neutral(cache, evaluated))
            export_time = time.perf_counter() - t2
        extra = {"stop": list(stops), "chat": chat_name, "neutral": meta}
        t3 = time.perf_counter()
        if self.canary.top_k > 0:  # after the export: the bundle still ends one token early (kv/canary.py)
            extra["canary"] = self.canary.make(self.logits_array(self.evaluate(tokens[-1:], cache)), self.engine)
        canary_time = time.perf_counter() - t3
        return Prefilled(
            kind=KIND_NEUTRAL_KV, tokens=tokens, payload=payload, fingerprint=self.fingerprint(), meta=extra,
            metrics=ServerFigures.of(**{"prompt_tokens": len(tokens), "prompt_tokens_evaluated": evaluated,
                     "tokenize_time": round(tokenize_time, 6), "prefill_time": round(prefill_time, 6),
                     "prefill_speed": rate(evaluated, prefill_time),
                     # streamed: the layers' reads and copies into the payload, made during the prefill (part of it)
                     "kv_read_time" if kv_stream is not None else "kv_export_time": round(export_time, 6),
                     "kv_bytes": len(memoryview(payload).cast("B")),
                     "handoff_mode": "streamed" if kv_stream is not None else "whole",
                     "canary_ms": round(canary_time * 1000, 3) if "canary" in extra else None}),
        )

    def _prefill_streamed(self, tokens, cache, header_meta: dict, sink) -> tuple[dict, object, float]:
        """Evaluate ``tokens[:-1]`` into ``cache`` handing ``sink`` each layer's K and V of each chunk as soon as
        that layer has run on it (``evaluate_streamed``); returns (meta, payload, read and copy time)."""
        n, layout = max(0, len(tokens) - 1), self.expected_layout()
        meta = neutral.validate_meta({
            "layout": neutral.LAYOUT, "dtype": self.kv_dtype, "n_layer": layout["n_layer"],
            "n_kv_heads": layout["n_kv_heads"], "head_dim_k": layout["head_dim_k"], "head_dim_v": layout["head_dim_v"],
            "n_kv_tokens": n, "pos_start": 0, "rope": layout["rope"], "head_dim_order": layout["head_dim_order"],
            "model": self.identity()})
        payload = buffers.sendable(neutral.payload_bytes(meta))
        buffers.populate(payload)
        arrays = [(k, v) for _, k, v in neutral.iter_layers(meta, payload)]
        sink.open(KIND_NEUTRAL_KV, tokens, payload, self.fingerprint(), {**header_meta, "neutral": meta})
        copied = 0.0

        def layer_done(il: int, start: int, end: int, read) -> None:
            nonlocal copied
            t = time.perf_counter()
            keys, values = read()
            arrays[il][0][:, start:end] = keys
            arrays[il][1][:, start:end] = values
            sink.ready(neutral.token_segments(meta, il, start, end))
            if il == len(arrays) - 1:
                sink.progress(end)
            copied += time.perf_counter() - t

        if n:
            self.evaluate_streamed(tokens[:-1], cache, layer_done)
        sink.ended()
        return meta, payload, copied

    def decode(self, received: Received, sampling: Sampling, cancelled) -> Iterator[Event]:
        started = time.perf_counter()
        check_fits(len(received.tokens), self.settings.n_ctx)
        output = self._output(sampling, received.meta.get("chat"), received.meta.get("stop", ()), received.tokens)
        canary, converted, evaluated = None, {}, 0
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
            evaluated = self._evaluate_all_but_last(received.tokens, cache)
        else:
            raise FingerprintMismatch(f"this {self.name} server cannot continue a {received.kind!r} bundle "
                                      f"(it accepts {', '.join(self.accepts)})", field="kv")
        yield from self._continue(received.tokens, cache, sampling, output, evaluated=evaluated, cancelled=cancelled,
                                  started=started, canary=canary,
                                  extra=ServerFigures.of(kv_load_time=round(load_time, 6), method=method, **converted))

    def generate(self, prompt: Prompt, sampling: Sampling, cancelled) -> Iterator[Event]:
        started = time.perf_counter()
        tokens, stops, chat_name = self.vocab.prompt_tokens(prompt)
        check_fits(len(tokens), self.settings.n_ctx)
        output = self._output(sampling, chat_name, stops, tokens)
        cache = self.new_cache()
        evaluated = self._evaluate_all_but_last(tokens, cache)
        yield from self._continue(tokens, cache, sampling, output, evaluated=evaluated, cancelled=cancelled,
                                  started=started, extra=ServerFigures.of(kv_load_time=0.0, method="decode_only"))

    def _evaluate_all_but_last(self, tokens, cache) -> int:
        """Evaluate every prompt token but the last into ``cache``; returns how many that was."""
        if len(tokens) > 1:
            self.evaluate(tokens[:-1], cache)
        return max(0, len(tokens) - 1)

    def _output(self, sampling: Sampling, chat_name: str | None, stops, tokens) -> chat.Output:
        """How this request's answer is read (as llama.cpp's ``_output``); what needs grammar sampling is
        refused, naming the field that asked for it."""
        output = chat.Output(chat.for_output(chat_name, self.vocab.chat),
                             budget=min(sampling.max_new_tokens, self.settings.n_ctx - len(tokens)),
                             tools=sampling.tools, json_schema=sampling.json_schema,
                             stop=tuple(sampling.stop) + tuple(s for s in stops if s not in sampling.stop),
                             reasoning_budget=sampling.reasoning_budget)
        if output.start_schema is not None or output.answer_schema is not None:
            field = "json_schema" if sampling.json_schema is not None else "tools"
            raise BadRequest(f"the {self.name} backend cannot constrain its output to a JSON schema (no grammar "
                             f"sampling), which {field} needs for this model; send the request to a llama_cpp "
                             f"server or leave {field} out", field=field)
        return output

    def _continue(self, tokens, cache, sampling: Sampling, output: chat.Output, *, evaluated, cancelled, started,
                  extra, canary=None):
        """Evaluate the last prompt token on ``cache`` (which holds the ``evaluated`` before it, or a handed-over
        state's), then sample; a handed-over state's ``canary`` is checked first (kv/canary.py)."""
        budget = min(sampling.max_new_tokens, self.settings.n_ctx - len(tokens))
        sample = self.sampler(sampling)
        t_gen = time.perf_counter()
        logits = self.evaluate(tokens[-1:], cache)
        if canary is not None:
            extra = extra.with_(**self.canary.check(canary, self.logits_array(logits), self.engine).given())

        def advance(step):
            return self.step(step[0], cache) if len(step) == 1 else self.evaluate(step, cache)

        generated, finish, first_at = yield from stream_text(self.vocab, logits, sample, advance, output,
                                                             budget=budget, cancelled=cancelled)
        metrics = generation_metrics(tokens, evaluated + 1, generated + output.forced_tokens,
                                     output.finish_reason(finish), started=started, t_gen=t_gen, first_at=first_at,
                                     extra=output.metrics().with_(**extra.given()))
        yield Event(metrics=metrics)


def stream_text(vocab, logits, sample, advance, output: chat.Output, *, budget: int, cancelled):
    """Sample up to ``budget`` tokens, feed their text to ``output`` and yield what it reads as ``Event``s.

    ``sample(logits) -> token id``; ``advance(tokens) -> logits`` evaluates the tokens of one step (a sampled
    token, and what the format feeds after it) and is not called after the last. ``output.take`` says what
    each token did: a token the format ends the generation with ends it unless the format moves the model
    on to its answer instead; text the format feeds (the answer's opening) is evaluated with the step.
    Returns ``(sampled tokens, finish_reason, first_token_at)``."""
    ends = vocab.ends(output.format)
    special = output.format.special_text
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    generated, finish, first_at = 0, "length", None
    while generated + output.forced_tokens < budget:
        token = sample(logits)
        if first_at is None:
            first_at = time.perf_counter()
        step = output.take(None if token in ends else decoder.decode(vocab.piece(token, special)))
        for part in step.parts:
            yield Event.of(part)
        if step.done:
            finish = "stop"
            break
        evaluate = [token] if step.sampled else []
        if step.sampled:
            generated += 1
            if cancelled():
                finish = "cancelled"
                break
        if step.feed is not None:  # text the format has the model go on with (chat/output.py)
            ids = vocab.special_tokens(step.feed)
            if generated + output.forced_tokens + len(ids) >= budget:  # no room left for an answer after them
                break
            evaluate += ids
            for part in output.fed(step.feed, len(ids)):
                yield Event.of(part)
        if generated + output.forced_tokens < budget:
            logits = advance(evaluate)
    for part in output.close(decoder.decode(b"", final=True)):
        yield Event.of(part)
    return generated, finish, first_at


def generation_metrics(tokens, prompt_evaluated: int, generated: int, finish: str, *, started: float, t_gen: float,
                       first_at: float | None, extra: ServerFigures) -> ServerFigures:
    """A generation's closing metrics: ``started`` when the request began, ``t_gen`` when the last prompt
    token's evaluation began, ``first_at`` when the first token was sampled (``stream_text``)."""
    ended = time.perf_counter()
    first_at = first_at or ended
    decode_time = ended - t_gen
    metrics = {
        "prompt_tokens": len(tokens), "prompt_tokens_recomputed": prompt_evaluated,
        "completion_tokens": generated, "decode_time": round(decode_time, 6),
        "decode_speed": rate(generated, decode_time), "first_token_time": round(first_at - t_gen, 6),
        "backend_time": round(ended - started, 6), "finish_reason": finish, **extra.given(),
    }
    if extra.method != Method.KV_HANDOFF:
        metrics["prefill_time"] = round(t_gen - started, 6)
        metrics["prefill_speed"] = rate(len(tokens), t_gen - started)
    return ServerFigures.of(**metrics)
