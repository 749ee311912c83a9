"""The one error hierarchy of the project.

Every error knows the HTTP status it maps to and, where it is about one field of
a request or a config file, the name of that field. Servers turn these into JSON
bodies in one place (``web.py``); the CLI turns them into exit codes.
"""
from __future__ import annotations


class DisaggError(Exception):
    """Base class: ``status`` is the HTTP status, ``code`` a stable machine name."""

    status = 500
    code = "internal_error"

    def __init__(self, message: str, *, field: str | None = None, **details):
        super().__init__(message)
        self.message = message
        self.field = field
        self.details = details

    def to_dict(self) -> dict:
        body = {"error": self.message, "code": self.code}
        if self.field:
            body["field"] = self.field
        body.update(self.details)
        return body


class BadRequest(DisaggError):
    status, code = 400, "bad_request"


class Unauthorized(DisaggError):
    status, code = 401, "unauthorized"


class Forbidden(DisaggError):
    """The request asks for something this server will not do for anyone (e.g. fetch from an untrusted host)."""

    status, code = 403, "forbidden"


class PayloadTooLarge(DisaggError):
    status, code = 413, "payload_too_large"


class RequestTimeout(DisaggError):
    """The client did not send its request body in time."""

    status, code = 408, "request_timeout"


class UnsupportedMediaType(DisaggError):
    status, code = 415, "unsupported_media_type"


class NotFound(DisaggError):
    status, code = 404, "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class LeaseExpired(DisaggError):
    """The KV bundle existed but its lease ran out before it was fetched."""

    status, code = 410, "lease_expired"


class FingerprintMismatch(DisaggError):
    """A KV bundle was produced by another model, library or cache layout."""

    status, code = 409, "fingerprint_mismatch"


class BundleError(DisaggError):
    """A KV bundle is truncated, corrupted or not a bundle at all."""

    status, code = 422, "bad_bundle"


class CanaryMismatch(BundleError):
    """The imported KV does not reproduce the prefill side's next-token distribution (kv/canary.py):
    intact bytes, wrong state. Nothing is generated from it; the client recomputes."""

    code = "canary_mismatch"


class ContextOverflow(BadRequest):
    code = "context_overflow"


class Overloaded(DisaggError):
    """The model thread could not pick the work up in time: try another server."""

    status, code = 503, "overloaded"


class BackendUnavailable(DisaggError):
    """The model (or the daemon behind it) is not there or not loaded yet."""

    status, code = 503, "backend_unavailable"


class UpstreamError(DisaggError):
    """Another server (a peer or Ollama) answered with an error."""

    status, code = 502, "upstream_error"


class UpstreamTimeout(DisaggError):
    status, code = 504, "upstream_timeout"


class ConfigError(DisaggError):
    """A configuration file or setting is invalid; the message names file and key."""

    code = "config_error"


class NoServerAvailable(DisaggError):
    """The client found no server able to serve a request."""

    status, code = 503, "no_server_available"


class GradingError(DisaggError):
    """The grading application could not do what was asked (not a bad submission: those are results)."""

    code = "grading_error"


class RubricError(GradingError):
    """A rubric file is invalid; the message names the file and the key."""

    code = "rubric_error"


class GradingStopped(GradingError):
    """A model request of the grader was abandoned because the batch is stopping (Ctrl-C, a stop button)."""

    status, code = 499, "grading_stopped"


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def from_body(status: int, body: dict) -> DisaggError:
    """Rebuild the error a server answered (its JSON body) as the class with that code."""
    body = dict(body) if isinstance(body, dict) else {"error": str(body)}
    code = body.pop("code", None)
    message = body.pop("error", None) or f"HTTP {status}"
    field = body.pop("field", None)
    cls = next((c for c in _subclasses(DisaggError) if c.code == code), None)
    err = (cls or DisaggError)(message, field=field, **body)
    if cls is None or cls.status != status:  # an unknown code, or a status the class does not carry
        err.status = status
        err.code = code or err.code
    return err
