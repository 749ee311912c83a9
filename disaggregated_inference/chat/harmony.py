"""gpt-oss's conversation format, harmony: messages on channels, reasoning first, tool calls by address.

Every message is ``<|start|>ROLE`` + header + ``<|message|>`` + text + an end
marker. The header names the **channel** (``<|channel|>analysis``, ``commentary``
or ``final``) and, for a tool call, the **recipient** (``to=functions.NAME``,
before or after the channel) and the arguments' type (``<|constrain|>json`` or a
bare ``json``). The prompt ends with ``<|start|>assistant``; the model then
writes its chain of thought on ``analysis``, closes it with ``<|end|>``, opens
``<|start|>assistant<|channel|>final<|message|>`` and writes the answer, ending
with ``<|return|>``; or it calls a tool on ``commentary`` and ends with
``<|call|>``. ``<|end|>`` ends one message, never the generation.

The system message carries the model's identity, the date, the reasoning
effort (``Reasoning: low|medium|high``) and the valid channels; the caller's
instructions and the tools (a TypeScript-like ``namespace functions``) go in a
developer message. Earlier turns keep their final answers and drop their
analysis, except the analysis that led to a tool call whose answer has not
come yet. A tool's result is a message from ``functions.NAME`` to the
assistant on ``commentary``, its text as a JSON string.
"""
from __future__ import annotations

import json
import re
import time

from .base import ANSWER, CONTENT, REASONING, TOOL_CALL, ChatFormat, Parser, Part, Rendered, take
from .conversation import Tools, ToolCall, answered_tool, tool_names

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
RETURN, CALL, CONSTRAIN = "<|return|>", "<|call|>", "<|constrain|>"
MARKERS = (START, CHANNEL, MESSAGE, END, RETURN, CALL, CONSTRAIN)
# closes whatever message is open and opens the answer: what a reasoning cap feeds the model
FINAL = f"{END}{START}assistant{CHANNEL}final{MESSAGE}"

IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
HEADER_LIMIT = 256  # header text without <|message|> beyond this is not harmony: read as the answer


class Harmony(ChatFormat):
    name = "harmony"
    reasoning = True
    special_text = True
    end_texts = (RETURN, CALL)
    continue_texts = (END,)
    answer_opener = FINAL
    source = "builtin:harmony"  # rendered here, whatever template the GGUF carries

    def render(self, messages, *, tools: Tools | None = None, reasoning_effort: str | None = None,
               today: str | None = None) -> Rendered:
        return Rendered(render(messages, tools=tools, reasoning_effort=reasoning_effort, today=today), add_bos=False)

    def parser(self, tools: Tools | None) -> Parser:
        return HarmonyParser()

    def constraint(self, json_schema, tools):
        return json_schema, ANSWER  # the analysis channel stays free; the answer follows the schema


# -- rendering -------------------------------------------------------------------------------------

def render(messages, *, tools: Tools | None = None, reasoning_effort: str | None = None,
           today: str | None = None) -> str:
    today = today or time.strftime("%Y-%m-%d")
    offered = tools.specs if tools is not None else ()
    system = (f"{IDENTITY}\nKnowledge cutoff: {KNOWLEDGE_CUTOFF}\nCurrent date: {today}\n\n"
              f"Reasoning: {reasoning_effort or 'medium'}\n\n"
              "# Valid channels: analysis, commentary, final. Channel must be included for every message.")
    if offered:
        system += "\nCalls to these tools must go to the commentary channel: 'functions'."
    out = [f"{START}system{MESSAGE}{system}{END}"]
    instructions = "\n\n".join(m["content"] for m in messages if m["role"] in ("system", "developer"))
    if instructions or offered:
        developer = f"# Instructions\n\n{instructions}\n\n" if instructions else ""
        if offered:
            developer += "# Tools\n\n" + _namespace(offered)
        out.append(f"{START}developer{MESSAGE}{developer}{END}")
    turns = [m for m in messages if m["role"] not in ("system", "developer")]
    names = tool_names(turns)
    for i, m in enumerate(turns):
        role, content = m["role"], m["content"]
        if role == "user":
            out.append(f"{START}user{MESSAGE}{content}{END}")
        elif role == "tool":
            out.append(f"{START}functions.{answered_tool(turns, i, names)} to=assistant{CHANNEL}commentary{MESSAGE}"
                       f"{json.dumps(content, ensure_ascii=False)}{END}")
        elif m.get("tool_calls"):
            # the analysis behind a call is kept until an answer that follows it makes it moot
            answered = any(t["role"] == "assistant" and not t.get("tool_calls") for t in turns[i + 1:])
            analysis = m.get("reasoning") or content
            if analysis and not answered:
                out.append(f"{START}assistant{CHANNEL}analysis{MESSAGE}{analysis}{END}")
            for call in m["tool_calls"]:
                out.append(f"{START}assistant to=functions.{call['name']}{CHANNEL}commentary json{MESSAGE}"
                           f"{json.dumps(call['arguments'], ensure_ascii=False)}{CALL}")
        else:  # an earlier answer: its analysis is dropped
            out.append(f"{START}assistant{CHANNEL}final{MESSAGE}{content}{END}")
    out.append(f"{START}assistant")
    return "".join(out)


def _namespace(tools) -> str:
    lines = ["## functions\n\nnamespace functions {\n\n"]
    for tool in tools:
        lines.append(f"// {tool.description}\n")
        params = tool.parameters or {}
        props = params.get("properties") or {}
        if not props:
            lines.append(f"type {tool.name} = () => any;\n\n")
            continue
        required = params.get("required") or []
        lines.append(f"type {tool.name} = (_: {{\n")
        for name, spec in props.items():
            spec = spec if isinstance(spec, dict) else {}
            if spec.get("description"):
                lines.append(f"// {spec['description']}\n")
            line = f"{name}{'' if name in required else '?'}: {_ts_type(spec)}"
            if "default" in spec:
                line += f", // default: {spec['default'] if spec.get('enum') else json.dumps(spec['default'])}"
            lines.append(line + ",\n")
        lines.append("}) => any;\n\n")
    lines.append("} // namespace functions")
    return "".join(lines)


def _ts_type(spec: dict) -> str:
    """A JSON schema as the TypeScript-like type harmony's tool namespace uses."""
    kind = spec.get("type")
    nullable = " | null" if spec.get("nullable") else ""
    if isinstance(kind, list):
        return " | ".join(map(str, kind))
    if kind == "array":
        items = spec.get("items")
        if not isinstance(items, dict):
            return "any[]" + nullable
        inner = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean"}.get(
            items.get("type")) or _ts_type(items)
        return ("any[]" if inner == "object | object" or len(inner) > 50 else f"{inner}[]") + nullable
    variants = spec.get("oneOf") or spec.get("anyOf")
    if variants:
        if len(variants) > 1 and any(isinstance(v, dict) and v.get("type") == "object" for v in variants):
            return "any"
        return " | ".join(_ts_type(v) for v in variants if isinstance(v, dict))
    if kind == "string":
        if spec.get("enum"):
            return " | ".join(json.dumps(v) for v in spec["enum"])
        return "string" + nullable
    if kind in ("number", "integer"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "object":
        props = spec.get("properties") or {}
        if not props:
            return "object"
        required = spec.get("required") or []
        inner = ", ".join(f"{name}{'' if name in required else '?'}: {_ts_type(sub if isinstance(sub, dict) else {})}"
                          for name, sub in props.items())
        return f"{{\n{inner}}}"
    return "any"


# -- parsing ---------------------------------------------------------------------------------------

_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")


class HarmonyParser(Parser):
    """Harmony's messages as they are generated. Analysis is reasoning; final (and commentary addressed to
    no tool, a preamble the user may see) is the answer; a message addressed to a tool is a call, reported
    whole when it ends. Lenient where models are: a message that ends without ``<|end|>`` (a new ``<|start|>``
    or ``<|channel|>``), text outside any message (read as the answer)."""

    def __init__(self):
        super().__init__()
        self.region = "header"
        self._header = ""
        self._pending = ""
        self._recipient = None
        self._args = ""

    def feed(self, text: str) -> list[Part]:
        parts: list[Part] = []
        buf = self._pending + text
        self._pending = ""
        while buf:
            before, marker, buf = take(buf, MARKERS)
            if before:
                self._text(before, parts)
            if marker is None:
                self._pending = buf  # maybe the start of a marker: wait for the next token
                break
            self._marker(marker, parts)
        return parts

    def close(self) -> list[Part]:
        parts: list[Part] = []
        if self._pending:
            self._text(self._pending, parts)
            self._pending = ""
        if self.region == "header" and self._header.strip() and MESSAGE not in self._header:
            self._as_answer(parts)  # never became a harmony message: plain text
        self._finish(parts)
        return parts

    def _text(self, text: str, parts: list) -> None:
        if self.region == "header":
            self._header += text
            if len(self._header) > HEADER_LIMIT and CHANNEL not in self._header and "to=" not in self._header:
                self._as_answer(parts)
        elif self.region == TOOL_CALL:
            self._args += text
        else:
            if self.region == CONTENT:
                self.answer_open = True
            parts.append(Part(self.region, text))

    def _as_answer(self, parts: list) -> None:
        text, self._header = self._header, ""
        self.region = CONTENT
        self.answer_open = True
        parts.append(Part(CONTENT, text))

    def _marker(self, marker: str, parts: list) -> None:
        if self.region == "header":
            if marker in (CHANNEL, CONSTRAIN):
                self._header += marker
            elif marker == MESSAGE:
                self._open(self._header)
                self._header = ""
            elif marker == START:
                self._header = ""  # a new message begins; what came before it was no header
            else:  # <|end|>, <|return|>, <|call|> with no message open: nothing to close
                self._header = ""
            return
        # inside a message's text
        if marker in (END, RETURN, CALL):
            self._finish(parts)
        elif marker in (START, CHANNEL):  # a new message without <|end|> first
            self._finish(parts)
            self._header = CHANNEL if marker == CHANNEL else ""
        else:  # <|message|> or <|constrain|> inside text: keep it as text
            self._text(marker, parts)

    def _open(self, header: str) -> None:
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        channel = channel.group(1) if channel else ""
        if recipient and recipient.group(1) not in ("assistant", "user"):
            name = recipient.group(1)
            self._recipient = name[len("functions."):] if name.startswith("functions.") else name
            self._args = ""
            self.region = TOOL_CALL
            self.answer_open = True  # a call is an answer: the generation may end with it
        elif channel == "analysis":
            self.region = REASONING
        else:  # final, a commentary preamble, or no channel at all
            self.region = CONTENT
            self.answer_open = True

    def _finish(self, parts: list) -> None:
        """The open message ended (or the generation did)."""
        if self.region == TOOL_CALL:
            call = ToolCall(self._recipient, self._args.strip())
            self.tool_calls.append(call)
            self.answer_open = True
            parts.append(Part(TOOL_CALL, call))
            self._recipient, self._args = None, ""
        self.region = "header"
        self._header = ""
