"""Engines by name: the built-in ones, ``register()``ed ones, entry points and plugin modules.

A name maps to ``"package.module:ClassName"``; the module is imported the first
time the name is asked for, so importing the package never imports llama_cpp,
ollama, torch or mlx. Three ways in for an engine of another package:

- an entry point in the ``disaggregated_inference.backends`` group (name = the
  engine's name, value = ``"package.module:ClassName"``): an installed package's
  engine is known to every process of that environment;
- ``register(name, target)`` from code;
- ``DISAGG_PLUGINS``: a comma-separated list of modules imported before any
  name is looked up (each registers its engines with ``register()`` when it is
  imported), for a module on the path that is not an installed package. Every
  process a launcher starts inherits it, so servers know what the client knows.

A name is registered once: another target under a taken name is refused.
"""
from __future__ import annotations

import importlib
import os
from importlib.metadata import entry_points

from ..errors import ConfigError

ENTRY_POINT_GROUP = "disaggregated_inference.backends"
PLUGINS_VARIABLE = "DISAGG_PLUGINS"

_REGISTRY: dict[str, str] = {
    "llama_cpp": "disaggregated_inference.backends.llama_cpp:LlamaCppBackend",
    "ollama": "disaggregated_inference.backends.ollama:OllamaBackend",
    "mlx": "disaggregated_inference.backends.mlx:MlxBackend",
    "transformers": "disaggregated_inference.backends.transformers:TransformersBackend",
    "vllm": "disaggregated_inference.backends.vllm:VllmBackend",
}
BUILT_IN = tuple(_REGISTRY)
_plugins_loaded = False


def register(name: str, target) -> None:
    """Register an engine class, given as the class or as ``"package.module:ClassName"``.

    Registering the same target again is a no-op (a plugin module imported twice); another target
    under a name already taken raises ``ConfigError``.
    """
    if not isinstance(target, str):
        target = f"{target.__module__}:{target.__qualname__}"
    known = _REGISTRY.get(name)
    if known is not None and known != target:
        raise ConfigError(f"backend {name!r} is already registered (as {known}); cannot register {target}",
                          field="backend")
    _REGISTRY[name] = target


def _load_plugins() -> None:
    global _plugins_loaded
    if not _plugins_loaded:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            register(ep.name, ep.value)
        _plugins_loaded = True
    for module in filter(None, (m.strip() for m in os.environ.get(PLUGINS_VARIABLE, "").split(","))):
        try:
            importlib.import_module(module)  # a dictionary lookup once it is imported
        except ImportError as exc:
            raise ConfigError(f"{PLUGINS_VARIABLE} names {module!r}, which cannot be imported: {exc}",
                              field=PLUGINS_VARIABLE) from None


def names() -> list[str]:
    """Every registered engine: the built-ins, ``register()``ed ones, entry points and plugin modules'."""
    _load_plugins()
    return sorted(_REGISTRY)


def backend_class(name: str) -> type:
    """The engine class registered as ``name`` (a ``Backend`` subclass), its module imported now."""
    _load_plugins()
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown backend {name!r} (registered: {', '.join(names())})", field="backend") from None
    module_name, _, class_name = target.partition(":")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"backend {name!r} is registered as {target}, which cannot be imported: {exc}",
                          field="backend") from None


def is_registered(name: str) -> bool:
    _load_plugins()
    return name in _REGISTRY


def create(settings):
    """A backend for ``settings`` (a ``ModelSettings``), not loaded yet."""
    return backend_class(settings.backend)(settings)
