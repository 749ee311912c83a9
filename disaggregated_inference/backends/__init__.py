"""Backends are plugins registered by name; heavy libraries load only inside them.

A backend module is imported the first time its name is asked for, so importing
the package never imports llama_cpp, ollama, torch or mlx.
"""
from __future__ import annotations

import importlib

from ..errors import ConfigError
from .base import Backend, Event, ModelSettings, Prefilled, Prompt, Received, Sampling  # noqa: F401

# name -> "module:Class"; third-party backends can add themselves with register().
_REGISTRY: dict[str, str] = {
    "llama_cpp": "disaggregated_inference.backends.llama_cpp:LlamaCppBackend",
    "ollama": "disaggregated_inference.backends.ollama:OllamaBackend",
}


def register(name: str, target: str) -> None:
    """Register a backend class given as ``"package.module:ClassName"``."""
    _REGISTRY[name] = target


def names() -> list[str]:
    return sorted(_REGISTRY)


def backend_class(name: str) -> type[Backend]:
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown backend {name!r} (registered: {', '.join(names())})", field="backend") from None
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def create(settings: ModelSettings) -> Backend:
    return backend_class(settings.backend)(settings)
