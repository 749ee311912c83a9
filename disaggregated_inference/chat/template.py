"""Models that speak through their own chat template (Jinja, in the GGUF), and prompts sent raw.

``TemplateFormat`` renders with the model's template (llama-cpp-python's
``Jinja2ChatFormatter``, made by the engine and handed in, so this layer
imports no engine library). It knows no tool-call syntax of its own, so a
tool call is a JSON object under a schema (``envelope``): with tools offered,
the whole answer is ``{"tool_calls": [{"name", "arguments"}, ...]}`` or
``{"content": ...}``, constrained from the first token by a grammar, and the
prompt says so. Any model with a template can call tools this way (the
embedded SmolLM2 does); an engine without grammar sampling cannot.

``Raw`` is a prompt sent as written (``raw``): no rendering, and the output is
all answer.
"""
from __future__ import annotations

import json

from ..errors import BadRequest
from .base import START, ChatFormat, Parser, Part, PlainParser, Rendered, CONTENT, TOOL_CALL
from .conversation import CHOICES, Tools, ToolCall, answered_tool, tool_names

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


class Raw(ChatFormat):
    name = "raw"


class TemplateFormat(ChatFormat):
    name = "template"
    # whether the template renders tools and tool turns itself (a model with a native tool format);
    # otherwise tools are described in the system message and called through the JSON envelope
    native_tools = False

    def __init__(self, formatter=None, source: str | None = None):
        self.formatter = formatter  # callable(messages=..., tools=..., **kwargs) -> a ChatFormatterResponse
        self.source = source        # where the template came from (gguf, builtin:ARCH), for /health

    def render(self, messages, *, tools: Tools | None = None, reasoning_effort: str | None = None) -> Rendered:
        if self.formatter is None:
            raise BadRequest("this model has no chat template; send 'prompt' with 'raw': true", field="messages")
        kwargs = {}
        if reasoning_effort:
            kwargs["reasoning_effort"] = reasoning_effort  # for the templates that read it
        if self.native_tools:
            turns = self._native_turns(messages)
            if tools is not None and tools.active:
                kwargs["tools"] = [t.as_openai() for t in tools.callable()]
        else:
            turns = self._plain_turns(messages, tools)
        try:
            rendered = self.formatter(messages=turns, **kwargs)
        except Exception as exc:  # the template's own raise_exception, or a jinja error
            raise BadRequest(f"chat template rejected the messages: {exc}", field="messages") from None
        return Rendered(rendered.prompt, tuple(s for s in rendered.stop or () if s), not rendered.added_special)

    def parser(self, tools: Tools | None) -> Parser:
        return EnvelopeParser() if tools is not None and tools.active else PlainParser()

    def constraint(self, json_schema, tools):
        if tools is not None and tools.active:
            return envelope(tools, json_schema), START
        return json_schema, START

    # -- turns as the template sees them ----------------------------------------------------------

    @staticmethod
    def _native_turns(messages) -> list:
        """Messages in the shape tool-aware templates read (calls as ``{"type": "function", "function": ...}``)."""
        names = tool_names(messages)
        out = []
        for i, m in enumerate(messages):
            turn = {"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"]}
            if m.get("tool_calls"):
                turn["tool_calls"] = [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]},
                                       **({"id": c["id"]} if "id" in c else {})} for c in m["tool_calls"]]
            if m["role"] == "tool":
                turn["name"] = answered_tool(messages, i, names)
                if "tool_call_id" in m:
                    turn["tool_call_id"] = m["tool_call_id"]
            out.append(turn)
        return out

    @staticmethod
    def _plain_turns(messages, tools: Tools | None) -> list:
        """Messages for a template that knows no tools: system, user and assistant turns only. Earlier calls are
        the envelopes the model wrote; tool results are user turns (consecutive ones joined)."""
        names = tool_names(messages)
        out: list = []
        for i, m in enumerate(messages):
            role, content = m["role"], m["content"]
            if role == "developer":
                role = "system"
            if m.get("tool_calls"):
                calls = json.dumps({"tool_calls": [{"name": c["name"], "arguments": c["arguments"]}
                                                   for c in m["tool_calls"]]}, ensure_ascii=False)
                content = f"{content}\n{calls}" if content else calls
            if role == "tool":
                role, content = "user", f"The tool {answered_tool(messages, i, names)} returned:\n{content}"
                if out and out[-1]["role"] == "user" and out[-1].get("tool_results"):
                    out[-1]["content"] += "\n\n" + content
                    continue
                out.append({"role": role, "content": content, "tool_results": True})
                continue
            out.append({"role": role, "content": content})
        for turn in out:
            turn.pop("tool_results", None)
        if tools is not None and tools.active:
            note = tool_instructions(tools)
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{note}"}
            else:
                out.insert(0, {"role": "system", "content": note})
        return out


def tool_instructions(tools: Tools) -> str:
    """The system prompt's part that offers the tools and says how to answer (the envelope)."""
    specs = [{"name": t.name, "description": t.description, "parameters": t.parameters} for t in tools.callable()]
    listing = json.dumps(specs, ensure_ascii=False)
    call = '{"tool_calls": [{"name": "<tool name>", "arguments": {<the arguments>}}]}'
    if tools.choice == "required":
        how = f"Call one or more of them: answer with JSON only, {call}."
    elif tools.choice not in CHOICES:
        how = f"Call the tool {tools.choice}: answer with JSON only, {call}."
    else:
        how = (f"To call tools, answer with JSON only: {call}. To answer without a tool, answer with JSON "
               'only: {"content": "<your answer>"}.')
    return f"You can call these tools (their parameters are JSON schemas):\n{listing}\n{how}"


def envelope(tools: Tools, json_schema: dict | None = None) -> dict:
    """The JSON schema of an answer that may (or, for ``required`` or a named tool, must) call tools."""
    calls = []
    for t in tools.callable():
        params = dict(t.parameters) if t.parameters else {}
        params.setdefault("type", "object")
        calls.append({"type": "object", "properties": {"name": {"const": t.name}, "arguments": params},
                      "required": ["name", "arguments"], "additionalProperties": False})
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    call_list = {"type": "array", "items": items, "minItems": 1}
    if tools.choice not in CHOICES:
        call_list["maxItems"] = 1
    calling = {"type": "object", "properties": {"tool_calls": call_list}, "required": ["tool_calls"],
               "additionalProperties": False}
    if tools.required:
        return calling
    answer = json_schema if json_schema is not None else {"type": "string"}
    return {"anyOf": [calling, {"type": "object", "properties": {"content": answer}, "required": ["content"],
                                "additionalProperties": False}]}


class EnvelopeParser(Parser):
    """The JSON envelope, read once it is complete: tool calls, or the answer. A cut-off or invalid envelope
    is returned as the answer, as written."""

    def __init__(self):
        super().__init__()
        self._text = ""

    def feed(self, text: str) -> list[Part]:
        self._text += text
        return []

    def close(self) -> list[Part]:
        self.answer_open = True
        try:
            value = json.loads(self._text)
        except ValueError:
            value = None
        if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
            parts = []
            for call in value["tool_calls"]:
                if isinstance(call, dict) and isinstance(call.get("name"), str):
                    found = ToolCall(call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False))
                    self.tool_calls.append(found)
                    parts.append(Part(TOOL_CALL, found))
            return parts
        if isinstance(value, dict) and "content" in value:
            content = value["content"]
            return [Part(CONTENT, content if isinstance(content, str) else json.dumps(content, ensure_ascii=False))]
        return [Part(CONTENT, self._text)] if self._text else []
