"""gunicorn's ``gthread`` worker, with a request's head and body buffered before it gets a thread.

``gthread`` hands a connection to one of its request threads as soon as the
connection has a byte to read, and the thread then reads the request line and
headers itself, blocking: a client that sends its headers a byte every few
seconds (slowloris) holds a thread for as long as it likes, and 32 of them hold
a server (``/health`` included). nginx's answer is to buffer the request
(``client_header_timeout``, ``client_body_timeout``, ``proxy_request_buffering``);
this worker does the same inside gunicorn, on the worker's own poller thread:

- a connection's bytes are read by the poller, without blocking, until the head
  (request line and headers) is complete and, for a body of known length up to
  ``max_body_bytes``, the body too; only then is the connection handed to a
  request thread, its bytes given back to gunicorn's own HTTP parser, which
  parses them as if it had read them;
- a head not complete within ``header_timeout`` of the first byte (of the
  connection, for a new one) is answered ``408`` naming ``headers`` and closed;
  a body not complete within ``body_timeout`` of the head, ``408`` naming
  ``body`` (the JSON the servers answer errors with);
- a chunked body, a body above ``max_body_bytes`` (which the app refuses from its
  ``Content-Length`` without reading it) and a request that expects
  ``100-continue`` go to a thread once their head is in: the app's own body
  deadline (``server/web.py``'s ``read_body``) bounds them there.

The same happens to each further request of a kept-alive connection. What is
configured comes from the loaded app (``app.config["DISAGG_ARRIVAL"]``, set from
the ``server`` section of the config), so a server and the gateway apply their
own limits. TLS and HTTP/2 connections (neither used by these servers) are left
to ``gthread`` as it is.
"""
from __future__ import annotations

import json
import re
import selectors
import time
from functools import partial

from gunicorn import http
from gunicorn.http2 import negotiation
from gunicorn.workers.gthread import ThreadWorker

DEFAULTS = {"header_timeout": 10.0, "body_timeout": 10.0, "max_body_bytes": 8 << 20}
MAX_HEAD_BYTES = 64 << 10  # a longer request line and headers: 431 (nginx allows 32 KB by default)
MAX_BUFFERED_BYTES = 256 << 20  # bodies held by the poller at once; beyond, a body is read on its thread
HEAD_END = b"\r\n\r\n"
_CONTENT_LENGTH = re.compile(rb"^content-length[ \t]*:[ \t]*(\d+)[ \t]*$", re.I | re.M)
_CHUNKED = re.compile(rb"^transfer-encoding[ \t]*:.*chunked", re.I | re.M)
_CONTINUE = re.compile(rb"^expect[ \t]*:[ \t]*100-continue", re.I | re.M)


class _Arrival:
    """One request being read by the poller: its bytes so far, and the deadline they must meet."""

    __slots__ = ("conn", "data", "deadline", "head_end", "need", "what", "registered")

    def __init__(self, conn, data: bytes, deadline: float, what: str):
        self.conn, self.data, self.deadline, self.what = conn, bytearray(data), deadline, what
        self.head_end, self.need, self.registered = -1, 0, False


class BufferedThreadWorker(ThreadWorker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.arrivals: set[_Arrival] = set()
        self.buffered = 0  # bytes the arrivals hold
        self.limits = dict(DEFAULTS)

    def load_wsgi(self):
        super().load_wsgi()
        config = getattr(self.wsgi, "config", None) or {}
        self.limits.update(config.get("DISAGG_ARRIVAL") or {})

    def _buffering(self, conn) -> bool:
        return not (self.cfg.is_ssl or conn.is_http2 or negotiation.prior_knowledge_allowed(self.cfg, conn.client))

    def enqueue_req(self, conn):
        """Every hand-over to a request thread passes here: a request not buffered yet is read first."""
        if getattr(conn, "arrived", False) or not self._buffering(conn):
            conn.arrived = False
            super().enqueue_req(conn)
            return
        # a kept-alive connection's parser may hold bytes of the next request already
        held = conn.parser.unreader.take_buffered() if conn.parser is not None else b""
        # a new connection that sends nothing at all is closed silently at its deadline
        what = "connection" if not conn.initialized and not held else "headers"
        arrival = _Arrival(conn, held, time.monotonic() + self.limits["header_timeout"], what)
        self.arrivals.add(arrival)
        self.buffered += len(held)
        conn.sock.setblocking(False)
        if not self._complete(arrival):
            self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_readable, arrival))
            arrival.registered = True

    def _on_readable(self, arrival: _Arrival, sock) -> None:
        try:
            data = sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client went away
            self._drop(arrival, None)
            return
        if arrival.what == "connection":
            arrival.what = "headers"
        arrival.data += data
        self.buffered += len(data)
        self._complete(arrival)

    def _complete(self, arrival: _Arrival) -> bool:
        """Hand the request to a thread if it has arrived (True); else move it on to its body's wait."""
        data = arrival.data
        if arrival.head_end < 0:
            end = data.find(HEAD_END)
            if end < 0:
                if len(data) > MAX_HEAD_BYTES:
                    self._drop(arrival, error_answer(431, "Request Header Fields Too Large", "request_header_too_large",
                                                     f"request line and headers over {MAX_HEAD_BYTES} bytes",
                                                     "headers"))
                    return True
                return False
            arrival.head_end = end + len(HEAD_END)
            head = bytes(data[:end])
            length = _CONTENT_LENGTH.search(head)
            if (_CHUNKED.search(head) or _CONTINUE.search(head) or length is None
                    or int(length.group(1)) > self.limits["max_body_bytes"]
                    or self.buffered + int(length.group(1)) > MAX_BUFFERED_BYTES):
                return self._hand_over(arrival)
            arrival.need = arrival.head_end + int(length.group(1))
            arrival.what = "body"
            arrival.deadline = time.monotonic() + self.limits["body_timeout"]
        if len(data) < arrival.need:
            return False
        return self._hand_over(arrival)

    def _forget(self, arrival: _Arrival) -> None:
        self.arrivals.discard(arrival)
        self.buffered -= len(arrival.data)
        if arrival.registered:
            arrival.registered = False
            try:
                self.poller.unregister(arrival.conn.sock)
            except (KeyError, ValueError, OSError):
                pass

    def _hand_over(self, arrival: _Arrival) -> bool:
        conn = arrival.conn
        self._forget(arrival)  # out of the poller before a thread touches the socket
        if conn.parser is None:
            conn.parser = http.get_parser(self.cfg, conn.sock, conn.client)
        conn.parser.unreader.unread(bytes(arrival.data))
        conn.data_ready = True  # gthread would otherwise wait for the socket to be readable again
        conn.arrived = True
        self.enqueue_req(conn)
        return True

    def _drop(self, arrival: _Arrival, answer: bytes | None) -> None:
        """Close a connection whose request did not arrive; ``answer`` is sent first if the socket takes it."""
        self._forget(arrival)
        if answer:
            try:
                arrival.conn.sock.send(answer)
            except OSError:
                pass
        self.nr_conns -= 1
        arrival.conn.close()

    def murder_pending(self):
        super().murder_pending()
        now = time.monotonic()
        for arrival in [a for a in self.arrivals if a.deadline <= now]:
            if arrival.what == "connection":
                self._drop(arrival, None)
            else:
                timeout = self.limits["header_timeout" if arrival.what == "headers" else "body_timeout"]
                self._drop(arrival, error_answer(408, "Request Timeout", "request_timeout",
                                                 f"the request {arrival.what} did not arrive within {timeout:g}s",
                                                 arrival.what))


def error_answer(status: int, reason: str, code: str, message: str, field: str) -> bytes:
    """A whole HTTP response with the JSON error body the servers answer with, closing the connection."""
    body = json.dumps({"error": message, "code": code, "field": field}).encode()
    return (b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n" % (status, reason.encode(), len(body)) + body)
