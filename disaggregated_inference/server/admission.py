"""Admission of work requests: /health and /metrics always keep a request thread.

gunicorn gives a server ``threads`` request threads. A work request (prefill,
decode, generate, a KV fetch) may hold its thread for a long time: reading a
slow client's body, waiting for the model thread, pulling a KV bundle. Work
requests are therefore admitted through a limit of ``threads - 1`` taken before
the body is read; beyond it the answer is 503 with ``Retry-After`` at once
(the client tries another server) and the last thread stays free for the
open endpoints.
"""
from __future__ import annotations

import threading

from flask import Flask, g, request

from ..errors import Overloaded

FREE_ENDPOINTS = {"health", "metrics", "static"}


class Admission:
    def __init__(self, slots: int):
        self.slots = max(1, slots)
        self._free = threading.BoundedSemaphore(self.slots)

    def enter(self) -> None:
        if not self._free.acquire(blocking=False):
            raise Overloaded(f"all {self.slots} work slots of this server are taken; try another server",
                             retry_after=1, close=True)

    def leave(self) -> None:
        self._free.release()


def install(app: Flask, threads: int) -> Admission:
    admission = Admission(threads - 1)

    @app.before_request
    def _admit():
        if request.endpoint in FREE_ENDPOINTS or request.endpoint is None:
            return
        admission.enter()
        g.disagg_admitted = True

    @app.after_request
    def _hold_until_sent(response):
        # a streamed answer keeps its slot until its last byte is sent (a whole answer is sent
        # without waiting on the model: its slot comes back at teardown); a direct-passthrough body
        # (the KV bundle, sent with sendfile) is handed to the server as it is, so nothing would
        # tell us when it is closed: its slot is given back when the view returns (teardown)
        if response.is_streamed and not response.direct_passthrough and g.pop("disagg_admitted", False):
            response.call_on_close(admission.leave)
        return response

    @app.teardown_request
    def _release(exc):
        if g.pop("disagg_admitted", False):
            admission.leave()

    return admission
