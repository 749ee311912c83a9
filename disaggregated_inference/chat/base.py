"""What every chat format provides, and the incremental parsing they share.

A ``ChatFormat`` is one model family's conversation format: it renders a
conversation into the prompt text the model was trained on (``render``), and
makes, per request, a ``Parser`` that reads the generated text as it comes,
token by token, and splits it into ``Part``s: the answer (``content``), the
chain of thought (``reasoning``) and the tool calls (``tool_call``). The token
loops feed each token's text (special tokens' text included where
``special_text`` says the parser needs it) and never show a marker to anyone.

A format also says how generation ends (``end_texts``: tokens that end it
besides the vocabulary's own end-of-generation tokens; ``continue_texts``:
vocabulary end tokens that do not end it here), what moves a reasoning model
on to its answer (``answer_opener``), and when a JSON schema starts to
constrain the output (``constraint``: from the first token, or only once the
answer opens).

Rendering is a pure function of (messages, tools, options): it may run on any
thread.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .conversation import Tools, ToolCall

CONTENT, REASONING, TOOL_CALL = "content", "reasoning", "tool_call"
START, ANSWER = "start", "answer"  # when a schema starts to constrain the output


@dataclass(frozen=True)
class Rendered:
    text: str
    stops: tuple = ()      # stop strings the template adds (an end-of-turn text)
    add_bos: bool = True   # whether the tokenizer should add its BOS (a template that wrote one says no)


@dataclass(frozen=True)
class Part:
    kind: str      # CONTENT, REASONING or TOOL_CALL
    value: object  # text, or a ToolCall


class Parser:
    """Reads one generation's text incrementally. ``feed`` takes any piece of text (a token's, or several
    tokens', split anywhere); ``close`` ends it. ``region`` is where the next text will fall: ``content``,
    ``reasoning``, ``tool_call`` or ``header`` (a format's own markup between messages)."""

    region: str = CONTENT

    def __init__(self):
        self.tool_calls: list[ToolCall] = []
        self.answer_open = False  # the answer (content) has begun, or a tool was called

    def feed(self, text: str) -> list[Part]:
        raise NotImplementedError

    def close(self) -> list[Part]:
        return []


class PlainParser(Parser):
    """Everything is the answer."""

    def feed(self, text: str) -> list[Part]:
        if text:
            self.answer_open = True
            return [Part(CONTENT, text)]
        return []


class ChatFormat:
    name: ClassVar[str]
    reasoning: ClassVar[bool] = False       # a reasoning channel: reasoning_effort and the reasoning budget apply
    special_text: ClassVar[bool] = False    # the parser reads special tokens' text
    end_texts: ClassVar[tuple] = ()
    continue_texts: ClassVar[tuple] = ()
    answer_opener: ClassVar[str | None] = None
    source: str | None = None  # where its rendering comes from (gguf, builtin:ARCH), as /health reports it

    def render(self, messages, *, tools: Tools | None = None, reasoning_effort: str | None = None) -> Rendered:
        raise NotImplementedError

    def parser(self, tools: Tools | None) -> Parser:
        return PlainParser()

    def constraint(self, json_schema: dict | None, tools: Tools | None) -> tuple:
        """(the JSON schema that constrains the output, or None; START or ANSWER: from when)."""
        return json_schema, START


def take(buf: str, markers: tuple) -> tuple[str, str | None, str]:
    """Split ``buf`` at its first marker: ``(text before it, the marker, the rest)``. When no marker is
    complete but ``buf`` ends with what may begin one, that end is the rest and the marker is None: hold it
    until more text comes. Every marker starts with ``<``."""
    i = 0
    while True:
        j = buf.find("<", i)
        if j < 0:
            return buf, None, ""
        for marker in markers:
            if buf.startswith(marker, j):
                return buf[:j], marker, buf[j + len(marker):]
        if any(marker.startswith(buf[j:]) for marker in markers):
            return buf[:j], None, buf[j:]
        i = j + 1
