"""Answers that show their progress: heartbeat lines while a request waits or is evaluated.

A request sent with ``"progress": true`` is answered at once (200, NDJSON) and
then, until its answer comes, with a status line every ``HEARTBEAT_SECONDS``:

    {"status": "queued"}                                 waiting for a slot of the model
    {"status": "fetching"}                               pulling its KV bundle (decode)
    {"status": "prefill", "tokens": 812, "evaluated": 512}   its prompt being evaluated
    {"status": "decode", "generated": 41}                between tokens slower than the heartbeat

and then its answer's own lines: the prefill's answer as one line with
``"done": true``; a decode's text pieces and final line, as with ``"stream": true``.
An error, before the answer or during it, is the last line: the error's JSON body
with its HTTP ``status`` and ``"done": true``.

So a client tells a hung server (no line at all: a frozen process, a dead link)
from a busy one (heartbeats) in seconds, and a stuck model (heartbeats, but no
``evaluated`` or token advancing) from one that makes progress at the speed it has
shown, whatever the request's size; see ``client/`` and ``watch.py``; each line's type is in ``wire.py``.

The request's work runs on a helper thread of its own, so that its waits (a slot,
the model, a KV pull) need not be cut into slices; the request's HTTP thread
writes the lines. Nothing of Flask's request context is used by the work.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Iterator

from ..errors import DisaggError
from ..watch import HEARTBEAT_SECONDS
from ..wire import ErrorLine, Heartbeat

log = logging.getLogger(__name__)


class Progress:
    """What one request is doing now, as its heartbeat lines say. The request's work sets ``phase``;
    the model's owner thread counts the prompt tokens it evaluated (``evaluated``)."""

    __slots__ = ("phase", "tokens", "evaluated", "generated")

    def __init__(self, phase: str = "accepted"):
        self.phase, self.tokens, self.evaluated, self.generated = phase, None, 0, 0

    def line(self) -> dict:
        if self.phase == "prefill" and self.tokens is not None:
            return Heartbeat(self.phase, tokens=self.tokens, evaluated=self.evaluated).write()
        if self.phase == "decode":
            return Heartbeat(self.phase, generated=self.generated).write()
        return Heartbeat(self.phase).write()


def error_line(exc: BaseException) -> dict:
    """An error as the last line of a progress answer: its JSON body, its HTTP status, ``done``."""
    if isinstance(exc, DisaggError):
        return ErrorLine(exc.to_dict(), exc.status).write()
    log.error("request failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
    return ErrorLine({"error": f"internal error: {type(exc).__name__}: {exc}", "code": "internal_error"}, 500).write()


def lines(work: Callable[[Progress], Iterator[dict]], interval: float = HEARTBEAT_SECONDS) -> Iterator[dict]:
    """The lines of ``work(progress)`` (run on a helper thread), a heartbeat whenever the next one takes
    longer than ``interval``, and an error as the last line. Closing this iterator early (the client went
    away) has the work closed after its next line, which cancels what it waits for."""
    progress = Progress()
    out: queue.Queue = queue.Queue()
    gone = threading.Event()

    def run():
        produced = None
        try:
            produced = work(progress)
            for line in produced:
                out.put(("line", line))
                if gone.is_set():
                    break
            out.put(("end", None))
        except BaseException as exc:  # handed to the writing thread
            out.put(("error", exc))
        finally:
            close = getattr(produced, "close", None)  # a generator's; a plain iterator has nothing to close
            if close is not None:
                close()

    threading.Thread(target=run, name="request-work", daemon=True).start()
    try:
        while True:
            try:
                kind, value = out.get(timeout=interval)
            except queue.Empty:
                yield progress.line()
                continue
            if kind == "line":
                yield value
            elif kind == "error":
                yield error_line(value)
                return
            else:
                return
    finally:
        gone.set()
