"""The one narrow interface every backend fills.

Four verbs, each one a backend can honestly answer:

- ``prefill(prompt)``: evaluate the prompt and return what the decode side
  needs to continue it (a ``Prefilled``: token ids, a payload, a fingerprint).
- ``decode(received, sampling)``: continue a prefilled prompt; yields events.
- ``generate(prompt, sampling)``: the whole thing on this machine (fallback).
- ``fingerprint()``: what a bundle from this backend must match to be imported.

``tokenize(prompt)`` gives a prompt's token ids where the engine has its own
tokenizer (llama.cpp, and MLX and transformers through the GGUF's vocabulary):
the server calls it on the request's own thread, before the request waits for
the model, and passes the ids back in ``prompt.tokens``, so that rendering the
chat template and tokenizing, work that a prompt's size decides, never holds the
model's thread. Ollama has no public tokenizer endpoint: its ``tokenize`` answers
None and its verbs take the prompt's text, as every verb also does when called
with an untokenized prompt (tests, tools).

What a backend hands over is declared by ``handoff_kind``: ``llama_seq_state``
(the KV cache itself moves), ``neutral_kv`` (the K/V arrays in an engine-neutral
layout, kv/neutral.py) or ``token_ids`` (only the ids move and the decode side
recomputes the prompt). Metrics report which one happened.

An engine's settings are its ``Settings`` class: ``ModelSettings`` (what every
engine shares) extended with the engine's own options (options.py).
``ModelSettings(backend=NAME, ...)`` makes the settings of the engine registered
as NAME, so one call takes any engine's options.

A backend that batches (llama.cpp) is a ``BatchedBackend``: the server's owner
thread drives its requests as generators and steps them together (``evaluate``).

Engines that render chat prompts themselves from a GGUF (llama.cpp, MLX,
transformers) read them and their answers through the model's chat format
(``chat/``): their settings are ``ChatSettings`` (the ``chat_format`` option),
and a generation yields the answer, the reasoning and the tool calls as
separate ``Event``s.
"""
from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Iterator

from ..metrics import ServerFigures
from .. import chat
from ..kv.canary import CanaryPolicy
from ..kv.receive import Received  # noqa: F401  (part of the interface: what decode() gets)
from . import registry
from .options import option

DEFAULT_BACKEND = "llama_cpp"


@dataclass(frozen=True)
class ModelSettings:
    """The settings every engine shares; an engine's ``Settings`` subclass adds its own options.

    ``ModelSettings(backend=NAME, **options)`` makes an instance of the ``Settings`` of the engine
    registered as NAME (plain ``ModelSettings`` for a name no engine is registered under), so
    an option of that engine is an attribute like the shared ones: ``settings.flash_attn``.
    """

    backend: str = option(DEFAULT_BACKEND, "the engine: llama_cpp, ollama, mlx, transformers, vllm or a plugin's "
                                                  "name")
    model: str = option("smollm2", "what the engine loads: smollm2, gemma3-270m, a GGUF path, ollama:NAME (a GGUF "
                                   "Ollama pulled), or the model name the ollama backend asks its daemon for")
    name: str = ""  # the public name (the config's key), e.g. "qwen"; no option: the config sets it
    n_ctx: int = option(4096, "context tokens per request", low=1)
    n_threads: int | None = option(None, "CPU threads the engine computes with (unset: its own default; engines "
                                         "that compute elsewhere ignore it)", low=1)
    parallel: int = option(4, "requests served at once (llama.cpp: slots batched together each step; vLLM: its "
                              "max_num_seqs; Ollama: requests in flight; mlx and transformers serve one at a time)",
                           low=1)

    def __new__(cls, *args, **kwargs):
        if cls is ModelSettings:
            cls = settings_class(kwargs.get("backend", args[0] if args else DEFAULT_BACKEND))
        return object.__new__(cls)

    def __getnewargs_ex__(self):  # a copy or an unpickled one is of the same engine's class
        return (), {"backend": self.backend}

    @classmethod
    def from_dict(cls, data: dict, name: str = "") -> "ModelSettings":
        """The settings of a config entry: the keys its engine takes (others, such as ``aliases``, are left)."""
        settings_cls = settings_class(data.get("backend", DEFAULT_BACKEND))
        known = {k: v for k, v in data.items() if k in settings_cls.__dataclass_fields__}
        known.setdefault("name", name)
        return settings_cls(**known)


@dataclass(frozen=True)
class ChatSettings(ModelSettings):
    """The settings of an engine that renders chat prompts itself and reads its answers by the chat format."""

    chat_format: str = option("auto", "how conversations are written and answers read (chat/): auto (harmony for "
                                      "gpt-oss, qwen3_coder for a template with Qwen3-Coder's tool calls, else "
                                      "template), harmony, qwen3_coder or template", choices=chat.FORMAT_NAMES)


def settings_class(backend: str) -> type:
    """The settings class of the engine registered as ``backend``; ``ModelSettings`` for an unregistered name."""
    return registry.backend_class(backend).Settings if registry.is_registered(backend) else ModelSettings


@dataclass(frozen=True)
class Prompt:
    """Either ``text`` (rendered as one user turn unless ``raw``) or chat ``messages`` (chat/conversation.py's
    shapes); the ``tools`` offered and the ``reasoning_effort`` asked for are rendered with them. With
    ``tokens`` once the server has tokenized it (``Backend.tokenize``: the ids and the stop strings its chat
    format adds, ``stops``)."""

    text: str | None = None
    messages: tuple | None = None
    raw: bool = False
    system: str | None = None
    tools: chat.Tools | None = None
    reasoning_effort: str | None = None  # low, medium or high: for formats with a reasoning channel
    tokens: tuple | None = None
    stops: tuple = ()


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
    tools: chat.Tools | None = None     # what the answer may call (parsed out of it; a grammar where needed)
    reasoning_budget: int | None = None  # reasoning tokens before the model is moved on to its answer
    # speculative decoding for this request: "off" or a proposer (None: the model's setting); engines
    # without it ignore it
    speculation: str | None = None


@dataclass
class Prefilled:
    kind: str                  # bundle kind: llama_seq_state or token_ids
    tokens: list               # the prompt's token ids
    payload: object            # buffer to hand over (empty for token_ids)
    fingerprint: dict
    metrics: ServerFigures     # prompt_tokens, prefill_time, prefill_speed, ...
    meta: dict = field(default_factory=dict)  # backend-specific extras that travel in the bundle header


@dataclass
class Event:
    """One step of a generation: a ``piece`` of the answer, of the ``reasoning``, a ``tool_call``
    (``{"name", "arguments"}``, the arguments as JSON text), or the final ``metrics``."""

    piece: str | None = None
    metrics: ServerFigures | None = None
    reasoning: str | None = None
    tool_call: dict | None = None

    @classmethod
    def of(cls, part: "chat.Part") -> "Event":
        """The event of a chat format's output part."""
        if part.kind == chat.REASONING:
            return cls(reasoning=part.value)
        if part.kind == chat.TOOL_CALL:
            return cls(tool_call=part.value.as_dict())
        return cls(piece=part.value)

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

    A speculative step (``draft_acceptance`` set: backends/speculate.py) evaluates a token and
    guesses after it: ``tokens[1:]`` are the guesses, each accepted with about that probability.
    It is evaluated whole in one step with logits on every row (``row_of``); the backend may cut
    guesses from its end first (when they cost the step more than they are likely to save).
    """

    seq: int
    tokens: list
    pos: int
    logits: bool = True
    done: int = 0
    row: int = -1
    alone: bool = False  # its last step evaluated no other sequence (batching moves logits)
    draft_acceptance: float | None = None
    left: int | None = None  # tokens the answer may still have (its budget left); None: not an answer's step

    @property
    def complete(self) -> bool:
        return self.done >= len(self.tokens)

    def row_of(self, i: int) -> int:
        """The batch row of ``tokens[i]``'s logits (a speculative step, once complete)."""
        return self.row - (len(self.tokens) - 1 - i)


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


def check_fits(n_prompt: int, n_ctx: int, what: str = "this server's context", field: str = "prompt") -> None:
    """Refuse an empty prompt (400) or one that leaves no room in a context of ``n_ctx`` tokens."""
    from ..errors import BadRequest, ContextOverflow

    if n_prompt < 1:
        raise BadRequest("the prompt has no tokens", field=field)
    if n_prompt >= n_ctx:
        raise ContextOverflow(f"prompt has {n_prompt} tokens; {what} holds {n_ctx}", field=field)


def check_bound(data: bytes, field: str, n_ctx: int | None, longest_token: int) -> None:
    """Refuse (400 ``context_overflow``) text that cannot fit a context of ``n_ctx`` tokens whatever its
    tokenization: no token covers more than ``longest_token`` bytes, so ``data`` needs at least
    len / longest tokens. Cheap, and before the tokenizer, whose time grows faster than the text (20,000
    chat turns took 28 s there; their 580 KB are 7,000 tokens at least, by this bound)."""
    from ..errors import ContextOverflow

    if not n_ctx or longest_token <= 0:
        return
    least = -(-len(data) // longest_token)
    if least >= n_ctx:
        raise ContextOverflow(f"'{field}' is {len(data)} bytes as the model reads it: at least {least} tokens "
                              f"(no token of this model covers more than {longest_token} bytes), and this server's "
                              f"context holds {n_ctx}", field=field)


def gguf_prompt_tokens(prompt: Prompt, chat_format, tokenize, n_ctx: int | None = None,
                       longest_token: int = 0) -> tuple[list[int], tuple, str]:
    """Token ids of a prompt, the stop strings its chat template adds, and the name of the chat format that
    rendered it (``raw`` for a prompt sent as written), for the backends that read a GGUF's vocabulary:
    ``chat_format`` is the model's (chat/, or None when it has none), ``tokenize(data: bytes, add_bos,
    special)`` its tokenizer. A prompt already tokenized (``prompt.tokens``) is given back as it is. With
    ``n_ctx`` and ``longest_token`` (the most bytes one token covers), text that cannot fit is refused
    before it is tokenized (``check_bound``)."""
    from ..errors import BadRequest

    as_written = prompt.raw or (chat_format is None and prompt.messages is None)
    if prompt.tokens is not None:
        return list(prompt.tokens), tuple(prompt.stops), chat.RAW.name if as_written else chat_format.name
    if as_written:
        if prompt.tools is not None:
            raise BadRequest("'tools' need a chat prompt: send 'messages' (or a prompt that is not raw)",
                             field="tools")
        text = prompt.text if prompt.system is None else f"{prompt.system}\n\n{prompt.text}"
        data = text.encode("utf-8")
        check_bound(data, "prompt", n_ctx, longest_token)
        return tokenize(data, add_bos=True, special=False), (), chat.RAW.name
    if chat_format is None:
        raise BadRequest("this model has no chat template; send 'prompt' with 'raw': true", field="messages")
    messages = list(prompt.messages or ({"role": "user", "content": prompt.text},))
    if prompt.system:
        messages.insert(0, {"role": "system", "content": prompt.system})
    rendered = chat_format.render(messages, tools=prompt.tools, reasoning_effort=prompt.reasoning_effort)
    data = rendered.text.encode("utf-8")
    check_bound(data, "messages" if prompt.messages is not None else "prompt", n_ctx, longest_token)
    tokens = tokenize(data, add_bos=rendered.add_bos, special=True)
    return tokens, rendered.stops, chat_format.name


class Backend(abc.ABC):
    """An engine: what the prefill and decode servers call, and nothing else.

    The server's owner thread (server/owner.py) calls ``load`` once, then runs each
    request's ``prefill``/``decode``/``generate`` on one of ``slots`` worker threads
    (a ``BatchedBackend`` steps them on the owner thread instead), and ``close`` at
    the end. HTTP threads call only what answers from memory: ``fingerprint``,
    ``describe``, ``served_model``, ``receive_room``, ``convert`` and ``tokenize``.
    """

    name: ClassVar[str]
    handoff_kind: ClassVar[str]
    # bundle kinds decode() can continue from
    accepts: ClassVar[tuple] = ()
    # the engine's settings: ModelSettings, or a subclass declaring the engine's own options
    Settings: ClassVar[type] = ModelSettings
    # True for a BatchedBackend: its requests are generators stepped together by ``evaluate``
    batched: ClassVar[bool] = False
    # backends that see next-token logits make a canary on prefill and check it on decode
    # (kv/canary.py); the server sets its policy from its settings. The others report
    # ``canary: "unavailable"`` in their decode metrics.
    canary: CanaryPolicy = CanaryPolicy()
    # whether ``Sampling.ignore_eos`` is honoured (the server refuses it where it is not)
    ignores_eos: ClassVar[bool] = False
    # the overlapped handoff (kv/stream.py): None or ``{"enabled": False, "reason": ...}`` where ``prefill``
    # hands the KV over whole; ``{"enabled": True}`` where ``prefill(prompt, kv_stream=sink)`` hands it to the
    # sink piece by piece as it is evaluated; ``{"enabled": None}`` until ``probe_kv_streaming()`` (run on the
    # model's thread at the first streamed request) has found out
    kv_streaming: dict | None = None
    # bundle kinds decode() takes while a streamed bundle still arrives (``received.incoming`` set: it imports
    # the pieces as they land, yielding ``Wait`` in between; BatchedBackend only); any other kind is pulled whole
    # first
    imports_streamed: ClassVar[tuple] = ()

    def __init__(self, settings: ModelSettings):
        self.settings = settings

    @classmethod
    def compute_threads(cls, settings: ModelSettings) -> int:
        """CPU threads a server of this engine computes with on an OpenMP team, whose wait policy the
        launcher sets (``server.openmp_wait``); 0 for an engine whose work runs elsewhere."""
        return 0

    @property
    def engine(self) -> str:
        """This backend on this kind of device, as canary tolerances name it (``llama_cpp/cpu``)."""
        return f"{self.name}/cpu"

    @property
    def slots(self) -> int:
        """How many requests this backend serves at once (``parallel`` in the config)."""
        return max(1, self.settings.parallel)

    @abc.abstractmethod
    def load(self, progress: Callable[[str], None] = lambda message: None) -> None:
        """Load the model (may take minutes); report progress as short messages."""

    @abc.abstractmethod
    def fingerprint(self) -> dict:
        """What produced this backend's bundles; a decode side refuses any mismatch."""

    @abc.abstractmethod
    def prefill(self, prompt: Prompt, kv_stream=None) -> Prefilled:
        """Evaluate the prompt (all of it, or all but its last token, which decode then evaluates); with
        ``kv_stream`` (given only where ``kv_streaming`` is enabled) hand its KV to that sink as it is made."""

    @abc.abstractmethod
    def decode(self, received: Received, sampling: Sampling, cancelled: Cancelled) -> Iterator[Event]:
        """Continue a prefilled prompt: text pieces, then the metrics. ``received.verify()`` is called
        after the import and before the first piece (the checksum may still be running)."""

    @abc.abstractmethod
    def generate(self, prompt: Prompt, sampling: Sampling, cancelled: Cancelled) -> Iterator[Event]:
        """The whole request on this machine (the decode-only path and the fallback)."""

    def tokenize(self, prompt: Prompt) -> tuple[list[int], tuple] | None:
        """The prompt's token ids and the stop strings its chat template adds (a prompt already tokenized:
        its own), or None for an engine that tokenizes behind its own API (the default).

        Called on a request's HTTP thread, beside the model's work on the owner thread: it must only read
        the vocabulary and the template (llama.cpp's tokenizer does; its own server tokenizes on its HTTP
        threads too). A prompt that cannot fit ``n_ctx`` by a bound cheaper than tokenizing it should be
        refused before tokenizing (``check_bound``): the tokenizer's time grows with the text."""
        return None

    def convert(self, prefilled: Prefilled, kind: str) -> Prefilled | None:
        """``prefilled`` as the bundle kind ``kind`` a decode side asked for (``kv_kind``), or None when
        this engine cannot make it. Runs on the request's HTTP thread, after ``prefill``."""
        return None

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


class BatchedBackend(Backend):
    """A backend whose requests the owner thread steps together (continuous batching).

    ``prefill``, ``decode`` and ``generate`` are generators that yield ``Eval``
    requests (and, for decode and generate, ``Event``s); ``prefill`` returns its
    ``Prefilled`` as the generator's value. Each step the owner gathers the
    pending ``Eval`` of every active request and calls ``evaluate`` once with all
    of them; a request is sent its ``Eval`` back once all of its tokens are in.
    A request may yield a ``Wait`` instead (a streamed KV bundle's next pieces):
    it is parked, the others going on, until the ``Wait`` is ready.
    Requests join and leave between steps; a request's generator is closed when
    it is cancelled, and its cleanup must free whatever it held (its sequence).
    At most ``slots`` requests are active at once.
    """

    batched: ClassVar[bool] = True

    @abc.abstractmethod
    def evaluate(self, evals: list[Eval], waiting: int = 0) -> int:
        """One step over the pending requests: evaluate as many of each ``Eval``'s remaining tokens as
        the batch holds (advancing ``done``), give each completed one its ``row`` (where its last
        token's logits are, valid until the next step) and ``alone``; return the tokens evaluated.
        ``waiting``: requests waiting for a slot. An exception fails every request of the step; the
        others go on."""

    def calibrate(self, interrupted: Callable[[], bool] = lambda: False) -> bool:
        """Measure again what the backend measured at load beside other work (a step's cost, for speculation).
        The owner calls it while the server and the other servers on its cores are idle; ``interrupted()``
        turns true once a request comes (stop, keep nothing). True while the backend wants more calls."""
        return False

    def run(self, request):
        """Drive one request generator (``prefill``/``decode``/``generate``) to its end on the calling
        thread, alone in every batch (tests, benchmarks, tools; a ``Wait`` polled until it is ready);
        returns (the events it yielded, its return value)."""
        events = []
        try:
            while True:
                item = next(request)
                if isinstance(item, Eval):
                    while not item.complete:
                        self.evaluate([item])
                elif isinstance(item, Wait):
                    while not item.ready():
                        time.sleep(0.001)
                else:
                    events.append(item)
        except StopIteration as stop:
            return events, stop.value
