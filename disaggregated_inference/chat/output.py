"""One generation as its chat format reads it: what an engine's token loop feeds, and what it asks.

A token loop (backends/llama_loop.py, backends/neutral_engine.py) makes one
``Output`` per request and hands it every token it samples (``take``: the
token's text, or None for a token the format ends generations with). The
``Step`` it gets back says what the token added (``Part``s: answer, reasoning,
tool calls, for the loop to yield), whether the generation is over, and what
text to feed the model with the next evaluation, unasked:

- a reasoning format's budget is spent: the format's ``answer_opener``
  (harmony: close the analysis, open the final channel), which the loop
  evaluates as if the model had written it (``fed``), and the model goes on
  with its answer;
- the model wrote an end token without ever beginning an answer or calling a
  tool: the same opener instead of the end (once), so an answer always comes.

Between steps the loop asks ``schema_due()``: the schema that constrains only
the answer, at the moment the answer opens (the loop starts its grammar there).

``stop`` strings apply to the answer only: text that might begin one is held
back; one found ends the answer before it (``stopped``).

The reasoning budget: ``reasoning_budget`` tokens when given, leaving at least
a quarter of the request's budget (``max_tokens``, within the context) to
the answer; by default half of it. Reasoning tokens are those written inside
reasoning messages, their headers included; the tokens the loop feeds are
counted apart (``forced_tokens``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .base import ANSWER, CONTENT, REASONING, START, TOOL_CALL, ChatFormat, Part
from .conversation import Tools
from ..metrics import ServerFigures


@dataclass
class Step:
    """What one sampled token did: the ``parts`` it added, whether it is output (``sampled``: not an end
    token), whether the generation is ``done``, and the text to ``feed`` the model now (or None)."""

    parts: list = field(default_factory=list)
    sampled: bool = True
    done: bool = False
    feed: str | None = None


def reasoning_cap(budget: int, given: int | None) -> int:
    """How many tokens a reasoning format may think for within a generation of ``budget`` tokens."""
    if given is None:
        return budget // 2
    return max(0, min(given, budget - max(1, budget // 4)))


class Output:
    def __init__(self, fmt: ChatFormat, *, budget: int, tools: Tools | None = None, json_schema: dict | None = None,
                 stop: tuple = (), reasoning_budget: int | None = None):
        self.format = fmt
        self.parser = fmt.parser(tools)
        schema, at = fmt.constraint(json_schema, tools)
        self.start_schema = schema if at == START else None      # constrains from the first token
        self.answer_schema = schema if at == ANSWER else None     # from the moment the answer opens
        self.cap = reasoning_cap(budget, reasoning_budget) if fmt.reasoning else None
        self.stop = tuple(stop)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""            # everything generated or fed, markers included
        self._answer = ""         # the answer, with what is held back (a stop string may begin there)
        self._sent = 0            # how much of it has been handed out
        self.reasoning: list[str] = []
        self.reasoning_tokens = 0
        self.forced_tokens = 0
        self.capped = False
        self.stopped = False
        self._header_tokens = 0
        self._ended_unanswered = False
        self._schema_started = False
        self._feeding = None  # why the text of the last Step is fed: "cap" or "end"

    @property
    def answer(self) -> str:
        """The answer as handed out so far."""
        return self._answer[:self._sent]

    @property
    def tool_calls(self) -> list:
        return self.parser.tool_calls

    # -- what the loop hands over ------------------------------------------------------------------

    def take(self, text: str | None) -> Step:
        """A sampled token: its text (special tokens' text as ``format.special_text`` says), or None when it is
        one of the format's end tokens."""
        if text is None:
            feed = self._opener_at_end()
            return Step(sampled=False, done=feed is None, feed=feed)
        parts = self.push(text)
        if self.stopped:
            return Step(parts, done=True)
        return Step(parts, feed=self._opener_for_cap())

    def push(self, text: str) -> list[Part]:
        """A sampled token's text (``take`` without the questions)."""
        before = self.parser.region
        parts = self._feed(text)
        self._count(before, self.parser.region)
        return parts

    def fed(self, text: str, n_tokens: int) -> list[Part]:
        """The loop fed the model ``text`` (``n_tokens`` tokens) itself: parsed, never counted as reasoning."""
        if self._feeding == "cap":
            self.capped = True
        elif self._feeding == "end":
            self._ended_unanswered = True
        self._feeding = None
        self.forced_tokens += n_tokens
        self._header_tokens = 0
        return self._feed(text)

    def close(self, rest: str = "") -> list[Part]:
        """The generation ended (``rest``: text its last token left in the loop's UTF-8 decoder): what the parser
        and the stop-string hold still had."""
        parts = self._feed(rest) if rest else []
        parts += self._filter(self.parser.close())
        if not self.stopped and len(self._answer) > self._sent:
            parts.append(Part(CONTENT, self._answer[self._sent:]))
            self._sent = len(self._answer)
        return parts

    # -- what the loop asks -----------------------------------------------------------------------

    def _opener_for_cap(self) -> str | None:
        if (self.cap is None or self.capped or self.format.answer_opener is None
                or self.parser.region != REASONING or self.reasoning_tokens < self.cap):
            return None
        self._feeding = "cap"
        return self.format.answer_opener

    def _opener_at_end(self) -> str | None:
        if self.format.answer_opener is None or self.parser.answer_open or self._ended_unanswered:
            return None
        self._feeding = "end"
        return self.format.answer_opener

    def schema_due(self) -> dict | None:
        """``answer_schema``, once: when the answer has just opened (then the loop starts its grammar)."""
        if self.answer_schema is not None and not self._schema_started and self.parser.region == CONTENT:
            self._schema_started = True
            return self.answer_schema
        return None

    def finish_reason(self, reason: str) -> str:
        """``tool_calls`` when the model ended by calling tools, else ``reason``."""
        return "tool_calls" if self.tool_calls and reason == "stop" else reason

    def metrics(self) -> ServerFigures:
        """What the format read of the generation: its name, the reasoning's tokens (capped or not), the tokens
        it fed."""
        return ServerFigures(chat_format=self.format.name, reasoning_tokens=self.reasoning_tokens,
                             reasoning_capped=self.capped if self.cap is not None else None,
                             forced_tokens=self.forced_tokens or None)

    # -- internals --------------------------------------------------------------------------------

    def _feed(self, text: str) -> list[Part]:
        self.text += text
        return self._filter(self.parser.feed(text))

    def _count(self, before: str, after: str) -> None:
        """Count a sampled token as reasoning when it falls in a reasoning message; a header's tokens count
        with the message the header turns out to open."""
        if before == REASONING:
            self.reasoning_tokens += 1
        elif before not in (CONTENT, TOOL_CALL):  # a header
            self._header_tokens += 1
            if after != before:
                if after == REASONING:
                    self.reasoning_tokens += self._header_tokens
                self._header_tokens = 0

    def _filter(self, parts: list[Part]) -> list[Part]:
        out = []
        for part in parts:
            if part.kind == CONTENT:
                piece = self._answer_piece(part.value)
                if piece:
                    out.append(Part(CONTENT, piece))
            else:
                if part.kind == REASONING:
                    self.reasoning.append(part.value)
                out.append(part)
        return out

    def _answer_piece(self, text: str) -> str:
        """Of the answer's next ``text``, what may be handed out now (stop strings held back and cut)."""
        if self.stopped:
            return ""
        sent = self._sent
        self._answer += text
        if self.stop:
            found = (self._answer.find(s, max(0, sent - self._hold)) for s in self.stop)
            cut = min((i for i in found if i >= 0), default=-1)
            if cut >= 0:
                self.stopped = True
                self._answer = self._answer[:cut]
                self._sent = cut
                return self._answer[sent:cut]
            upto = max(sent, len(self._answer) - self._hold)
        else:
            upto = len(self._answer)
        self._sent = upto
        return self._answer[sent:upto]
