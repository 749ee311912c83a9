"""What an engine's settings declare: each option's name, type, default, range and meaning.

An engine's settings are a frozen dataclass that extends ``ModelSettings``
(base.py) with the engine's own options, each a field made with ``option()``;
the type is the field's annotation. Whatever else knows about options reads
these declarations: the config's validation (``Option.check``), ``/health``
(``values``) and the documentation's table in docs/configuration.md (``table``;
tests/test_plugin_engine.py holds the two equal and prints the command that writes it).
"""
from __future__ import annotations

import copy
import json
import re
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from functools import lru_cache

from ..errors import ConfigError


def option(default, doc: str, *, low=None, above=None, choices=None, pattern: str | None = None,
           expected: str | None = None):
    """A settings field that is an option: its ``default``, what it does (``doc``, one line) and its range:
    at least ``low``, more than ``above``, one of ``choices``, or matching ``pattern`` (``expected`` says
    in words what the pattern admits)."""
    metadata = {"doc": doc, "low": low, "above": above, "choices": tuple(choices) if choices else None,
                "pattern": pattern, "expected": expected}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Option:
    name: str
    types: tuple  # the JSON value types a config may give (``None`` is never one: leave the key out instead)
    default: object
    doc: str
    low: float | None = None
    above: float | None = None
    choices: tuple | None = None
    pattern: str | None = None
    expected: str | None = None

    @property
    def type_name(self) -> str:
        return " or ".join(t.__name__ for t in self.types)

    def check(self, value, where: str, source: str) -> None:
        """Raise ``ConfigError`` naming ``where`` (``models.qwen.n_ctx``) unless ``value`` is admitted."""
        def refuse(what: str):
            raise ConfigError(f"{source}: {where} must be {what}, got {json.dumps(value)}", field=where)

        if not isinstance(value, self.types) or (isinstance(value, bool) and bool not in self.types):
            refuse(self.type_name)
        if self.low is not None and value < self.low:
            refuse(f"at least {self.low}")
        if self.above is not None and value <= self.above:
            refuse(f"more than {self.above}")
        if self.choices is not None and value not in self.choices:
            refuse(f"one of {', '.join(map(str, self.choices))}")
        if self.pattern is not None and not re.fullmatch(self.pattern, value):
            refuse(self.expected or f"like {self.pattern}")

    def describe_default(self) -> str:
        return "unset" if self.default is None else f"`{json.dumps(self.default)}`"

    def describe_range(self) -> str:
        """The range in words (``at least 1``, ``one of f16, q8_0``), or nothing."""
        parts = [f"at least {self.low}" if self.low is not None else "",
                 f"more than {self.above}" if self.above is not None else "",
                 f"one of {', '.join(f'`{c}`' for c in self.choices)}" if self.choices else "",
                 self.expected or ""]
        return "; ".join(p for p in parts if p)


def _json_types(annotation) -> tuple:
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) or \
        typing.get_origin(annotation) is typing.Union else (annotation,)
    found = []
    for t in args:
        if t is type(None):
            continue
        t = typing.get_origin(t) or t
        found.extend((int, float) if t is float else (t,))
    return tuple(dict.fromkeys(found))


@lru_cache(maxsize=None)
def declared(settings_class: type) -> dict[str, Option]:
    """The options a settings class declares (its own and the shared ones), by name, in field order."""
    hints = typing.get_type_hints(settings_class)
    found = {}
    for f in fields(settings_class):
        if "doc" not in f.metadata:
            continue  # a field that is no option (the model's public name)
        default = f.default_factory() if f.default is MISSING else f.default
        meta = f.metadata
        found[f.name] = Option(f.name, _json_types(hints[f.name]), default, meta["doc"], meta["low"], meta["above"],
                               meta["choices"], meta["pattern"], meta["expected"])
    return found


def values(settings) -> dict:
    """The options in effect of a settings object, by name."""
    return {name: getattr(settings, name) for name in declared(type(settings))}


def table(engines: dict[str, type]) -> str:
    """A Markdown table of the options of ``engines`` (name -> settings class): those every one of them
    declares first (the shared ones), then each engine's own."""
    shared = {name: o for name, o in declared(next(iter(engines.values()))).items()
              if all(name in declared(settings) for settings in engines.values())}
    rows = [(name, "every", o) for name, o in shared.items()]
    for engine, settings in engines.items():
        rows += [(name, engine, o) for name, o in declared(settings).items() if name not in shared]
    lines = ["| option | backend | type | default | range | what it sets |", "|---|---|---|---|---|---|"]
    for name, engine, o in rows:
        lines.append(f"| `{name}` | {engine} | {o.type_name} | {o.describe_default()} | {o.describe_range()} | "
                     f"{o.doc} |")
    return "\n".join(lines) + "\n"
