"""One request to generate, in one frozen type, and the checks every server makes of it.

``GenerationRequest`` is what a caller asks the cluster for: the gateway builds it
from the OpenAI and Ollama APIs (gateway/parse.py), ``DisaggregatedClient.generate``
and ``stream`` take it (or build it from their keyword arguments), and it turns
itself into the bodies of the servers' API (``prefill_body``, ``decode_body``,
``generate_body``). ``check`` refuses what every server would refuse, as the servers'
parser does (``parse_prompt``, ``parse_sampling``, with the cluster's ``Limits``),
before any server is chosen.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from . import chat
from .backends.base import Prompt, Sampling
from .backends.speculate import PROPOSERS, requested_proposer
from .errors import BadRequest, PayloadTooLarge
from .fields import number, stop_sequences, typed
from .http import check_text

MAX_STOP_SEQUENCES = 16
MAX_SCHEMA_DEPTH = 32  # nesting of a json_schema: grammar compile time grows with it


@dataclass(frozen=True)
class Limits:
    """Sizes a request may not exceed (``ServerOptions``: max_prompt_chars, max_schema_bytes)."""

    prompt_chars: int = 1 << 20
    schema_bytes: int = 64 << 10
    schema_depth: int = MAX_SCHEMA_DEPTH


DEFAULT_LIMITS = Limits()


def _message_chars(m: dict) -> int:
    calls = m.get("tool_calls", ())
    return (len(m["content"]) + len(m["role"]) + len(m.get("reasoning", ""))
            + sum(len(c["name"]) + len(json.dumps(c["arguments"])) for c in calls))


def check_prompt_size(prompt, limits: Limits) -> None:
    """The prompt's characters (text or messages' contents, plus system and tools) against the limit, before any
    work."""
    if prompt.text is not None:
        field, size = "prompt", len(prompt.text)
    else:
        field, size = "messages", sum(_message_chars(m) for m in prompt.messages)
    size += len(prompt.system or "")
    if prompt.tools is not None:
        size += len(json.dumps(prompt.tools.as_openai()))
    if size > limits.prompt_chars:
        raise PayloadTooLarge(f"'{field}' has {size} characters (with 'system'); this server takes at most "
                              f"{limits.prompt_chars}", field=field)


def _depth(value, limit: int, level: int = 1) -> int:
    if level > limit:
        return level
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return max((_depth(c, limit, level + 1) for c in children), default=level)


def check_schema(schema: dict, field: str, limits: Limits) -> None:
    size = len(json.dumps(schema, separators=(",", ":")))
    if size > limits.schema_bytes:
        raise PayloadTooLarge(f"'{field}' is {size} bytes as JSON; this server takes at most {limits.schema_bytes}",
                              field=field)
    if _depth(schema, limits.schema_depth) > limits.schema_depth:
        raise BadRequest(f"'{field}' is nested deeper than {limits.schema_depth} levels", field=field)



def parse_prompt(body: dict, limits: Limits = DEFAULT_LIMITS) -> Prompt:
    """The prompt part of a body: ``prompt`` or ``messages``, ``raw``, ``system``, the tools offered, the
    reasoning effort."""
    text = body.get("prompt")
    messages = body.get("messages")
    if text is None and messages is None:
        raise BadRequest("one of 'prompt' or 'messages' is required", field="prompt")
    if text is not None and messages is not None:
        raise BadRequest("give 'prompt' or 'messages', not both", field="messages")
    if text is not None and (not isinstance(text, str) or not text):
        raise BadRequest("'prompt' must be a non-empty string", field="prompt")
    if messages is not None:
        messages = chat.parse_messages(messages)  # roles, contents, tool calls and results; valid text
    raw = typed(body, "raw", bool, False, what="a boolean")
    if raw and messages is not None:
        raise BadRequest("'raw' applies to 'prompt' only; 'messages' are always rendered with the chat template",
                         field="raw")
    system = typed(body, "system", str, None, what="a string")
    if text is not None:
        check_text(text, "prompt")
    if system is not None:
        check_text(system, "system")
    tools = chat.parse_tools(body.get("tools"), body.get("tool_choice"))
    prompt = Prompt(text=text, messages=messages, raw=raw, system=system, tools=tools,
                    reasoning_effort=chat.parse_effort(body.get("reasoning_effort")))
    check_prompt_size(prompt, limits)
    return prompt


def parse_sampling(body: dict, limits: Limits = DEFAULT_LIMITS) -> Sampling:
    """The sampling part of a body in the servers' own spelling (``max_new_tokens``, ``json_schema``: the
    design documents' ``max_tokens`` and ``format`` are read by server/parse.py's adapter)."""
    max_new = number(body, "max_new_tokens", 256, 1, 1 << 20, integer=True)
    stop = stop_sequences(body.get("stop") or None, "stop")
    if len(stop) > MAX_STOP_SEQUENCES:
        raise BadRequest(f"'stop' has more than {MAX_STOP_SEQUENCES} sequences", field="stop")
    schema = body.get("json_schema")
    if schema is not None and not isinstance(schema, dict):
        raise BadRequest("'json_schema' must be a JSON schema object", field="json_schema")
    if schema is not None:
        check_schema(schema, "json_schema", limits)
        if body.get("ignore_eos") is True:  # a grammar ends the output with an end-of-generation token
            raise BadRequest("'ignore_eos' cannot be combined with a JSON schema", field="ignore_eos")
    for i, seq in enumerate(stop):
        check_text(seq, "stop")
    speculation = requested_proposer(typed(body, "speculation", str, None,
                                              what=f"one of {', '.join(PROPOSERS)}"))
    tools = chat.parse_tools(body.get("tools"), body.get("tool_choice"))
    if tools is not None:
        check_schema({"tools": tools.as_openai()}, "tools", limits)
    return Sampling(
        max_new_tokens=max_new,
        temperature=float(number(body, "temperature", 0.0, 0.0, 5.0)),
        top_p=float(number(body, "top_p", 1.0, 0.0, 1.0)),
        top_k=number(body, "top_k", 40, 0, 1 << 20, integer=True),
        seed=number(body, "seed", None, -(1 << 31), (1 << 32) - 1, integer=True),
        stop=tuple(stop),
        json_schema=schema,
        ignore_eos=typed(body, "ignore_eos", bool, False, what="a boolean"),
        tools=tools,
        reasoning_budget=number(body, "reasoning_budget", None, 0, 1 << 20, integer=True),
        speculation=speculation,
    )


@dataclass(frozen=True)
class GenerationRequest:
    """One request to generate, as ``DisaggregatedClient.generate`` takes it (its keyword arguments, one
    field each). ``tools`` and ``tool_choice`` go to both sides: the prompt renders them, the decode side
    reads the calls."""

    model: str
    prompt: str | None = None
    messages: tuple | None = None
    system: str | None = None
    raw: bool = False
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: tuple = ()
    json_schema: dict | None = None
    tools: tuple | None = None       # functions, in the OpenAI API's shape
    tool_choice: object = None       # auto, none, required, or {"type": "function", "function": {"name": ...}}
    reasoning_effort: str | None = None
    reasoning_budget: int | None = None
    ignore_eos: bool = False         # exactly max_tokens (llama.cpp decode servers; others answer 400)
    speculation: str | None = None   # the decode server's proposer for this request (off, ngram)

    @classmethod
    def of(cls, model: str, prompt: str | None = None, max_tokens: int = 256, temperature: float = 0.0, *,
           messages=None, stop=None, tools=None, **fields) -> GenerationRequest:
        """From ``generate``'s keyword arguments (``stop`` a string or a list, ``messages`` and ``tools``
        lists)."""
        if (prompt is None) == (messages is None):
            raise BadRequest("give prompt or messages", field="prompt")
        if isinstance(stop, str):
            stop = (stop,)
        return cls(model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                   messages=tuple(messages) if isinstance(messages, list) else messages,
                   stop=tuple(stop) if isinstance(stop, (list, tuple)) else stop or (),
                   tools=tuple(tools) if isinstance(tools, list) else tools, **fields)

    def prompt_body(self) -> dict:
        """The prompt part (for /prefill and /generate)."""
        body = {"messages": [dict(m) if isinstance(m, dict) else m for m in self.messages]} \
            if self.messages is not None else {"prompt": self.prompt}
        if self.raw:
            body["raw"] = True
        if self.system is not None:
            body["system"] = self.system
        if self.reasoning_effort is not None:
            body["reasoning_effort"] = self.reasoning_effort
        self._tools_into(body)
        return body

    def sampling_body(self) -> dict:
        """The sampling part (for /decode and /generate)."""
        body = {"max_new_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p}
        for key in ("top_k", "seed"):
            if getattr(self, key) is not None:
                body[key] = getattr(self, key)
        if self.stop:
            body["stop"] = list(self.stop)
        for key in ("json_schema", "speculation", "reasoning_budget"):
            if getattr(self, key) is not None:
                body[key] = getattr(self, key)
        self._tools_into(body)
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body

    def _tools_into(self, body: dict) -> None:
        if self.tools is not None:
            body["tools"] = list(self.tools)
        if self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice

    def prefill_body(self, **handoff) -> dict:
        """A /prefill body (``handoff``: ``kv_kind``, ``handoff_mode`` as the client asks for them)."""
        return {**self.prompt_body(), **handoff}

    def decode_body(self, kv: dict, **extra) -> dict:
        """A /decode body continuing from a prefill's KV reference (``wire.KVRef.write()``)."""
        return {"kv": kv, **self.sampling_body(), **extra}

    def generate_body(self, **extra) -> dict:
        """A /generate body: the decode server alone."""
        return {**self.prompt_body(), **self.sampling_body(), **extra}

    def check(self, limits: Limits | None = None) -> None:
        """Refuse what every server would (``BadRequest``, ``PayloadTooLarge``, naming the field as the servers
        do): the request parsed as a decode server parses a /generate, with ``limits``."""
        body = self.generate_body()
        parse_prompt(body, limits or DEFAULT_LIMITS)
        parse_sampling(body, limits or DEFAULT_LIMITS)
