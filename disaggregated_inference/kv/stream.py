"""The prefill side of a streamed handoff: a bundle whose payload becomes final piece by piece.

The overlapped handoff (docs/ARCHITECTURE.md, "The overlapped handoff") answers
``/prefill`` as soon as the prompt is tokenized and its slot taken; the decode
server then pulls ``/kv/<handle>`` while the prompt is still being evaluated.
The backend, on the model's thread, lays the payload out at its final size and
calls ``ready(segments)`` each time some of its bytes are final (llama.cpp: a
prompt chunk's rows, layer by layer; Transformers: a layer of a chunk); the
request thread that serves the pull sends each piece the moment it is ready
(``frames``), with its own checksum, then the trailer (the canary, the
prefill's measurements) and the end marker (``bundle.py``, version 2).

Every exit is accounted for: a prefill that fails half-way ends the stream
with an error frame (the decode side imports nothing and says so); a decode
server that goes away mid-stream (its connection breaks) abandons the bundle,
which cancels the prefill if it is still running and frees the lease
(``on_abandoned``).
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Iterator

from . import bundle

HEARTBEAT_SECONDS = 1.0  # a progress frame goes out when nothing else has for this long

FILLING, DONE, FAILED, ABANDONED = "filling", "done", "failed", "abandoned"


class StreamingBundle:
    """A bundle being produced: the backend's sink (``open``, ``ready``, ``progress``) and the sender's source.

    Thread-safe: the model's owner thread produces, one request thread sends.
    """

    def __init__(self):
        self._cond = threading.Condition()
        self.header: bundle.BundleHeader | None = None
        self.tokens: list = []
        self.payload = None
        self.pieces: list[list[tuple[int, int]]] = []
        self.done_tokens = 0
        self.state = FILLING
        self.trailer: dict = {}
        self.error: tuple[int, str] | None = None
        self.failure: BaseException | None = None  # what failed before the stream was open (for the /prefill answer)
        self.prefill_ended_at: float | None = None  # time.time() when the last payload byte became final
        self.claimed = False
        self.on_abandoned: Callable[[], None] = lambda: None
        self._settled: list[Callable[[str], None]] = []

    # -- the backend's side (the model's thread) ------------------------------------------------

    def open(self, kind: str, tokens: list, payload, fingerprint: dict, meta: dict) -> None:
        """The payload (at its final size: its bytes fill in later) and what the header says of it."""
        size = len(memoryview(payload).cast("B"))
        with self._cond:
            self.header = bundle.BundleHeader(kind=kind, n_tokens=len(tokens), payload_bytes=size, payload_crc32c=0,
                                              fingerprint=dict(fingerprint), meta=dict(meta))
            self.tokens, self.payload = list(tokens), payload
            self._cond.notify_all()

    def ready(self, segments) -> None:
        """These (offset, length) segments of the payload are final: one piece."""
        with self._cond:
            self.pieces.append(list(segments))
            self._cond.notify_all()

    def progress(self, tokens_done: int) -> None:
        with self._cond:
            self.done_tokens = tokens_done

    def ended(self) -> None:
        """The last payload byte is final (the prompt's evaluation is over; the canary may still run)."""
        with self._cond:
            self.prefill_ended_at = time.time()

    # -- the server's side ----------------------------------------------------------------------

    def wait_open(self, timeout: float) -> None:
        """Until the backend has opened the bundle; re-raises what failed before that."""
        with self._cond:
            self._cond.wait_for(lambda: self.header is not None or self.state != FILLING, timeout)
            if self.failure is not None:
                raise self.failure
            if self.header is None:
                raise RuntimeError(f"the prefill did not open its KV stream (within {timeout:g}s)")

    def on_settled(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(DONE or FAILED)`` once the prefill has ended (at once if it has)."""
        with self._cond:
            if self.state == FILLING:
                self._settled.append(callback)
                return
            state = self.state
        if state in (DONE, FAILED):
            callback(state)

    def _settle(self, state: str, **fields) -> None:
        with self._cond:
            if self.state != FILLING:
                return
            self.state = state
            for key, value in fields.items():
                setattr(self, key, value)
            callbacks, self._settled = self._settled, []
            self._cond.notify_all()
        for callback in callbacks:
            callback(state)

    def finish(self, trailer: dict) -> None:
        """The prefill ended: the trailer (meta for the header it could not carry yet, its metrics)."""
        self._settle(DONE, trailer=dict(trailer))

    def fail(self, code: int, message: str, failure: BaseException | None = None) -> None:
        """The prefill failed: the stream ends with an error frame (``code``, ``message``)."""
        self._settle(FAILED, error=(code, message), failure=failure)

    def abandon(self) -> None:
        """Nobody will take the rest (the puller went away, or the lease was given up): ``on_abandoned``
        cancels the prefill if it still runs and frees the lease."""
        with self._cond:
            was = self.state
            if was in (FILLING, DONE):
                self.state = ABANDONED
            self._cond.notify_all()
        if was in (FILLING, DONE):
            self.on_abandoned()

    def claim(self) -> bool:
        """The one pull this bundle allows; False when another has it already."""
        with self._cond:
            if self.claimed:
                return False
            self.claimed = True
            return True

    @property
    def nbytes(self) -> int:
        return self.header.payload_bytes if self.header is not None else 0

    # -- the sender -----------------------------------------------------------------------------

    def frames(self, on_sent: Callable[[], None], heartbeat: float = HEARTBEAT_SECONDS) -> Iterator[bytes]:
        """The streamed bundle as it happens (a WSGI body): each piece once it is ready, progress frames
        while there is none, then the trailer and the end marker, or an error frame.

        ``on_sent`` runs once the end marker was handed to the socket; a pull that breaks off before
        abandons the bundle."""
        sent, finished = 0, False
        try:
            yield bundle.encode_preamble(self.header, self.tokens, bundle.STREAMED_VERSION)
            view = memoryview(self.payload).cast("B")
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: len(self.pieces) > sent or self.state != FILLING, heartbeat)
                    new, state, done = self.pieces[sent:], self.state, self.done_tokens
                for segments in new:
                    head, parts = bundle.encode_piece(view, segments)
                    yield b"".join([head, *parts])  # a WSGI server writes bytes only: the one copy on this side
                    sent += 1
                if new:
                    continue
                if state == FILLING:
                    yield bundle.encode_progress(done)
                elif state == DONE:
                    trailer = dict(self.trailer)
                    if self.prefill_ended_at is not None:  # how long the tail took, on the sender's clock
                        trailer["prefill_ended_at"] = self.prefill_ended_at
                        trailer["send_tail_s"] = round(time.time() - self.prefill_ended_at, 6)
                    yield bundle.encode_trailer(trailer)
                    yield bundle.encode_stream_end(sent, sum(n for piece in self.pieces for _, n in piece))
                    finished = True
                    break
                else:  # failed, or abandoned from elsewhere (the lease was given up)
                    code, message = self.error or (499, "the KV stream was abandoned")
                    yield bundle.encode_error(code, message)
                    break
            if finished:
                on_sent()
        finally:
            if not finished:
                self.abandon()
