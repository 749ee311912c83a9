"""Backends are plugins registered by name; heavy libraries load only inside them.

A backend module is imported the first time its name is asked for, so importing
the package never imports llama_cpp, ollama, torch or mlx. The built-in ones are
registered here; another package adds its own with ``register()`` or with an
entry point in the ``disaggregated_inference.backends`` group (name = backend
name, value = ``"package.module:ClassName"``), and a config may then name it.
"""
from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from ..errors import ConfigError
from .base import Backend, Event, ModelSettings, Prefilled, Prompt, Received, Sampling  # noqa: F401

# name -> "module:Class"; third-party backends can add themselves with register().
_REGISTRY: dict[str, str] = {
    "llama_cpp": "disaggregated_inference.backends.llama_cpp:LlamaCppBackend",
    "ollama": "disaggregated_inference.backends.ollama:OllamaBackend",
    "mlx": "disaggregated_inference.backends.mlx:MlxBackend",
    "transformers": "disaggregated_inference.backends.transformers:TransformersBackend",
}


ENTRY_POINT_GROUP = "disaggregated_inference.backends"
_plugins_loaded = False


def register(name: str, target: str) -> None:
    """Register a backend class given as ``"package.module:ClassName"``."""
    _REGISTRY[name] = target


def _load_entry_points() -> None:
    global _plugins_loaded
    if not _plugins_loaded:
        _plugins_loaded = True
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            _REGISTRY.setdefault(ep.name, ep.value)


def names() -> list[str]:
    """Every registered backend: the built-ins, ``register()``ed ones and installed entry points."""
    _load_entry_points()
    return sorted(_REGISTRY)


def backend_class(name: str) -> type[Backend]:
    _load_entry_points()
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown backend {name!r} (registered: {', '.join(names())})", field="backend") from None
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def create(settings: ModelSettings) -> Backend:
    return backend_class(settings.backend)(settings)
