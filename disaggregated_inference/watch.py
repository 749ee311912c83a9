"""When the client gives up on a server's answer: deadlines from what is known, not from the worst case.

The client asks every server for progress lines (``"progress": true``,
server/progress.py): a heartbeat every second while a request waits or its prompt
is evaluated (with the prompt tokens evaluated so far), then the answer's lines.
A ``Watch`` reads them and stops waiting, with an ``UpstreamTimeout``, when:

- **the server is silent**: no line at all for ``silence`` seconds (the client's
  ``progress_timeout``, 5 s by default, against a heartbeat a second): a frozen
  process, a dead link, a machine gone. Marked ``stalled``: the server is taken
  out of service until it answers again;
- **the server makes no progress**: heartbeats come, but the prompt's evaluated
  tokens (or, decoding, the pieces) have not advanced for ``PROGRESS_FACTOR``
  times what the rest should take at the speed this server has shown (the
  routing cost model's figures; never less than ``silence``): a stuck model.
  Marked ``stalled`` too. Waiting for a slot and pulling a KV bundle have their
  own bounds on the server (``queue_timeout``: 503; ``kv_progress_timeout``: 504);
- **the caller's own deadline** passes (``prefill_timeout``, ``decode_timeout``):
  marked ``deadline``. The server was working: it is not blamed. A decode server
  given a streamed KV (the overlapped handoff) waits for the prefill to produce
  it: until it moves on from that wait (``WAITING``), it has the prefill's
  allowance too, and the caller's ``decode_timeout`` starts afresh from there.
"""
from __future__ import annotations

import time

from .errors import UpstreamTimeout
from .wire import Answer, ErrorLine, Final, Heartbeat, read_line

# seconds between a server's heartbeat lines while a request waits or is evaluated (server/progress.py
# sends them, a Watch reads them): the protocol's one constant both sides share
HEARTBEAT_SECONDS = 1.0

PROGRESS_FACTOR = 4.0  # "several times what its size should take"
WAITING = ("accepted", "queued", "fetching", "importing")  # a server's phases before its answer's own work


class Watch:
    def __init__(self, name: str, silence: float, timeout: float | None, what: str,
                 prompt_speed: float | None = None, decode_speed: float | None = None, lifted: bool = False,
                 waiting: float | None = None):
        """``lifted``: the deadline will be lifted mid-answer (``lift_deadline``: a stream, once its first
        piece is in), so reads may wait for the whole silence allowed whatever the deadline. ``waiting``: more
        time allowed while the server is still in a ``WAITING`` phase (a streamed KV's prefill); once it
        has moved on, the deadline is ``timeout`` from then."""
        now = time.monotonic()
        self.name, self.silence, self.timeout, self.what, self.lifted = name, silence, timeout, what, lifted
        self.deadline = now + timeout + (waiting or 0.0) if timeout else None
        self.waiting = waiting
        self.prompt_speed, self.decode_speed = prompt_speed, decode_speed
        self.heard_at = self.advanced_at = now
        self.phase, self.evaluated = None, -1

    def read_timeout(self) -> float:
        """How long one read may wait for the next line: the silence allowed, within the deadline (which
        lines, a heartbeat a second, also check as they come)."""
        if self.deadline is None or self.lifted:
            return self.silence
        return max(0.05, min(self.silence, self.deadline - time.monotonic()))

    def lift_deadline(self) -> None:
        """No caller's deadline from now on (a stream whose pieces the caller now sees come)."""
        self.deadline = None

    def heard(self, line) -> bool:
        """Account for one line (a ``wire`` line, or its JSON); True when it was a heartbeat (nothing for the
        caller). Raises ``UpstreamTimeout`` when the answer is to be given up (see the module's docstring)."""
        if isinstance(line, dict):
            line = read_line(line)
        now = self.heard_at = time.monotonic()
        heartbeat = isinstance(line, Heartbeat)
        status = line.status if heartbeat else None
        if self.waiting is not None and not (heartbeat and status in WAITING):
            self.waiting = None  # the wait for the KV is over: the caller's own deadline from now
            if self.deadline is not None:
                self.deadline = now + self.timeout
        if not heartbeat:
            self.advanced_at = now  # a piece, or the answer
        else:
            if status != self.phase:
                self.phase, self.advanced_at, self.evaluated = status, now, -1
            evaluated = line.evaluated
            if status == "prefill" and isinstance(evaluated, int) and evaluated > self.evaluated:
                self.evaluated, self.advanced_at = evaluated, now
            limit = self._progress_limit(line)
            if limit is not None and now - self.advanced_at > limit:
                raise UpstreamTimeout(f"{self.name} made no progress ({status}) for {now - self.advanced_at:.1f}s, "
                                      f"over {PROGRESS_FACTOR:g} times what the rest should take at its speed",
                                      transport=True, stalled=True)
        done = isinstance(line, (Final, ErrorLine, Answer))
        if self.deadline is not None and now >= self.deadline and not done:  # an answer in time counts
            raise self.caller_deadline()
        return heartbeat

    def _progress_limit(self, line: Heartbeat) -> float | None:
        if line.status == "prefill" and self.prompt_speed and isinstance(line.tokens, int):
            left = max(1, line.tokens - max(0, self.evaluated))
            return max(self.silence, PROGRESS_FACTOR * left / self.prompt_speed)
        if line.status == "decode" and self.decode_speed:
            return max(self.silence, PROGRESS_FACTOR / self.decode_speed)
        return None  # waiting for a slot, a KV pull, an import: bounded on the server

    def timed_out(self) -> UpstreamTimeout:
        """The error for a read that waited ``read_timeout()`` and got nothing."""
        if self.deadline is not None and time.monotonic() >= self.deadline - 0.01:
            return self.caller_deadline()
        return UpstreamTimeout(f"{self.name} sent nothing for {time.monotonic() - self.heard_at:.1f}s (it sends a "
                               "heartbeat every second while it works): taken as hung", transport=True, stalled=True)

    def caller_deadline(self) -> UpstreamTimeout:
        return UpstreamTimeout(f"the caller's {self.what} ({self.timeout:g}s) ran out before {self.name} had answered "
                               "(it had not been silent long enough to be taken as hung)", transport=True,
                               deadline=True)
