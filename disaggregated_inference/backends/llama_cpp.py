"""llama.cpp in-process (llama-cpp-python): the backend that really moves the KV cache.

Prefill evaluates every prompt token but the last and exports that sequence's
KV with the per-sequence state API; decode imports it, marks those tokens as
already evaluated, and continues from the last prompt token, so the decode
machine evaluates one prompt token instead of N. The monolithic ``generate``
evaluates the prompt the same way (all but the last, then the last), so the
fallback and the handoff give the same greedy text on full-attention models.
"""
from __future__ import annotations

import codecs
import ctypes
import json
import os
import threading
import time
from importlib.metadata import version as package_version
from typing import Callable, Iterator

from .. import fingerprint as fp
from ..buffers import HUGE_THRESHOLD, sendable
from ..bundle import KIND_LLAMA_SEQ_STATE, KIND_TOKEN_IDS
from ..errors import BadRequest, BundleError, ContextOverflow, FingerprintMismatch
from ..models import resolve_gguf
from .base import Backend, Event, Prefilled, Prompt, Received, Sampling

SEQ = 0  # the one sequence a server's context holds
KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}


# Chat templates for architectures whose GGUF files often lack one (the packaged Gemma 3 270M
# does): the model family's documented turn format. A template in the GGUF always wins.
FALLBACK_TEMPLATES = {
    "gemma3": (
        "{{ bos_token }}"
        "{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
        "{% set turns = messages[1:] %}{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
        "{% for message in turns %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
        "<start_of_turn>{{ role }}\n{{ (first if loop.first else '') + message['content'] | trim }}<end_of_turn>\n"
        "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    ),
}


def _rate(n: int, seconds: float):
    return round(n / seconds, 2) if seconds > 0 else None


class LlamaCppBackend(Backend):
    name = "llama_cpp"
    handoff_kind = KIND_LLAMA_SEQ_STATE
    accepts = (KIND_LLAMA_SEQ_STATE, KIND_TOKEN_IDS)

    def __init__(self, settings):
        super().__init__(settings)
        self.llm = None
        self.model_path = None
        self._fingerprint: dict = {}
        self._formatter = None
        self._template_source = None
        self._evaluated = 0  # prompt tokens evaluated by the current generation (counted, not derived)
        self._state_bytes_per_token = 0.0  # of the last export: sizes the next export buffer in advance

    # -- loading ---------------------------------------------------------------------------------

    def load(self, progress: Callable[[str], None] = lambda message: None) -> None:
        import llama_cpp
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        s = self.settings
        for key in ("type_k", "type_v"):
            if getattr(s, key) not in KV_TYPES:
                raise BadRequest(f"{key} must be one of {', '.join(KV_TYPES)}", field=key)
        self.model_path = resolve_gguf(s.model, progress)
        digest = fp.file_sha256(self.model_path, progress)
        progress(f"loading {os.path.basename(self.model_path)} "
                 f"({os.path.getsize(self.model_path) / 1e6:.0f} MB, n_ctx={s.n_ctx}, gpu_layers={s.n_gpu_layers})")
        started = time.perf_counter()
        self.llm = llama_cpp.Llama(
            model_path=str(self.model_path), n_ctx=s.n_ctx, n_batch=s.n_batch, n_threads=s.n_threads,
            n_gpu_layers=s.n_gpu_layers, flash_attn=s.flash_attn, type_k=KV_TYPES[s.type_k],
            type_v=KV_TYPES[s.type_v], verbose=False,
        )
        # Count the tokens each generation really evaluates (llama-cpp-python skips a cached prefix).
        evaluate = self.llm.eval

        def counting_eval(tokens):
            self._evaluated += len(tokens)
            return evaluate(tokens)

        self.llm.eval = counting_eval
        model = self.llm._model.model
        meta = self.llm.metadata
        template = meta.get("tokenizer.chat_template")
        self._template_source = "gguf" if template else None
        if not template and meta.get("general.architecture") in FALLBACK_TEMPLATES:
            template = FALLBACK_TEMPLATES[meta["general.architecture"]]
            self._template_source = f"builtin:{meta['general.architecture']}"
        if template:
            eos, bos = self.llm.token_eos(), self.llm.token_bos()
            self._formatter = Jinja2ChatFormatter(
                template=template,
                eos_token=self.llm._model.token_get_text(eos) if eos != -1 else "",
                bos_token=self.llm._model.token_get_text(bos) if bos != -1 else "",
            )
        self._fingerprint = {
            "backend": self.name,
            "library": "llama-cpp-python",
            "library_version": package_version("llama-cpp-python"),
            "model_sha256": digest,
            "model_file": os.path.basename(self.model_path),
            "arch": meta.get("general.architecture"),
            "n_layer": llama_cpp.llama_model_n_layer(model),
            "n_embd": llama_cpp.llama_model_n_embd(model),
            "n_swa": llama_cpp.llama_model_n_swa(model),
            "type_k": s.type_k,
            "type_v": s.type_v,
            "flash_attn": bool(s.flash_attn),
            "n_ctx": s.n_ctx,
        }
        progress(f"loaded in {time.perf_counter() - started:.1f}s")

    def fingerprint(self) -> dict:
        return dict(self._fingerprint)

    def describe(self) -> dict:
        return {"model_file": str(self.model_path), "n_ctx": self.settings.n_ctx,
                "arch": self._fingerprint.get("arch"), "n_swa": self._fingerprint.get("n_swa"),
                "library_version": self._fingerprint.get("library_version"),
                "chat_template": self._template_source}

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()
            self.llm = None

    # -- prompt -> tokens ------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> tuple[list[int], tuple]:
        """Token ids of a prompt and the stop strings its chat template adds."""
        if prompt.raw or (self._formatter is None and prompt.messages is None):
            text = prompt.text if prompt.system is None else f"{prompt.system}\n\n{prompt.text}"
            return self.llm.tokenize(text.encode("utf-8"), add_bos=True, special=False), ()
        if self._formatter is None:
            raise BadRequest("this model has no chat template; send 'prompt' with 'raw': true", field="messages")
        messages = list(prompt.messages or ({"role": "user", "content": prompt.text},))
        if prompt.system:
            messages.insert(0, {"role": "system", "content": prompt.system})
        try:
            rendered = self._formatter(messages=messages)
        except Exception as exc:  # the template's own raise_exception, or a jinja error
            raise BadRequest(f"chat template rejected the messages: {exc}", field="messages") from None
        tokens = self.llm.tokenize(rendered.prompt.encode("utf-8"), add_bos=not rendered.added_special, special=True)
        return tokens, tuple(s for s in rendered.stop if s)

    def _check_fits(self, n_prompt: int) -> None:
        if n_prompt < 1:
            raise BadRequest("the prompt has no tokens", field="prompt")
        if n_prompt >= self.settings.n_ctx:
            raise ContextOverflow(f"prompt has {n_prompt} tokens; this server's context holds {self.settings.n_ctx}",
                                  field="prompt")

    # -- the handoff -----------------------------------------------------------------------------

    def _evaluate_all_but_last(self, tokens: list[int]) -> float:
        self.llm.reset()
        started = time.perf_counter()
        if len(tokens) > 1:
            self.llm.eval(tokens[:-1])
        return time.perf_counter() - started

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

    def export_state(self, prepared=None) -> memoryview:
        """The current sequence's KV as a buffer (the one extra copy on this side), in a sendable file."""
        import llama_cpp

        ctx = self.llm._ctx.ctx
        size = llama_cpp.llama_state_seq_get_size(ctx, SEQ)
        # a prepared buffer serves if it is large enough and wastes at most a quarter
        buf = prepared if prepared is not None and size <= len(prepared) <= 1.25 * size + (1 << 20) else sendable(size)
        written = llama_cpp.llama_state_seq_get_data(ctx, (ctypes.c_uint8 * size).from_buffer(buf), size, SEQ)
        if written == 0 and size:
            raise RuntimeError("llama_state_seq_get_data wrote nothing")
        return memoryview(buf)[:written]

    def import_state(self, received: Received) -> float:
        """Load a bundle's KV into this context; afterwards ``received.payload`` is dropped."""
        import llama_cpp

        tokens = received.tokens
        started = time.perf_counter()
        self.llm.reset()
        ctx = self.llm._ctx.ctx
        payload = received.payload
        n = len(payload)
        try:
            src = (ctypes.c_uint8 * n).from_buffer(payload)  # writable buffers: no copy
        except TypeError:
            src = (ctypes.c_uint8 * n).from_buffer_copy(payload)
        ok = llama_cpp.llama_state_seq_set_data(ctx, src, n, SEQ)
        del src
        received.payload = None  # free the received copy as soon as llama.cpp holds the state
        try:
            received.verify()  # its checksum ran alongside the import: nothing is generated from bytes it refuses
        except BundleError:
            self.llm.reset()
            raise
        if not ok:
            raise BundleError("llama.cpp refused the KV state (layout does not match this context)", field="kv")
        k = len(tokens) - 1
        mem = llama_cpp.llama_get_memory(ctx)
        pos_max = llama_cpp.llama_memory_seq_pos_max(mem, SEQ)
        if pos_max != k - 1:
            self.llm.reset()
            raise BundleError(f"KV state covers positions up to {pos_max}, but the bundle's {len(tokens)} token ids "
                              f"need {k - 1}", field="kv")
        self.llm.input_ids[:k] = tokens[:-1]
        self.llm.n_tokens = k
        return time.perf_counter() - started

    def prefill(self, prompt: Prompt) -> Prefilled:
        t0 = time.perf_counter()
        tokens, stops = self.tokenize(prompt)
        tokenize_time = time.perf_counter() - t0
        self._check_fits(len(tokens))
        prepared = self._prepare_buffer(len(tokens) - 1)
        prefill_time = self._evaluate_all_but_last(tokens)
        buffer = prepared()
        t1 = time.perf_counter()
        payload = self.export_state(buffer)
        export_time = time.perf_counter() - t1
        del buffer
        self._state_bytes_per_token = len(payload) / max(1, len(tokens) - 1)
        evaluated = len(tokens) - 1
        return Prefilled(
            kind=KIND_LLAMA_SEQ_STATE, tokens=tokens, payload=payload, fingerprint=self.fingerprint(),
            meta={"stop": list(stops)},
            metrics={"prompt_tokens": len(tokens), "prompt_tokens_evaluated": evaluated,
                     "tokenize_time": round(tokenize_time, 6), "prefill_time": round(prefill_time, 6),
                     "prefill_speed": _rate(evaluated, prefill_time), "kv_export_time": round(export_time, 6),
                     "kv_bytes": len(payload)},
        )

    def decode(self, received: Received, sampling: Sampling, cancelled) -> Iterator[Event]:
        started = time.perf_counter()
        self._check_fits(len(received.tokens))
        stops = tuple(received.meta.get("stop", ()))
        if received.kind == KIND_LLAMA_SEQ_STATE:
            load_time = self.import_state(received)
            method = "kv_handoff"
            self._evaluated = 0
        elif received.kind == KIND_TOKEN_IDS:  # only ids arrived: recompute the prompt here
            load_time = 0.0
            self._evaluated = 0
            self._evaluate_all_but_last(received.tokens)
            method = "token_ids_recompute"
        else:
            raise FingerprintMismatch(f"this llama.cpp server cannot continue a {received.kind!r} bundle", field="kv")
        yield from self._continue(received.tokens, sampling, stops, cancelled=cancelled, started=started,
                                  extra={"kv_load_time": round(load_time, 6), "method": method})

    def generate(self, prompt: Prompt, sampling: Sampling, cancelled) -> Iterator[Event]:
        started = time.perf_counter()
        tokens, stops = self.tokenize(prompt)
        self._check_fits(len(tokens))
        self._evaluated = 0
        self._evaluate_all_but_last(tokens)
        yield from self._continue(tokens, sampling, stops, cancelled=cancelled, started=started,
                                  extra={"kv_load_time": 0.0, "method": "decode_only"})

    # -- the token loop --------------------------------------------------------------------------

    def _continue(self, tokens, sampling: Sampling, stops, *, cancelled, started, extra):
        """Sample from the state this context holds; ``tokens`` is the whole prompt.

        ``self._evaluated`` must have been zeroed before the prompt work of this
        request began, so that ``prompt_tokens_recomputed`` counts all of it.
        """
        import llama_cpp

        llm = self.llm
        grammar = None
        if sampling.json_schema is not None:
            from llama_cpp.llama_grammar import LlamaGrammar

            try:
                grammar = LlamaGrammar.from_json_schema(json.dumps(sampling.json_schema), verbose=False)
            except Exception as exc:
                raise BadRequest(f"json_schema cannot be turned into a grammar: {exc}", field="json_schema") from None
        if sampling.seed is not None:
            llm.set_seed(sampling.seed)
        stop = tuple(sampling.stop) + tuple(s for s in stops if s not in sampling.stop)
        hold = max((len(s) for s in stop), default=1) - 1
        vocab = llm._model.vocab
        budget = min(sampling.max_new_tokens, self.settings.n_ctx - len(tokens))
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        text, sent, generated, finish, cut_at_stop = "", 0, 0, "length", False
        first_at = None
        t_gen = time.perf_counter()
        for token in llm.generate(tokens, top_k=sampling.top_k, top_p=sampling.top_p, min_p=0.0,
                                  temp=sampling.temperature, repeat_penalty=1.0, grammar=grammar):
            if first_at is None:
                first_at = time.perf_counter()
                prompt_evaluated = self._evaluated
            if llama_cpp.llama_vocab_is_eog(vocab, token):
                finish = "stop"
                break
            generated += 1
            text += decoder.decode(llm.detokenize([token], special=False))
            cut = min((i for i in (text.find(s, max(0, sent - hold)) for s in stop) if i >= 0), default=-1)
            if cut >= 0:
                text, finish, cut_at_stop = text[:cut], "stop", True
                break
            upto = max(sent, len(text) - hold) if stop else len(text)
            yield Event(piece=text[sent:upto])
            sent = upto
            if generated >= budget or cancelled():
                finish = "cancelled" if cancelled() else "length"
                break
        if not cut_at_stop:
            text += decoder.decode(b"", final=True)
        if len(text) > sent:
            yield Event(piece=text[sent:])
        ended = time.perf_counter()
        if first_at is None:
            first_at, prompt_evaluated = ended, self._evaluated
        decode_time = ended - t_gen
        metrics = {
            "prompt_tokens": len(tokens),
            "prompt_tokens_recomputed": prompt_evaluated,
            "completion_tokens": generated,
            "decode_time": round(decode_time, 6),
            "decode_speed": _rate(generated, decode_time),
            "first_token_time": round(first_at - t_gen, 6),
            "backend_time": round(ended - started, 6),
            "finish_reason": finish,
            **extra,
        }
        if extra["method"] != "kv_handoff":  # the prompt was computed here: say how long it took
            metrics["prompt_eval_time"] = round(t_gen - started, 6)
            metrics["prompt_eval_speed"] = _rate(len(tokens), t_gen - started)
        yield Event(metrics=metrics)
