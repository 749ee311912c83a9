"""The one narrow interface every backend fills.

Four verbs, each one a backend can honestly answer:

- ``prefill(prompt)``: evaluate the prompt and return what the decode side
  needs to continue it (a ``Prefilled``: token ids, a payload, a fingerprint).
- ``decode(received, sampling)``: continue a prefilled prompt; yields events.
- ``generate(prompt, sampling)``: the whole thing on this machine (fallback).
- ``fingerprint()``: what a bundle from this backend must match to be imported.

Tokenization is part of ``prefill``: Ollama has no public tokenizer endpoint, so
a separate ``tokenize`` verb would be one that backend could not fill.

What a backend hands over is declared by ``handoff_kind``: ``llama_seq_state``
(the KV cache itself moves) or ``token_ids`` (only the ids move and the decode
side recomputes the prompt). Metrics report which one happened.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Iterator


@dataclass(frozen=True)
class ModelSettings:
    backend: str = "llama_cpp"
    model: str = "smollm2"
    name: str = ""  # the public name (config key), e.g. "qwen"
    n_ctx: int = 4096
    n_threads: int | None = None
    n_batch: int = 512
    n_gpu_layers: int = 0
    flash_attn: bool = True
    type_k: str = "f16"
    type_v: str = "f16"
    ollama_host: str | None = None
    ollama_timeout: float = 300.0
    keep_alive: str | int = "30m"
    ollama_options: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict, name: str = "") -> "ModelSettings":
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        known.setdefault("name", name)
        return cls(**known)


@dataclass(frozen=True)
class Prompt:
    """Either ``text`` (rendered as one user turn unless ``raw``) or chat ``messages``."""

    text: str | None = None
    messages: tuple | None = None
    raw: bool = False
    system: str | None = None


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 40
    seed: int | None = None
    stop: tuple = ()
    json_schema: dict | None = None  # constrain the output to this JSON schema


@dataclass
class Prefilled:
    kind: str                  # bundle kind: llama_seq_state or token_ids
    tokens: list               # the prompt's token ids
    payload: object            # buffer to hand over (empty for token_ids)
    fingerprint: dict
    metrics: dict              # prompt_tokens, prefill_time, prefill_speed, ...
    meta: dict = field(default_factory=dict)  # backend-specific extras that travel in the bundle header


def _intact() -> None:
    """A payload that needs no checking (token ids only, or built in this process)."""


@dataclass
class Received:
    """A bundle as the decode side got it (header fields, token ids, payload).

    ``verify()`` returns once the payload is known to be intact and raises
    ``BundleError`` if it is not. A large payload's checksum is still finishing
    when the bundle arrives, alongside the import: a backend imports, then calls
    ``verify()``, and only then generates.
    """

    kind: str
    tokens: list
    payload: object
    fingerprint: dict
    meta: dict = field(default_factory=dict)
    verify: Callable[[], None] = field(default=_intact, repr=False)


@dataclass
class Event:
    """One step of a generation: a text ``piece``, or the final ``metrics``."""

    piece: str | None = None
    metrics: dict | None = None

    @property
    def done(self) -> bool:
        return self.metrics is not None


Cancelled = Callable[[], bool]


class Backend(abc.ABC):
    name: ClassVar[str]
    handoff_kind: ClassVar[str]
    # bundle kinds decode() can continue from
    accepts: ClassVar[tuple] = ()

    def __init__(self, settings: ModelSettings):
        self.settings = settings

    @abc.abstractmethod
    def load(self, progress: Callable[[str], None] = lambda message: None) -> None:
        """Load the model (may take minutes); report progress as short messages."""

    @abc.abstractmethod
    def fingerprint(self) -> dict:
        """What produced this backend's bundles; a decode side refuses any mismatch."""

    @abc.abstractmethod
    def prefill(self, prompt: Prompt) -> Prefilled:
        ...

    @abc.abstractmethod
    def decode(self, received: Received, sampling: Sampling, cancelled: Cancelled) -> Iterator[Event]:
        ...

    @abc.abstractmethod
    def generate(self, prompt: Prompt, sampling: Sampling, cancelled: Cancelled) -> Iterator[Event]:
        ...

    def describe(self) -> dict:
        """Extra facts for /health (model file, context size, daemon state...).

        ``"ready": False`` in the answer marks the server degraded (503) although the
        model loaded once, e.g. when the daemon behind it stopped answering.
        """
        return {}

    def close(self) -> None:
        """Free the model."""
