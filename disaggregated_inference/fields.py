"""Typed fields of a JSON request body: what the servers' parser and the gateway's both read with.

Each helper returns the field's value checked (or its default when it is absent or
null) and raises ``BadRequest`` naming the field as the request spelled it
(``where``: the object it sits in, e.g. ``"options."``).
"""
from __future__ import annotations

from .errors import BadRequest


def require_object(body) -> dict:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", field="body")
    return body


def typed(body: dict, key: str, kinds, default=None, *, what: str, where: str = ""):
    """``body[key]`` if it is of ``kinds`` (a boolean only where ``bool`` is one of them)."""
    value = body.get(key)
    if value is None:
        return default
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise BadRequest(f"'{where}{key}' must be {what}", field=f"{where}{key}")
    return value


def number(body: dict, key: str, default, lo, hi, *, integer: bool = False, where: str = ""):
    """A number (an integer with ``integer``) between ``lo`` and ``hi``."""
    value = typed(body, key, int if integer else (int, float), default, where=where,
                  what="an integer" if integer else "a number")
    if value is not None and not lo <= value <= hi:
        raise BadRequest(f"'{where}{key}' must be between {lo} and {hi}, got {value}", field=f"{where}{key}")
    return value


def known_keys(body: dict, allowed: set) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unknown field '{unknown[0]}' (allowed: {', '.join(sorted(allowed))})", field=unknown[0])


def stop_sequences(value, field: str) -> tuple:
    """``stop``: a string or a list of non-empty strings (None: none)."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) and s for s in value):
        raise BadRequest(f"'{field}' must be a string or a list of non-empty strings", field=field)
    return tuple(value)


def format_schema(value, field: str = "format", blank: bool = True) -> dict | None:
    """Ollama's ``format`` (also the design documents' spelling of ``json_schema``) as a JSON schema:
    ``"json"`` is any object, an object is the schema itself (None, or "" where ``blank``: no format)."""
    if value is None or (blank and value == ""):
        return None
    if value == "json":
        return {"type": "object"}
    if isinstance(value, dict):
        return value
    raise BadRequest(f"'{field}' must be \"json\" or a JSON schema object", field=field)
