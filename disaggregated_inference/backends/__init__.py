"""Backends are plugins registered by name; heavy libraries load only inside them.

``registry.py`` maps names to engine classes (built-ins, ``register()``, entry
points, ``DISAGG_PLUGINS``); ``base.py`` is the interface an engine fills and the
settings it extends; ``options.py`` reads the options an engine declares.
docs/ARCHITECTURE.md, "Adding an engine", walks through writing one.
"""
from __future__ import annotations

from .base import Backend, BatchedBackend, ChatSettings, Event, ModelSettings, Prefilled, Prompt, Received, Sampling, settings_class
from .options import option
from .registry import ENTRY_POINT_GROUP, backend_class, create, is_registered, names, register

__all__ = ["Backend", "BatchedBackend", "ChatSettings", "Event", "ModelSettings", "Prefilled", "Prompt", "Received", "Sampling",
           "settings_class", "option", "ENTRY_POINT_GROUP", "backend_class", "create", "is_registered", "names",
           "register"]
