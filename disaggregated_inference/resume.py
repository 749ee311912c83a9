"""An answer survives its decode server: a stream continued on another decode server of the model.

When the decode server of a stream dies (its connection breaks, or the stream ends without its
last line) or goes silent (``watch.py`` takes it as hung) after the first piece has arrived, and
another decode server of the model is up, the answer goes on there:

- the request is served again the way it was routed (``_serve_by_route``): a fresh prefill and
  a handoff where a prefill server is up, else decode-only on the other decode server;
- the new server's stream is read from its start, and the pieces the caller already has are
  checked against it and left out: the caller sees one answer, each piece once;
- the metrics say where the answer moved (``resumed``: from which decode server to which, after
  how many pieces, why) and how many tokens were recomputed to get back to where it broke (the
  prompt's, evaluated again, and the pieces regenerated); a warning says so.

How the continuation is made, and why so. The decode stream carries text pieces, not token ids
(``wire.Piece``: text, reasoning or a tool call), and the decode
servers take a raw token-id prompt (``/decode {"tokens"}``), but a fresh server fed prompt +
generated ids would start its chat format's reading of the output (a reasoning channel, a tool
call half read, text held back for a stop string, a partial UTF-8 character) from the beginning
in the middle of an answer. So the other server generates the answer again from the prompt (the
same token ids: the same model's tokenizer, or the prefill server's ``context``), and with
deterministic steps (``deterministic: true``, batch-invariant) the tokens it samples are those
of the first server: every piece up to the break is the same, then the answer goes on. That the
replayed pieces are the same is checked, not assumed: where they differ (a server without
deterministic steps, sampling without a seed) the stream ends with an error naming both servers,
never with an answer stitched from two different ones.
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import replace

from . import chat
from .errors import DisaggError, UpstreamError, UpstreamTimeout
from .metrics import Move, RequestMetrics
from .wire import Final, Piece

log = logging.getLogger(__name__)

MAX_MOVES = 2  # a stream moves at most this often (each move needs another decode server up)


class ResumeWarning(UserWarning):
    """A streamed answer was continued on another decode server after its own failed mid-answer."""


def resumable(exc: BaseException) -> bool:
    """A failure of the decode server itself, mid-stream: its connection broke, it went silent or made no
    progress. Not the caller's own deadline, and not an error the server answered (it would answer it again)."""
    if not isinstance(exc, (UpstreamError, UpstreamTimeout)):
        return False
    return bool(exc.details.get("transport")) and not exc.details.get("deadline")


class Continuation:
    """One streamed answer's lines, continued on another decode server when its own fails.

    ``served``: how the stream was opened (``client.Served``, its ``decode_server``); ``reopen()``: serve the
    request again, returning ``(Served, notes)`` with the new stream's ``lines``; ``others()``: the decode
    servers of the model that are up now; ``mark_down(server, message, hard=True)``: the client's."""

    def __init__(self, served, reopen, others, mark_down, max_moves: int = MAX_MOVES):
        self.served = served
        self._reopen, self._others, self._mark_down = reopen, others, mark_down
        self.max_moves = max_moves
        self.sent = {chat.CONTENT: "", chat.REASONING: ""}  # what the caller has, by kind
        self.calls: list = []  # the tool calls the caller has
        self.pieces = 0  # lines the caller has (not counting the last)
        self.moves: list[dict] = []
        self.notes: list[str] = []

    # -- the stream --------------------------------------------------------------------------------

    def lines(self, lines):
        """The stream's lines (``wire.Piece``, then ``wire.Final``, as ``_ndjson_lines`` gives them) through to
        the last one; a resumable failure before it continues the answer elsewhere, or raises as it did."""
        while True:
            try:
                try:
                    for line in lines:
                        if isinstance(line, Final):
                            yield line
                            return
                        self._note(line)
                        yield line
                    broken: DisaggError = UpstreamError(
                        f"{self.served.decode_server.entry.name} ended its stream without a final line", transport=True)
                except DisaggError as exc:
                    if not resumable(exc):
                        raise
                    broken = exc
            finally:
                lines.close()
            lines = self._move(broken)

    def _note(self, piece: Piece) -> None:
        self.pieces += 1
        if piece.tool_call is not None:
            self.calls.append(piece.tool_call)
        elif piece.reasoning is not None:
            self.sent[chat.REASONING] += piece.reasoning
        else:
            self.sent[chat.CONTENT] += piece.text or ""

    def _move(self, broken: DisaggError):
        """Serve the request again on another decode server; its lines from where the caller is."""
        failed = self.served.decode_server
        others = [s for s in self._others() if s is not failed]
        if len(self.moves) >= self.max_moves or not others:
            raise broken  # nowhere to go: the error as it was, at once
        self._mark_down(failed, broken.message, hard=True)
        log.warning("decode server failed mid-answer, continuing elsewhere: name=%s pieces=%d error=%s",
                    failed.entry.name, self.pieces, broken.message)
        try:
            served, notes = self._reopen()
        except DisaggError as exc:
            raise UpstreamError(f"{broken.message}; continuing the answer on another decode server failed: "
                                f"{exc.message}", transport=False) from None
        move = {"from_decode_server": failed.entry.address, "to_decode_server": served.decode_server.entry.address,
                "to_prefill_server": served.prefill_server.entry.address if served.prefill_server else None,
                "method": served.method, "after_pieces": self.pieces, "reason": broken.message,
                "pieces_replayed": 0}
        self.moves.append(move)
        self.notes.extend(notes)
        lines, served.lines = served.lines, None
        served.first_piece_at = self.served.first_piece_at  # the caller's first piece came from the first server
        self.served = served
        return self._caught_up(lines, move, failed.entry.name)

    def _caught_up(self, lines, move: dict, failed: str):
        """``lines`` of the new stream without what the caller already has (checked to be the same)."""
        at = {chat.CONTENT: 0, chat.REASONING: 0}
        calls = 0
        new = self.served.decode_server.entry.name
        sent, sent_calls = dict(self.sent), list(self.calls)  # what the caller had at the break (lines() adds on)
        try:
            for line in lines:
                if isinstance(line, Final):
                    if any(at[k] < len(sent[k]) for k in at) or calls < len(sent_calls):
                        raise self._diverged(failed, new, "its answer ended before reaching the break")
                    yield line
                    return
                if line.tool_call is not None:
                    if calls < len(sent_calls):
                        if line.tool_call != sent_calls[calls]:
                            raise self._diverged(failed, new, "a tool call differs")
                        calls += 1
                        move["pieces_replayed"] += 1
                        continue
                    yield line
                    continue
                kind, key = (chat.REASONING, "reasoning") if line.reasoning is not None else (chat.CONTENT, "text")
                value = getattr(line, key) or ""
                have = sent[kind]
                left = len(have) - at[kind]
                if left <= 0:
                    yield line
                    continue
                if not (have.startswith(value, at[kind]) if len(value) <= left else value.startswith(have[at[kind]:])):
                    raise self._diverged(failed, new, f"its {key} differs after {at[kind]} characters")
                at[kind] += min(left, len(value))
                move["pieces_replayed"] += 1
                if len(value) > left:  # this piece straddles the break: the caller gets the rest of it
                    yield replace(line, **{key: value[left:]})
        finally:
            lines.close()

    @staticmethod
    def _diverged(failed: str, new: str, what: str) -> UpstreamError:
        return UpstreamError(f"the answer could not be continued: {failed} failed mid-answer and {new}, serving it "
                             f"again, did not repeat it ({what}); the servers' steps are not deterministic "
                             "(set deterministic: true on the model) or the sampling has no seed")

    # -- what the caller is told -------------------------------------------------------------------

    def annotate(self, metrics: RequestMetrics) -> RequestMetrics:
        """A finished stream's ``metrics`` with where it moved and what that recomputed; warn once."""
        return describe(self.moves, metrics, self.notes)


def describe(moves: list[dict], metrics: RequestMetrics, notes=()) -> RequestMetrics:
    """``metrics`` with ``resumed`` (the moves as ``metrics.Move``, each with ``tokens_recomputed``: the prompt's
    tokens evaluated again and the pieces generated again), ``tokens_recomputed_by_moves`` and a warning per move."""
    if not moves:
        return metrics
    prompt_tokens = metrics.prompt_tokens or 0
    resumed = tuple(Move(from_decode_server=m["from_decode_server"], to_decode_server=m["to_decode_server"],
                         to_prefill_server=m["to_prefill_server"], method=m["method"],
                         after_pieces=m["after_pieces"], reason=m["reason"], pieces_replayed=m["pieces_replayed"],
                         tokens_recomputed=prompt_tokens + m["pieces_replayed"]) for m in moves)
    said = [f"decode server {m.from_decode_server} failed mid-answer ({m.reason}); the answer continued on "
            f"{m.to_decode_server} after {m.after_pieces} pieces ({m.tokens_recomputed} tokens recomputed: "
            f"the prompt's {prompt_tokens} and {m.pieces_replayed} pieces generated again)" for m in resumed]
    for line in said:
        warnings.warn(line, ResumeWarning, stacklevel=4)
    return replace(metrics, resumed=resumed, tokens_recomputed_by_moves=sum(m.tokens_recomputed for m in resumed),
                   warnings=(*metrics.warnings, *notes, *said))


# -- a whole answer (``generate``) -------------------------------------------------------------------
# ``generate`` reads a decode server's answer as a stream too (``_post``); one that breaks off is given up
# and the request served again on another decode server by the client's own failover (``_on``), from a
# fresh prefill or decode-only. What is kept here, per request (on the client's thread-local), is that it
# moved, after how many pieces, so that the answer's metrics say so as a stream's do.

def begin(local) -> None:
    """A request begins on this thread: no move yet."""
    local.moves = []


def broke_off(local, server, pieces: int, exc: BaseException) -> None:
    """``server``'s answer broke off after ``pieces`` pieces with ``exc``: a move, if another server serves it."""
    if pieces and resumable(exc) and getattr(local, "moves", None) is not None:
        local.moves.append({"from_decode_server": server.entry.address, "after_pieces": pieces,
                            "pieces_replayed": pieces, "reason": exc.message})


def finish(local, metrics: RequestMetrics) -> RequestMetrics:
    """The answer's metrics, with the moves its request made (``describe``)."""
    moves, local.moves = getattr(local, "moves", None) or [], None
    for move in moves:
        move.update(to_decode_server=metrics.decode_server, to_prefill_server=metrics.prefill_server,
                    method=metrics.method)
    return describe(moves, metrics)
