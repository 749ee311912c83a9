"""What every Flask app of the package (the prefill and decode servers, the gateway) does alike at its edge.

A request body's bytes are read within a time and a size (``read_body``), then
turned into JSON that every later step can walk safely (``parse_json``: a 400
naming ``body``, or the field at fault); a streamed answer goes out with
``STREAM_HEADERS``; ``arrival_limits`` is what the gunicorn worker (server/worker.py)
holds a request to before it gives it a thread.
"""
from __future__ import annotations

import hmac
import json
import math
import re
import socket
import time

from flask import request
from werkzeug.exceptions import ClientDisconnected, RequestEntityTooLarge

from .errors import BadRequest, PayloadTooLarge, RequestTimeout, Unauthorized

# Nesting of a whole request body (objects and arrays): far below what Python's recursive JSON encoder,
# the chat template and the grammar compiler reach (about 1,000), far above what any request needs (a
# json_schema at its own limit sits at depth 36 of an OpenAI body)
MAX_JSON_DEPTH = 128
_SURROGATE = re.compile("[\ud800-\udfff]")


class _Refused(ValueError):
    """Something JSON's grammar allows that a request body may not hold (duplicate keys, NaN, Infinity)."""


def _pairs(pairs: list) -> dict:
    seen = set()
    for key, _ in pairs:
        if key in seen:  # which one counts differs between parsers: refused, not guessed
            raise _Refused(f"duplicate key {key!r}: a body may name each key once")
        seen.add(key)
    return dict(pairs)


def _constant(name: str):
    raise _Refused(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"{text} is beyond the range of a number")
    return value


def parse_json(data: bytes):
    """A request body's bytes as JSON, or ``BadRequest``: malformed JSON or text that is not UTF-8
    (naming ``body``), duplicate keys, NaN or Infinity, a number beyond a float's range, nesting beyond
    ``MAX_JSON_DEPTH`` (naming ``body``), a string holding a lone surrogate (``"\\ud800"``, which no
    encoder downstream can write: naming the field, ``messages[0].content``)."""
    if not data:
        raise BadRequest("request body is empty; send a JSON object", field="body")
    try:
        value = json.loads(data, object_pairs_hook=_pairs, parse_constant=_constant, parse_float=_finite)
    except RecursionError:
        raise BadRequest(f"JSON body nested deeper than {MAX_JSON_DEPTH} levels", field="body") from None
    except _Refused as exc:
        raise BadRequest(f"JSON body refused: {exc}", field="body") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"malformed JSON body: {exc}", field="body") from None
    check_json(value)
    return value


def _field(path: tuple) -> str:
    name = ""
    for part in path:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name or "body"


def check_json(value, depth_limit: int = MAX_JSON_DEPTH) -> None:
    """Nesting within ``depth_limit`` (400 naming ``body``) and every string, keys included, encodable as
    UTF-8 (400 naming its field). Walked without recursion: a deep body cannot exhaust the stack here."""
    stack = [(value, 1, ())]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                check_text(node, _field(path))
            continue
        if depth > depth_limit:
            raise BadRequest(f"JSON body nested deeper than {depth_limit} levels", field="body")
        if isinstance(node, dict):
            for key, item in node.items():
                if _SURROGATE.search(key):
                    check_text(key, _field(path + (key,)))
                if isinstance(item, (str, dict, list)):
                    stack.append((item, depth + 1, path + (key,)))
        else:  # a list
            for i, item in enumerate(node):
                if isinstance(item, (str, dict, list)):
                    stack.append((item, depth + 1, path + (i,)))



def check_text(value: str, field: str) -> None:
    """A lone surrogate (JSON's "\\ud800") cannot be encoded as UTF-8: refuse it here, not in the tokenizer."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest(f"'{field}' is not valid text: {exc.reason} at character {exc.start}", field=field) from None


def arrival_limits(header_timeout: float, body_timeout: float, max_request_bytes: int) -> dict:
    """What the gunicorn worker (``worker.py``) holds a request to before it gives it a thread."""
    return {"header_timeout": header_timeout, "body_timeout": body_timeout, "max_body_bytes": max_request_bytes}


def read_body(limit: int, timeout: float) -> bytes:
    """The Flask request's body, read within ``timeout`` seconds in all (not per read: a client that
    trickles a byte at a time is cut off too) and at most ``limit`` bytes long."""
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"request body of {request.content_length} bytes; this server takes at most {limit}",
                              field="body", close=True)
    sock = request.environ.get("gunicorn.socket")
    deadline = time.monotonic() + timeout
    before = sock.gettimeout() if sock is not None else None
    chunks, size = [], 0
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if sock is not None:
                sock.settimeout(left)
            try:
                chunk = request.stream.read(min(1 << 20, limit + 1 - size))
            except RequestEntityTooLarge:  # a chunked body past MAX_CONTENT_LENGTH (Werkzeug counts it)
                raise PayloadTooLarge(f"request body over {limit} bytes", field="body", close=True) from None
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body over {limit} bytes", field="body", close=True)
    except ClientDisconnected:
        if time.monotonic() < deadline - 0.05:
            raise BadRequest("the client closed the connection before sending the whole body", field="body",
                             close=True) from None
        raise RequestTimeout(f"the request body did not arrive within {timeout:g}s",
                             field="body", close=True) from None
    except (socket.timeout, TimeoutError):
        raise RequestTimeout(f"the request body did not arrive within {timeout:g}s",
                             field="body", close=True) from None
    finally:
        if sock is not None:
            sock.settimeout(before)
    return b"".join(chunks)


# A streamed answer goes out line by line: a reverse proxy in front (nginx) must not hold it back, or the
# heartbeats by which a client tells a working server from a hung one (progress.py) would not reach it.
STREAM_HEADERS = {"X-Accel-Buffering": "no", "Cache-Control": "no-cache"}


def check_bearer(token: str) -> None:
    """The request's ``Authorization: Bearer`` against ``token`` (compared in constant time); both Flask apps."""
    given = request.headers.get("Authorization", "")
    if not given.startswith("Bearer ") or not hmac.compare_digest(given[7:].encode(), token.encode()):
        raise Unauthorized("missing or wrong API token (send 'Authorization: Bearer <token>')",
                           field="Authorization")
