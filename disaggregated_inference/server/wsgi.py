"""Gunicorn entry point: ``gunicorn 'disaggregated_inference.server.wsgi:create_app()'``.

The role and model come from the environment (see ``settings.resolve``).
"""
from __future__ import annotations

from .settings import resolve


def create_app(config=None):
    settings = resolve(config)
    if settings.role == "prefill":
        from .prefill import create_app as create
    else:
        from .decode import create_app as create
    return create(settings)
