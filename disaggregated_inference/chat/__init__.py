"""Chat formats: how each model family's conversations are written, and how its answers are read.

A model's format is chosen when its engine loads it (``choose``): ``harmony``
for gpt-oss (its architecture, or harmony's markers in its template),
``qwen3_coder`` for a template that asks for Qwen3-Coder's ``<tool_call>``
blocks, else ``template`` (the model's own Jinja template, tools through a JSON
envelope); the config's ``chat_format`` option overrides the choice. The
format renders the conversation (a pure function: any thread may call it), and
per request an ``Output`` reads the generated tokens into answer, reasoning
and tool calls and tells the token loop when to end, when to move the model on
to its answer, and when a schema starts (output.py).

This layer imports nothing above ``errors.py``; engines hand it their template
renderer (a callable), so it imports no engine library either.
"""
from __future__ import annotations

from ..errors import ConfigError
from .base import ANSWER, CONTENT, REASONING, START, TOOL_CALL, ChatFormat, Parser, Part, Rendered
from .conversation import EFFORTS, Tool, ToolCall, Tools, parse_effort, parse_messages, parse_tools
from .harmony import Harmony
from .output import Output, reasoning_cap
from .qwen3_coder import Qwen3Coder
from .template import FALLBACK_TEMPLATES, Raw, TemplateFormat

FORMAT_NAMES = ("auto", "harmony", "qwen3_coder", "template")
RAW = Raw()

__all__ = ["ANSWER", "CONTENT", "EFFORTS", "FALLBACK_TEMPLATES", "FORMAT_NAMES", "RAW", "REASONING", "START",
           "TOOL_CALL", "ChatFormat", "Harmony", "Output", "Parser", "Part", "Qwen3Coder", "Raw", "Rendered",
           "TemplateFormat", "Tool", "ToolCall", "Tools", "choose", "for_output", "parse_effort", "parse_messages",
           "parse_tools", "reasoning_cap"]


def detect(arch: str | None, template: str | None) -> str:
    """The format a model speaks, from its architecture and its chat template's markers."""
    template = template or ""
    if arch == "gpt-oss" or ("<|channel|>" in template and "<|message|>" in template):
        return "harmony"
    if "<tool_call>" in template and "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    return "template"


def choose(setting: str, *, arch: str | None, template: str | None, make_renderer) -> ChatFormat | None:
    """The chat format of a model: ``setting`` (the ``chat_format`` option; ``auto`` detects it), its GGUF's
    architecture and chat template; ``make_renderer(template_source)`` builds a template renderer. None for a
    model with no template and no format of its own (its prompts must be raw)."""
    name = detect(arch, template) if setting == "auto" else setting
    if name == "harmony":
        return Harmony()
    if name not in ("qwen3_coder", "template"):
        raise ConfigError(f"chat_format must be one of {', '.join(FORMAT_NAMES)}, got {setting!r}",
                          field="chat_format")
    source, origin = template, "gguf"
    if not source and arch in FALLBACK_TEMPLATES:
        source, origin = FALLBACK_TEMPLATES[arch], f"builtin:{arch}"
    if not source:
        if name == "qwen3_coder":
            raise ConfigError("chat_format qwen3_coder renders with the model's own chat template, and this GGUF has "
                              "none", field="chat_format")
        return None
    cls = Qwen3Coder if name == "qwen3_coder" else TemplateFormat
    return cls(make_renderer(source), origin)


def for_output(name: str | None, own: ChatFormat | None) -> ChatFormat:
    """The format to read a generation with: the one its prompt was rendered with (``name``, from the prefill
    side), this engine's own when the name is its own or unknown, ``raw`` when neither exists."""
    if not isinstance(name, str):  # absent (bare token ids), or not a name a prefill server writes
        name = None
    if own is not None and (name is None or name == own.name):
        return own
    known = {"harmony": Harmony, "qwen3_coder": Qwen3Coder, "template": TemplateFormat, "raw": Raw}
    if name in known:
        return known[name]()
    return own or RAW
