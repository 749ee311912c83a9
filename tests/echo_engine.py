"""A toy engine from outside the package, written as docs/ARCHITECTURE.md ("Adding an engine") says.

It says the prompt back, each word ``repeat`` times (its one option), with no
model: its tokens are the prompt's UTF-8 bytes, and what a prefill hands over
is those ids (``token_ids``), so the decode side continues from them as it
would from any engine's. Importing the module registers it as ``echo``; a
process learns of it from ``DISAGG_PLUGINS=tests.echo_engine``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from disaggregated_inference.backends import Backend, Event, ModelSettings, Prefilled, option, register
from disaggregated_inference.kv.bundle import KIND_TOKEN_IDS
from disaggregated_inference.metrics import ServerFigures


@dataclass(frozen=True)
class EchoSettings(ModelSettings):
    repeat: int = option(1, "how many times each word of the prompt is said back", low=1)


class EchoBackend(Backend):
    name = "echo"
    handoff_kind = KIND_TOKEN_IDS
    accepts = (KIND_TOKEN_IDS,)
    Settings = EchoSettings

    def load(self, progress=lambda message: None) -> None:
        progress("an echo has nothing to load")

    def fingerprint(self) -> dict:
        return {"backend": self.name, "n_vocab": 256}  # ids are bytes: the decode server refuses larger ones

    def describe(self) -> dict:
        return {"repeat": self.settings.repeat}

    def prefill(self, prompt) -> Prefilled:
        tokens = list(_text(prompt).encode())
        return Prefilled(kind=KIND_TOKEN_IDS, tokens=tokens, payload=b"", fingerprint=self.fingerprint(),
                         metrics=ServerFigures(prompt_tokens=len(tokens), prompt_tokens_evaluated=len(tokens),
                                               prefill_time=0.0))

    def decode(self, received, sampling, cancelled):
        received.verify()
        yield from self._echo(bytes(received.tokens).decode(), sampling, cancelled, "token_ids_recompute")

    def generate(self, prompt, sampling, cancelled):
        yield from self._echo(_text(prompt), sampling, cancelled, "decode_only")

    def _echo(self, text: str, sampling, cancelled, method: str):
        started = time.perf_counter()
        said = [word for word in text.split() for _ in range(self.settings.repeat)]
        words = said[:sampling.max_new_tokens]
        for i, word in enumerate(words):
            if cancelled():
                break
            yield Event(piece=word if i == 0 else f" {word}")
        yield Event(metrics=ServerFigures(method=method, prompt_tokens=len(text.encode()), completion_tokens=len(words),
                                          decode_time=round(time.perf_counter() - started, 6),
                                          finish_reason="length" if len(words) < len(said) else "stop"))


def _text(prompt) -> str:
    if prompt.messages is not None:
        return " ".join(str(m.get("content", "")) for m in prompt.messages)
    return prompt.text


register("echo", EchoBackend)
