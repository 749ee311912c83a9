"""Typed parsing of the OpenAI and Ollama request bodies, once, at the gateway's edge.

Both APIs become one ``GatewayRequest``: the ``GenerationRequest`` (request.py) the
``DisaggregatedClient`` is asked for, and how the API wants its answer. What the cluster cannot honour (several choices, log-probabilities,
images, an Ollama ``context``) is refused with a ``BadRequest`` naming the field,
never silently dropped. Conversations with tool calls and tool results, the
tools offered (``tools``, ``tool_choice``) and the reasoning asked for (OpenAI's
``reasoning_effort``, Ollama's ``think``) are checked here as the servers will
(chat/conversation.py) and passed on in the servers' own shapes.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import chat
from ..backends.speculate import PROPOSERS, requested_proposer
from ..errors import BadRequest
from ..fields import format_schema, number, require_object, stop_sequences, typed
from ..request import GenerationRequest

UNLIMITED_TOKENS = 1 << 20  # the decode server stops at the end of its context first

# The cluster's names of request fields (what the client and the servers name in their errors: they
# check the request the gateway builds) as each API spells them; the others are the same in both.
API_FIELDS = {
    "openai": {"json_schema": "response_format", "max_new_tokens": "max_tokens"},
    "ollama": {"json_schema": "format", "max_new_tokens": "options.num_predict", "stop": "options.stop",
               "temperature": "options.temperature", "top_p": "options.top_p", "top_k": "options.top_k",
               "seed": "options.seed"},
}


def api_field(field: str | None, api: str) -> str | None:
    """A cluster error's ``field`` as the API the request came through names it."""
    return API_FIELDS[api].get(field, field) if field else field


@dataclass(frozen=True)
class GatewayRequest:
    """A request to the gateway: the ``GenerationRequest`` the cluster is asked for, and how the API that
    brought it wants the answer given back."""

    request: GenerationRequest
    stream: bool = False
    include_usage: bool = False
    parallel_tool_calls: bool = True  # false: at most one call is answered
    show_reasoning: bool = True      # Ollama's think: false leaves the thinking out of the answer

    @property
    def model(self) -> str:
        return self.request.model

    @property
    def prompt(self) -> str | None:
        return self.request.prompt


_PRESENTATION = ("stream", "include_usage", "parallel_tool_calls", "show_reasoning")


def _gateway_request(**fields) -> GatewayRequest:
    shown = {key: fields.pop(key) for key in _PRESENTATION if key in fields}
    return GatewayRequest(GenerationRequest(**fields), **shown)


def _unknown(body: dict, allowed: set, refused: dict) -> None:
    for key, why in refused.items():
        if body.get(key):  # absent, null, false or empty: nothing asked
            raise BadRequest(f"'{key}' is not supported by this gateway: {why}", field=key)
    unknown = sorted(set(body) - allowed - set(refused))
    if unknown:
        raise BadRequest(f"unknown or unsupported parameter '{unknown[0]}'", field=unknown[0])


def _model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required (a model name or alias)", field="model")
    return model


# -- OpenAI ------------------------------------------------------------------------------------

OPENAI_REFUSED = {
    "logprobs": "log-probabilities are not returned", "top_logprobs": "log-probabilities are not returned",
    "functions": "the deprecated function calls are not supported: send 'tools'",
    "function_call": "the deprecated function calls are not supported: send 'tool_choice'",
    "logit_bias": "logit bias is not supported",
    "audio": "audio is not supported", "modalities": "only text is supported",
    "prediction": "predicted outputs are not supported", "echo": "echo is not supported",
    "suffix": "suffix (insertion) is not supported", "best_of": "best_of is not supported",
}
# ignore_eos: exactly max_tokens (vLLM's and llama.cpp's servers take it too); benchmarks need it.
# speculation: the decode server's proposer for the request (the servers' own field, passed through)
OPENAI_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n",
                 "user", "frequency_penalty", "presence_penalty", "response_format", "store", "metadata",
                 "ignore_eos", "speculation"}


def _openai_common(body: dict) -> dict:
    if body.get("n") not in (None, 1):
        raise BadRequest("'n' must be 1: the gateway returns one choice", field="n")
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise BadRequest(f"'{key}' is not supported (only 0)", field=key)
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise BadRequest("give 'max_tokens' or 'max_completion_tokens', not both", field="max_completion_tokens")
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    stream = typed(body, "stream", bool, False, what="a boolean")
    options = typed(body, "stream_options", dict, {}, what="an object")
    if options and not stream:
        raise BadRequest("'stream_options' is only allowed with 'stream': true", field="stream_options")
    if set(options) - {"include_usage"}:
        raise BadRequest("'stream_options' may only hold 'include_usage'", field="stream_options")
    schema = _response_format(body.get("response_format"))
    ignore_eos = typed(body, "ignore_eos", bool, False, what="a boolean")
    if ignore_eos and schema is not None:  # a grammar ends its output with an end-of-generation token
        raise BadRequest("'ignore_eos' cannot be combined with 'response_format'", field="ignore_eos")
    speculation = requested_proposer(typed(body, "speculation", str, None,
                                              what=f"one of {', '.join(PROPOSERS)}"))
    return {
        "model": _model(body),
        "stream": stream,
        "include_usage": typed(options, "include_usage", bool, False, what="a boolean", where="stream_options."),
        "max_tokens": number(body, key, UNLIMITED_TOKENS, 1, UNLIMITED_TOKENS, integer=True),
        "temperature": float(number(body, "temperature", 1.0, 0.0, 2.0)),
        "top_p": float(number(body, "top_p", 1.0, 0.0, 1.0)),
        "seed": number(body, "seed", None, -(1 << 31), (1 << 32) - 1, integer=True),
        "stop": stop_sequences(body.get("stop"), "stop"),
        "json_schema": schema,
        "ignore_eos": ignore_eos,
        "speculation": speculation,
    }


def _response_format(value) -> dict | None:
    """``response_format`` as the decode-time grammar: a JSON schema (any object for json_object)."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise BadRequest("'response_format.type' must be 'text', 'json_object' or 'json_schema'",
                         field="response_format")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return {"type": "object"}
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise BadRequest("'response_format.json_schema.schema' must be a JSON schema object",
                         field="response_format.json_schema")
    return spec["schema"]


def _openai_content(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"messages[{i}].content: only text parts are supported", field=f"messages[{i}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", field=f"messages[{i}].content")


def _tools(body: dict) -> dict:
    """``tools`` and ``tool_choice`` checked as the servers will check them; passed on as given."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parsed = chat.parse_tools(tools, choice)
    if parsed is None:
        return {}
    return {"tools": tuple(tools), "tool_choice": choice}


def _turn(m: dict, content: str, *, reasoning: str, tool: dict) -> dict:
    """A message in the servers' shape (chat/conversation.py): an assistant's calls and its reasoning (the API's
    ``reasoning`` field), a tool result's fields (``tool``: the API's name -> the servers')."""
    message = {"role": m["role"], "content": content}
    if m["role"] == "assistant":
        if m.get("tool_calls"):
            message["tool_calls"] = m["tool_calls"]
        if m.get(reasoning) is not None:
            message["reasoning"] = m[reasoning]
    if m["role"] == "tool":
        message.update({ours: m[theirs] for theirs, ours in tool.items() if m.get(theirs) is not None})
    return message


def _checked(messages: list) -> tuple:
    """The servers' message shapes, checked now so that a bad one is a 400 before anything is routed."""
    chat.parse_messages(messages)
    return tuple(messages)


def parse_openai_chat(body) -> GatewayRequest:
    body = require_object(body)
    _unknown(body, OPENAI_COMMON | {"messages", "max_completion_tokens", "tools", "tool_choice",
                                    "parallel_tool_calls", "reasoning_effort", "reasoning_budget"}, OPENAI_REFUSED)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", field="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise BadRequest(f"messages[{i}].role must be system, developer, user, assistant or tool",
                             field=f"messages[{i}].role")
        # an assistant turn that only calls tools may have no content (null)
        content = "" if m.get("content") is None and m.get("tool_calls") else _openai_content(m.get("content"), i)
        out.append(_turn(m, content, reasoning="reasoning_content", tool={"tool_call_id": "tool_call_id"}))
    return _gateway_request(messages=_checked(out), **_openai_common(body), **_tools(body),
                          parallel_tool_calls=typed(body, "parallel_tool_calls", bool, True, what="a boolean"),
                          reasoning_effort=chat.parse_effort(body.get("reasoning_effort")),
                          reasoning_budget=number(body, "reasoning_budget", None, 0, UNLIMITED_TOKENS, integer=True))


def parse_openai_completion(body) -> GatewayRequest:
    body = require_object(body)
    _unknown(body, OPENAI_COMMON | {"prompt"}, OPENAI_REFUSED)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("'prompt' must be a non-empty string (one prompt per request)", field="prompt")
    # a completion continues the text as written: no chat template
    return _gateway_request(prompt=prompt, raw=True, **_openai_common(body))


# -- Ollama ------------------------------------------------------------------------------------

OLLAMA_REFUSED = {
    "context": "the KV of a previous answer is not kept; send the conversation to /api/chat instead",
    "images": "images are not supported", "template": "the model's own template is always used",
    "suffix": "suffix (insertion) is not supported", "logprobs": "log-probabilities are not returned",
    "top_logprobs": "log-probabilities are not returned",
}
OLLAMA_COMMON = {"model", "stream", "format", "options", "keep_alive", "think"}
OLLAMA_SAMPLING = {"temperature", "top_p", "top_k", "seed", "num_predict", "stop"}
# runner settings fixed by each server's config: accepted, with no effect (Ollama reloads the model for them)
OLLAMA_RUNNER = {"num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "use_mmap", "use_mlock", "numa",
                 "low_vram", "num_keep"}


def _ollama_common(body: dict) -> dict:
    options = typed(body, "options", dict, {}, what="an object")
    for key in options:
        if key not in OLLAMA_SAMPLING | OLLAMA_RUNNER:
            raise BadRequest(f"option '{key}' is not supported (supported: {', '.join(sorted(OLLAMA_SAMPLING))})",
                             field=f"options.{key}")
    num_predict = number(options, "num_predict", -1, -2, UNLIMITED_TOKENS, integer=True, where="options.")
    seed = number(options, "seed", None, -(1 << 31), (1 << 32) - 1, integer=True, where="options.")
    schema = format_schema(body.get("format"))
    typed(body, "keep_alive", (str, int, float), None, what="a duration")  # servers keep their models loaded
    think = body.get("think")
    if think is not None and not isinstance(think, bool) and think not in chat.EFFORTS:
        raise BadRequest("'think' must be true, false or one of low, medium, high", field="think")
    return {
        "model": _model(body),
        "stream": typed(body, "stream", bool, True, what="a boolean"),
        "max_tokens": UNLIMITED_TOKENS if num_predict <= 0 else num_predict,  # -1, -2, 0: until stop or context end
        "temperature": float(number(options, "temperature", 0.8, 0.0, 5.0, where="options.")),
        "top_p": float(number(options, "top_p", 0.9, 0.0, 1.0, where="options.")),
        "top_k": number(options, "top_k", 40, 0, 1 << 20, integer=True, where="options."),
        "seed": None if seed is not None and seed < 0 else seed,  # -1: random, as in Ollama
        "stop": stop_sequences(options.get("stop"), "options.stop"),
        "json_schema": schema,
        # think: a level sets the effort; false keeps the thinking out of the answer (the model still thinks)
        "reasoning_effort": think if isinstance(think, str) else None,
        "show_reasoning": think is not False,
    }


def parse_ollama_generate(body) -> GatewayRequest:
    """``/api/generate``; an empty prompt only "loads" the model (answered without a generation)."""
    body = require_object(body)
    _unknown(body, OLLAMA_COMMON | {"prompt", "system", "raw"},
             {**OLLAMA_REFUSED, "tools": "tools are offered on /api/chat"})
    prompt = typed(body, "prompt", str, "", what="a string")
    raw = typed(body, "raw", bool, False, what="a boolean")
    system = typed(body, "system", str, None, what="a string")
    if raw and system is not None:
        raise BadRequest("raw mode does not support template, system, or context", field="system")
    return _gateway_request(prompt=prompt, raw=raw, system=system, **_ollama_common(body))


def parse_ollama_chat(body) -> GatewayRequest:
    body = require_object(body)
    _unknown(body, OLLAMA_COMMON | {"messages", "tools"}, OLLAMA_REFUSED)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", field="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise BadRequest(f"messages[{i}].role must be system, user, assistant or tool",
                             field=f"messages[{i}].role")
        if m.get("images"):
            raise BadRequest(f"messages[{i}].images is not supported", field=f"messages[{i}].images")
        content = m.get("content")
        if content is None and m.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string", field=f"messages[{i}].content")
        out.append(_turn(m, content, reasoning="thinking", tool={"tool_name": "name"}))
    return _gateway_request(messages=_checked(out), **_ollama_common(body), **_tools(body))


def parse_model_name(body) -> str:
    """``/api/show``: ``{"model": NAME}`` (older clients send ``name``)."""
    body = require_object(body)
    name = body.get("model") or body.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequest("'model' is required", field="model")
    return name
