"""What a chat request is made of, parsed once: messages, the tools offered, the tool calls made.

The servers' request bodies carry these as JSON. ``parse_messages`` and
``parse_tools`` turn them into plain, validated values (or raise ``BadRequest``
naming the field), so every chat format (harmony.py, qwen3_coder.py,
template.py) renders the same shapes:

- a message is a dict with ``role`` (system, developer, user, assistant or
  tool) and ``content`` (a string); an assistant message may add
  ``tool_calls`` (each ``{"name", "arguments"}``, the arguments a JSON object)
  and ``reasoning`` (its analysis, for formats that keep it); a tool message
  may add ``name`` (the tool that answered) and ``tool_call_id``;
- ``Tools`` holds the functions offered (name, description, a JSON schema of
  the parameters) and ``choice``: ``auto``, ``none``, ``required`` or one
  tool's name (that tool must be called).

A call the model makes comes out of a format's parser as a ``ToolCall``: its
name and its arguments as JSON text, as the OpenAI API carries them.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from ..errors import BadRequest

ROLES = ("system", "developer", "user", "assistant", "tool")
CHOICES = ("auto", "none", "required")
EFFORTS = ("low", "medium", "high")
TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
MAX_TOOLS = 128


@dataclass(frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})

    def as_openai(self) -> dict:
        """The OpenAI API's shape (``{"type": "function", "function": {...}}``), which chat templates read."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class Tools:
    specs: tuple = ()
    choice: str = "auto"  # auto, none, required, or the name of the one tool to call

    @property
    def active(self) -> bool:
        """Whether the model may call a tool in this answer."""
        return bool(self.specs) and self.choice != "none"

    @property
    def required(self) -> bool:
        return self.active and self.choice != "auto"

    def callable(self) -> tuple:
        """The tools this answer may call (one when ``choice`` names it)."""
        if self.choice in CHOICES:
            return self.specs if self.choice != "none" else ()
        return tuple(t for t in self.specs if t.name == self.choice)

    def get(self, name: str) -> Tool | None:
        return next((t for t in self.specs if t.name == name), None)

    def as_openai(self) -> list:
        return [t.as_openai() for t in self.specs]

    def to_json(self) -> dict:
        """The request-body keys that carry these tools (what ``parse_tools`` reads back)."""
        choice = self.choice if self.choice in CHOICES else {"type": "function", "function": {"name": self.choice}}
        return {"tools": self.as_openai(), "tool_choice": choice}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as the model wrote it (the OpenAI API's convention)

    def as_dict(self) -> dict:
        return {"name": self.name, "arguments": self.arguments}


def _text(value, field_name: str, *, optional: bool = False) -> str:
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        raise BadRequest(f"'{field_name}' must be a string", field=field_name)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest(f"'{field_name}' is not valid text: {exc.reason} at character {exc.start}",
                         field=field_name) from None
    return value


def _arguments(value, where: str) -> dict:
    """A call's arguments: a JSON object, given as one or as its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            raise BadRequest(f"'{where}' is not valid JSON", field=where) from None
    if not isinstance(value, dict):
        raise BadRequest(f"'{where}' must be a JSON object (or its JSON text)", field=where)
    return value


def _tool_call(value, where: str) -> dict:
    """One call of an assistant message: ``{"name", "arguments"}`` or the OpenAI API's
    ``{"id", "type": "function", "function": {"name", "arguments"}}``."""
    if not isinstance(value, dict):
        raise BadRequest(f"'{where}' must be an object", field=where)
    fn = value.get("function") if isinstance(value.get("function"), dict) else value
    inner = f"{where}.function" if fn is not value else where
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise BadRequest(f"'{inner}.name' must be a tool name (letters, digits, _ . -; at most 64)",
                         field=f"{inner}.name")
    call = {"name": name, "arguments": _arguments(fn.get("arguments", {}), f"{inner}.arguments")}
    if isinstance(value.get("id"), str):
        call["id"] = value["id"]
    return call


def parse_messages(value, field_name: str = "messages") -> tuple:
    """Validated, normalized messages (see the module's docstring); ``BadRequest`` names the offending field."""
    if not isinstance(value, list) or not value:
        raise BadRequest(f"'{field_name}' must be a non-empty list", field=field_name)
    out = []
    for i, m in enumerate(value):
        where = f"{field_name}[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"{where} must be an object whose 'role' is one of {', '.join(ROLES)}",
                             field=f"{where}.role" if isinstance(m, dict) else where)
        role = m["role"]
        calls = m.get("tool_calls") if role == "assistant" else None
        if calls is not None and (not isinstance(calls, list)):
            raise BadRequest(f"'{where}.tool_calls' must be a list", field=f"{where}.tool_calls")
        # an assistant message that only calls tools may have no content (the OpenAI API sends null)
        message = {"role": role, "content": _text(m.get("content"), f"{where}.content", optional=bool(calls))}
        if calls:
            message["tool_calls"] = tuple(_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls))
        if role == "assistant":
            for key in ("reasoning", "reasoning_content", "thinking"):  # the spellings APIs use for it
                if m.get(key) is not None:
                    message["reasoning"] = _text(m[key], f"{where}.{key}")
                    break
        if role == "tool":
            for key in ("name", "tool_name"):
                if m.get(key) is not None:
                    message["name"] = _text(m[key], f"{where}.{key}")
                    break
            if m.get("tool_call_id") is not None:
                message["tool_call_id"] = _text(m["tool_call_id"], f"{where}.tool_call_id")
            if "name" not in message and not any(o.get("tool_calls") for o in out):
                raise BadRequest(f"{where} is a tool result, but no assistant message before it called a tool",
                                 field=where)
        out.append(message)
    return tuple(out)


def parse_tools(tools, choice=None) -> Tools | None:
    """``tools`` (a list of functions, in the OpenAI API's shape or flat ``{"name", "description",
    "parameters"}``) and ``tool_choice`` (``auto``, ``none``, ``required``, or
    ``{"type": "function", "function": {"name": ...}}``); None when neither is given."""
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise BadRequest("'tool_choice' needs 'tools'", field="tool_choice")
        return None
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list of functions", field="tools")
    if len(tools) > MAX_TOOLS:
        raise BadRequest(f"'tools' has more than {MAX_TOOLS} functions", field="tools")
    specs, names = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise BadRequest(f"'{where}' must be an object", field=where)
        if "function" in t or "type" in t:
            if t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
                raise BadRequest(f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}",
                                 field=f"{where}.type")
            fn, where = t["function"], f"{where}.function"
        else:
            fn = t
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise BadRequest(f"'{where}.name' must be a tool name (letters, digits, _ . -; at most 64)",
                             field=f"{where}.name")
        if name in names:
            raise BadRequest(f"'{where}.name': tool {name!r} is listed twice", field=f"{where}.name")
        names.add(name)
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise BadRequest(f"'{where}.parameters' must be a JSON schema object", field=f"{where}.parameters")
        specs.append(Tool(name, _text(fn.get("description"), f"{where}.description", optional=True), params))
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function") if isinstance(choice.get("function"), dict) else choice
        choice = fn.get("name")
        if choice not in names:
            raise BadRequest(f"'tool_choice' names {choice!r}, which is not among 'tools'", field="tool_choice")
    elif choice not in CHOICES:
        raise BadRequest("'tool_choice' must be auto, none, required or {\"type\": \"function\", \"function\": "
                         "{\"name\": ...}}", field="tool_choice")
    return Tools(tuple(specs), choice)


def parse_effort(value, field_name: str = "reasoning_effort") -> str | None:
    if value is None:
        return None
    if value not in EFFORTS:
        raise BadRequest(f"'{field_name}' must be one of {', '.join(EFFORTS)}", field=field_name)
    return value


def tool_names(messages) -> dict:
    """tool_call_id -> the tool's name, over every call of the conversation's assistant messages."""
    return {c["id"]: c["name"] for m in messages for c in m.get("tool_calls", ()) if "id" in c}


def answered_tool(messages, i: int, names: dict) -> str:
    """The name of the tool whose result ``messages[i]`` (a tool message) is: its own ``name``, else the call its
    ``tool_call_id`` names, else the latest call before it."""
    m = messages[i]
    if m.get("name"):
        return m["name"]
    if m.get("tool_call_id") in names:
        return names[m["tool_call_id"]]
    for earlier in reversed(messages[:i]):
        if earlier.get("tool_calls"):
            return earlier["tool_calls"][-1]["name"]
    raise BadRequest(f"messages[{i}] is a tool result, but no assistant message before it called a tool",
                     field=f"messages[{i}]")
