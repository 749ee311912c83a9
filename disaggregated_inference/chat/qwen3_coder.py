"""Qwen3-Coder's tool calls: XML-like blocks in plain text, rendered by the model's own template.

The model has no reasoning channel. Its template lists the tools in the system
message and asks for calls in this shape, which is what the model writes::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

one block per call, optionally after some text (the answer so far). A
parameter's value is its raw text between the newline after ``<parameter=NAME>``
and the one before ``</parameter>``; the tool's JSON schema says what it is
(a string stays text; numbers, booleans, objects and arrays are read as JSON).
Turns and tool results are the template's business (``TemplateFormat`` with
``native_tools``).
"""
from __future__ import annotations

import json
import re

from ..errors import BadRequest
from .base import CONTENT, START, TOOL_CALL, Parser, Part, take
from .conversation import Tools, ToolCall
from .template import TemplateFormat

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)


class Qwen3Coder(TemplateFormat):
    name = "qwen3_coder"
    native_tools = True

    def parser(self, tools: Tools | None) -> Parser:
        return Qwen3CoderParser(tools)

    def constraint(self, json_schema, tools):
        if json_schema is not None and tools is not None and tools.active:
            # a grammar from the first token would forbid the <tool_call> blocks the model calls tools with
            raise BadRequest("a JSON schema and tools cannot be combined for this model (its tool calls are not "
                             "JSON); send one or the other", field="json_schema")
        return json_schema, START  # tools are called in text, not through the JSON envelope


class Qwen3CoderParser(Parser):
    def __init__(self, tools: Tools | None = None):
        super().__init__()
        self.tools = tools
        self._pending = ""
        self._space = ""     # trailing whitespace of the answer, held: it may only separate it from a call
        self._call = None    # the text of the block being read, once <tool_call> has come

    @property
    def region(self) -> str:
        return CONTENT if self._call is None else TOOL_CALL

    def feed(self, text: str) -> list[Part]:
        parts: list[Part] = []
        buf = self._pending + text
        self._pending = ""
        while buf:
            if self._call is None:
                before, marker, buf = take(buf, (OPEN,))
                self._content(before, parts)
                if marker is None:
                    self._pending = buf
                    break
                self._call, self._space = "", ""  # whitespace before a call separated it: not part of the answer
            else:
                before, marker, buf = take(buf, (CLOSE,))
                self._call += before
                if marker is None:
                    self._pending = buf
                    break
                self._finish(parts)
        return parts

    def close(self) -> list[Part]:
        parts: list[Part] = []
        if self._pending:
            if self._call is None:
                self._content(self._pending, parts)
            else:
                self._call += self._pending
            self._pending = ""
        if self._call is not None:
            self._finish(parts)  # cut off before </tool_call>: what arrived of it
        if self._space and not self.tool_calls:
            parts.append(Part(CONTENT, self._space))
        self._space = ""
        return parts

    def _content(self, text: str, parts: list) -> None:
        if not text:
            return
        stripped = text.rstrip()
        if stripped:
            parts.append(Part(CONTENT, self._space + stripped))
            self.answer_open = True
            self._space = text[len(stripped):]
        else:
            self._space += text

    def _finish(self, parts: list) -> None:
        for name, body in _FUNCTION.findall(self._call):
            name = name.strip()
            tool = self.tools.get(name) if self.tools is not None else None
            props = (tool.parameters or {}).get("properties", {}) if tool is not None else {}
            arguments = {key.strip(): _value(raw, props.get(key.strip())) for key, raw in _PARAMETER.findall(body)}
            call = ToolCall(name, json.dumps(arguments, ensure_ascii=False))
            self.tool_calls.append(call)
            parts.append(Part(TOOL_CALL, call))
        self.answer_open = True
        self._call = None


def _value(raw: str, spec) -> object:
    """A parameter's text as the value its schema says it is."""
    text = raw[1:] if raw.startswith("\n") else raw
    text = text[:-1] if text.endswith("\n") else text
    kinds = spec.get("type") if isinstance(spec, dict) else None
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "string" in kinds:
        return text
    try:
        return json.loads(text)
    except ValueError:
        if "boolean" in kinds and text.strip().lower() in ("true", "false"):
            return text.strip().lower() == "true"
        return text
