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

from ..kv.canary import CanaryPolicy
from ..kv.receive import Received  # noqa: F401  (part of the interface: what decode() gets)


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
    parallel: int = 4  # requests served at once (llama.cpp: sequences of one context, each its own KV stream)
    prefix_cache: bool = True  # llama.cpp: a free slot keeps its last prompt's KV for a prompt that starts the same
    type_k: str = "f16"
    type_v: str = "f16"
    ollama_host: str | None = None
    ollama_timeout: float = 300.0
    keep_alive: str | int = "30m"
    ollama_options: dict = field(default_factory=dict)
    device: str = "auto"  # transformers: auto (CUDA when torch sees it, else cpu) | cpu | cuda | cuda:N | mps

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
    # never end at an end-of-generation token: exactly max_new_tokens (or a stop string), for
    # benchmarks, as llama.cpp's server and vLLM offer; backends without it refuse the request
    ignore_eos: bool = False


@dataclass
class Prefilled:
    kind: str                  # bundle kind: llama_seq_state or token_ids
    tokens: list               # the prompt's token ids
    payload: object            # buffer to hand over (empty for token_ids)
    fingerprint: dict
    metrics: dict              # prompt_tokens, prefill_time, prefill_speed, ...
    meta: dict = field(default_factory=dict)  # backend-specific extras that travel in the bundle header


@dataclass
class Event:
    """One step of a generation: a text ``piece``, or the final ``metrics``."""

    piece: str | None = None
    metrics: dict | None = None

    @property
    def done(self) -> bool:
        return self.metrics is not None


Cancelled = Callable[[], bool]


@dataclass(eq=False)
class Eval:
    """What a batched backend's request asks of the model's owner thread: evaluate ``tokens`` of
    sequence ``seq`` from position ``pos`` (the logits of the last one wanted when ``logits``).

    The owner gathers the ``Eval`` of every active request into one batch per step
    and hands the generator back its ``Eval`` once all of its tokens are in: then
    ``row`` is the batch row holding the last token's logits, valid until the next
    step. A long prompt is evaluated ``done`` tokens at a time, across steps.
    """

    seq: int
    tokens: list
    pos: int
    logits: bool = True
    done: int = 0
    row: int = -1
    alone: bool = False  # its last step evaluated no other sequence (batching moves logits)

    @property
    def complete(self) -> bool:
        return self.done >= len(self.tokens)


@dataclass(eq=False)
class Wait:
    """What a batched backend's request yields when it cannot go on until something outside the model
    happens (the next pieces of a streamed KV bundle): the owner parks it, evaluating the others, and
    advances it again once ``ready()`` is true (checked after each step and whenever the owner is woken:
    ``ModelOwner.wake``)."""

    ready: Callable[[], bool]


def rate(n, seconds: float):
    """Tokens per second, rounded; None when there is nothing to divide."""
    return round(n / seconds, 2) if n and seconds > 0 else None


def check_fits(n_prompt: int, n_ctx: int, what: str = "this server's context") -> None:
    """Refuse an empty prompt (400) or one that leaves no room in a context of ``n_ctx`` tokens."""
    from ..errors import BadRequest, ContextOverflow

    if n_prompt < 1:
        raise BadRequest("the prompt has no tokens", field="prompt")
    if n_prompt >= n_ctx:
        raise ContextOverflow(f"prompt has {n_prompt} tokens; {what} holds {n_ctx}", field="prompt")


def gguf_prompt_tokens(prompt: Prompt, formatter, tokenize) -> tuple[list[int], tuple]:
    """Token ids of a prompt and the stop strings its chat template adds, for the backends that read a
    GGUF's vocabulary: ``formatter`` is its chat template (llama-cpp-python's ``Jinja2ChatFormatter``,
    or None when it has none), ``tokenize(data: bytes, add_bos, special)`` its tokenizer."""
    from ..errors import BadRequest

    if prompt.raw or (formatter is None and prompt.messages is None):
        text = prompt.text if prompt.system is None else f"{prompt.system}\n\n{prompt.text}"
        return tokenize(text.encode("utf-8"), add_bos=True, special=False), ()
    if formatter is None:
        raise BadRequest("this model has no chat template; send 'prompt' with 'raw': true", field="messages")
    messages = list(prompt.messages or ({"role": "user", "content": prompt.text},))
    if prompt.system:
        messages.insert(0, {"role": "system", "content": prompt.system})
    try:
        rendered = formatter(messages=messages)
    except Exception as exc:  # the template's own raise_exception, or a jinja error
        raise BadRequest(f"chat template rejected the messages: {exc}", field="messages") from None
    tokens = tokenize(rendered.prompt.encode("utf-8"), add_bos=not rendered.added_special, special=True)
    return tokens, tuple(s for s in rendered.stop if s)


class Backend(abc.ABC):
    name: ClassVar[str]
    handoff_kind: ClassVar[str]
    # bundle kinds decode() can continue from
    accepts: ClassVar[tuple] = ()
    # batched backends' prefill/decode/generate are generators that yield Eval requests, and
    # evaluate() runs one step of them; the others run each request to its end on a thread
    batched: ClassVar[bool] = False
    # backends that see next-token logits make a canary on prefill and check it on decode
    # (kv/canary.py); the server sets its policy from its settings. The others report
    # ``canary: "unavailable"`` in their decode metrics.
    canary: CanaryPolicy = CanaryPolicy()
    # whether ``Sampling.ignore_eos`` is honoured (the server refuses it where it is not)
    ignores_eos: ClassVar[bool] = False

    @property
    def engine(self) -> str:
        """This backend on this kind of device, as canary tolerances name it (``llama_cpp/cpu``)."""
        return f"{self.name}/cpu"

    @property
    def slots(self) -> int:
        """How many requests this backend serves at once (``parallel`` in the config)."""
        return max(1, self.settings.parallel)

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

    def receive_room(self) -> tuple[int, int]:
        """Spare bytes (before, after) a received payload should have around it (see kv/buffers.with_room)."""
        return (0, 0)

    def describe(self) -> dict:
        """Extra facts for /health (model file, context size, daemon state...).

        ``"ready": False`` in the answer marks the server degraded (503) although the
        model loaded once, e.g. when the daemon behind it stopped answering.
        """
        return {}

    def close(self) -> None:
        """Free the model."""

    def served_model(self) -> str:
        """The served model's own name, as /health reports it: ``ollama:qwen3-coder:30b`` serves
        ``qwen3-coder:30b``, a GGUF path its file name, a built-in name itself (not the config key)."""
        model = self.settings.model
        if model.startswith("ollama:"):
            return model[len("ollama:"):]
        return model.replace("\\", "/").rsplit("/", 1)[-1] if model.lower().endswith(".gguf") else model
