"""A GGUF file's vocabulary for the backends that run its weights elsewhere (MLX, transformers).

llama.cpp reads the file with ``vocab_only`` (no tensors, no download), so these
backends produce exactly the token ids a llama.cpp prefill server produces for the
same prompt, with the GGUF's own chat template; and ``stream_text`` turns the
tokens they sample into text pieces: end-of-generation, stop strings held back
until they can no longer start, cancellation, the token budget.
"""
from __future__ import annotations

import codecs
import time

from .base import Event, Prompt, gguf_prompt_tokens, rate


class GgufVocab:
    def __init__(self, path):
        import llama_cpp
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        self._llama_cpp = llama_cpp
        self.llama = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        self._formatter = None
        template = self.llama.metadata.get("tokenizer.chat_template")
        if template:
            eos, bos = self.llama.token_eos(), self.llama.token_bos()
            self._formatter = Jinja2ChatFormatter(
                template=template,
                eos_token=self.llama._model.token_get_text(eos) if eos != -1 else "",
                bos_token=self.llama._model.token_get_text(bos) if bos != -1 else "",
            )

    def tokenize(self, prompt: Prompt) -> tuple[list[int], tuple]:
        """Token ids of a prompt and the stop strings its chat template adds."""
        return gguf_prompt_tokens(prompt, self._formatter, self.llama.tokenize)

    def is_eog(self, token: int) -> bool:
        return bool(self._llama_cpp.llama_vocab_is_eog(self.llama._model.vocab, token))

    def piece(self, token: int) -> bytes:
        return self.llama.detokenize([token], special=False)

    def close(self) -> None:
        self.llama.close()


def stream_text(vocab: GgufVocab, logits, sample, advance, *, budget: int, stop: tuple, cancelled):
    """Sample up to ``budget`` tokens and yield their text as ``Event(piece=...)``.

    ``sample(logits) -> token id``; ``advance(token) -> logits`` evaluates a sampled token
    (not called after the last). Text that might be the start of a stop string is held back;
    a stop string ends the text before it. Returns ``(generated, finish_reason, first_token_at)``.
    """
    hold = max((len(s) for s in stop), default=1) - 1
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text, sent, generated, finish, cut_at_stop, first_at = "", 0, 0, "length", False, None
    while generated < budget:
        token = sample(logits)
        if first_at is None:
            first_at = time.perf_counter()
        if vocab.is_eog(token):
            finish = "stop"
            break
        generated += 1
        text += decoder.decode(vocab.piece(token))
        cut = min((i for i in (text.find(s, max(0, sent - hold)) for s in stop) if i >= 0), default=-1)
        if cut >= 0:
            text, finish, cut_at_stop = text[:cut], "stop", True
            break
        upto = max(sent, len(text) - hold) if stop else len(text)
        yield Event(piece=text[sent:upto])
        sent = upto
        if cancelled():
            finish = "cancelled"
            break
        if generated < budget:
            logits = advance(token)
    if not cut_at_stop:
        text += decoder.decode(b"", final=True)
    if len(text) > sent:
        yield Event(piece=text[sent:])
    return generated, finish, first_at


def generation_metrics(tokens, prompt_evaluated: int, generated: int, finish: str, *, started: float, t_gen: float,
                       first_at: float | None, extra: dict) -> dict:
    """A generation's closing metrics: ``started`` when the request began, ``t_gen`` when the last prompt
    token's evaluation began, ``first_at`` when the first token was sampled (``stream_text``)."""
    ended = time.perf_counter()
    first_at = first_at or ended
    decode_time = ended - t_gen
    metrics = {
        "prompt_tokens": len(tokens), "prompt_tokens_recomputed": prompt_evaluated,
        "completion_tokens": generated, "decode_time": round(decode_time, 6),
        "decode_speed": rate(generated, decode_time), "first_token_time": round(first_at - t_gen, 6),
        "backend_time": round(ended - started, 6), "finish_reason": finish, **extra,
    }
    if extra["method"] != "kv_handoff":
        metrics["prompt_eval_time"] = round(t_gen - started, 6)
        metrics["prompt_eval_speed"] = rate(len(tokens), t_gen - started)
    return metrics
