"""Gunicorn entry point: ``gunicorn 'disaggregated_inference.gateway.wsgi:create_app()'``.

The config comes from ``$DISAGG_GATEWAY_CONFIG`` (a JSON text, as the local cluster
passes it) or the config file (``$DISAGG_CONFIG`` or ./config_current.json).
"""
from __future__ import annotations

from .app import create_app

__all__ = ["create_app"]
