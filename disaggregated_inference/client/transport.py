"""The client's transport: one pooled HTTP session per thread, answers read as progress lines.

Every request asks its server for progress (``"progress": true``, server/progress.py)
and reads the answer's NDJSON lines as ``wire`` types (``_ndjson_lines``): heartbeats
go to a ``Watch`` (watch.py), which gives up on a silent or stuck server; an error
line raises as the error it is; a decode stream's pieces are collected (``_Pieces``)
into its answer.
"""
from __future__ import annotations

import json
import time

import requests
from requests.adapters import HTTPAdapter
from urllib3.exceptions import NewConnectionError, ReadTimeoutError

from .. import chat
from .. import resume  # issue 42: an answer survives its decode server
from ..errors import DisaggError, UpstreamError, UpstreamTimeout, from_body
from ..watch import Watch
from ..wire import Answer, DecodeAnswer, ErrorLine, Final, Piece, read_line
from .servers import TrackedServer


def _connect_failed(exc: requests.RequestException) -> bool:
    """The connection was never made (refused, unreachable, connect timeout): nothing was sent."""
    reason = getattr(exc.args[0], "reason", None) if exc.args else None
    return isinstance(exc, requests.ConnectTimeout) or isinstance(reason, NewConnectionError)


def _answered(server: TrackedServer, status: int, data: dict) -> DisaggError:
    """The error a server answered (with its HTTP status, or as a progress stream's last line)."""
    err = from_body(status, data)
    err.message = f"{server.entry.name} answered {status}: {err.message}"
    err.args = (err.message,)
    return err


class Transport:
    """HTTP to the servers (``DisaggregatedClient``'s part; it sets ``_local``, ``api_token``, ``costs``, the
    timeouts)."""

    @property
    def session(self) -> requests.Session:
        """One pooled keep-alive session per thread (requests.Session is not thread-safe)."""
        session = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            session.mount("http://", HTTPAdapter(pool_connections=16, pool_maxsize=16))
            if self.api_token:
                session.headers["Authorization"] = f"Bearer {self.api_token}"
            self._local.session = session
        return session

    def _post(self, server: TrackedServer, path: str, body: dict, timeout: float) -> dict:
        """One request's whole answer from ``server``, as JSON: the /prefill answer (``wire.PrefillAnswer``),
        or a /decode or /generate one (``wire.DecodeAnswer``), read as progress lines (``_lines``) so that a
        hung or stuck server is given up in seconds; ``timeout`` is the caller's deadline for it."""
        started = time.perf_counter()
        stream = path != "/prefill"
        watch = self._watch(server, path, timeout, body=body)
        lines = self._lines(server, path, {**body, "stream": True} if stream else body, watch)
        answer, pieces = None, _Pieces()
        try:
            if not stream:
                line = next(lines, None)
                answer = line.body if isinstance(line, Answer) else None
            else:
                for line in lines:
                    if isinstance(line, Final):
                        answer = pieces.answer(line).write()
                        break
                    pieces.add(line)
        except DisaggError as exc:  # resume hook: an answer that broke off mid-way (resume.py)
            resume.broke_off(self._local, server, pieces.count, exc)
            raise
        finally:
            lines.close()
        if answer is None:
            raise UpstreamError(f"{server.entry.name} ended its answer without a final line", transport=True)
        server.latency_s = round(time.perf_counter() - started, 4)
        return answer

    def _watch(self, server: TrackedServer, path: str, timeout: float | None, lifted: bool = False,
               body: dict | None = None) -> Watch:
        """What a request to ``server`` may take: silence (``progress_timeout``), progress at the speeds this
        server has shown (the cost model's, or its /health's), and the caller's ``timeout`` (``lifted``
        once a stream's first piece is in); a decode of a streamed KV (``body``) also has the prefill's own
        allowance while it waits for that KV to be made."""
        prompt_speed, decode_speed = self.costs.server_speeds(server.entry.name)
        streamed = ((body or {}).get("kv") or {}).get("mode") == "streamed"
        return Watch(server.entry.name, self.progress_timeout, timeout,
                     "prefill_timeout" if path == "/prefill" else "decode_timeout",
                     prompt_speed or server.health.get("prompt_speed"), decode_speed, lifted,
                     waiting=self.prefill_timeout if streamed else None)

    def _lines(self, server: TrackedServer, path: str, body: dict, watch: Watch):
        """POST ``body`` asking for progress (server/progress.py); yield the answer's lines, heartbeats left to
        ``watch``. An error the server answers, with its status or as a line before the answer, raises as
        that error (so that ``_on`` treats both alike); silence, no progress or the caller's deadline raise
        ``UpstreamTimeout`` (``watch.py``)."""
        url = server.entry.url + path
        try:
            resp = self.session.post(url, json={**body, "progress": True}, stream=True,
                                     timeout=(self.connect_timeout, watch.read_timeout()))
        except requests.ConnectTimeout as exc:
            raise UpstreamTimeout(f"{server.entry.name} ({url}) did not accept the connection within "
                                  f"{self.connect_timeout:g}s", transport=True, connect_failed=True) from None
        except requests.Timeout:
            raise watch.timed_out() from None
        except requests.RequestException as exc:
            raise UpstreamError(f"{server.entry.name} ({url}) unreachable: {type(exc).__name__}",
                                transport=True, connect_failed=_connect_failed(exc)) from None
        if resp.status_code != 200:
            try:
                data = resp.json()
            except ValueError:
                data = {"error": resp.text[:300]}
            finally:
                resp.close()
            raise _answered(server, resp.status_code, data)
        yield from _ndjson_lines(resp, server, watch)

    def _open_stream(self, server: TrackedServer, path: str, body: dict, timeout: float):
        """POST a streaming request; return its lines once the first one (not a heartbeat) has arrived.

        Errors before it (a status code, or an error line) raise here, so that ``_on`` can try another
        server; ``timeout`` (the caller's ``decode_timeout``) bounds the wait for it, and no more: from
        then on the caller sees the pieces come, and only silence or no progress ends the stream."""
        started = time.perf_counter()
        watch = self._watch(server, path, timeout, lifted=True, body=body)
        lines = self._lines(server, path, body, watch)
        try:
            head = next(lines)
        except StopIteration:
            raise UpstreamError(f"{server.entry.name} sent an empty stream", transport=True) from None
        except BaseException:
            lines.close()
            raise
        watch.lift_deadline()
        server.latency_s = round(time.perf_counter() - started, 4)
        return _prepend(head, lines)


class _Pieces:
    """A decode server's answer as its stream's lines bring it (``wire.Piece``): text pieces, reasoning and
    tool calls, which ``answer`` gives back whole (``wire.DecodeAnswer``) once the last line is in."""

    def __init__(self):
        self.text, self.reasoning, self.calls = [], [], []

    @property
    def count(self) -> int:
        """Pieces kept so far (resume hook)."""
        return len(self.text) + len(self.reasoning) + len(self.calls)

    def add(self, piece: Piece) -> tuple[str, object]:
        """Keep a piece; returns (``chat.CONTENT``, ``chat.REASONING`` or ``chat.TOOL_CALL``, what it carries)."""
        if piece.reasoning is not None:
            self.reasoning.append(piece.reasoning)
            return chat.REASONING, piece.reasoning
        if piece.tool_call is not None:
            self.calls.append(piece.tool_call)
            return chat.TOOL_CALL, piece.tool_call
        self.text.append(piece.text or "")
        return chat.CONTENT, self.text[-1]

    def answer(self, final: Final) -> DecodeAnswer:
        """The whole answer, given the stream's last line."""
        return DecodeAnswer("".join(self.text), final.finish_reason, final.metrics,
                            "".join(self.reasoning) if self.reasoning else None, self.calls or None)


def _ndjson_lines(resp, server: TrackedServer, watch: Watch):
    """The lines of a progress answer that are not heartbeats, as ``wire`` types; an error line raises as
    the error it is, transport failures as Upstream errors (``watch`` decides when silence is too long)."""
    name = server.entry.name
    try:
        for raw in resp.iter_lines():
            if not raw:
                continue
            try:
                data = json.loads(raw)
            except ValueError:
                raise UpstreamError(f"{name} sent a line that is not JSON", transport=True) from None
            if not isinstance(data, dict):
                raise UpstreamError(f"{name} sent a line that is not a JSON object", transport=True)
            line = read_line(data)
            if watch.heard(line):
                continue
            if isinstance(line, ErrorLine):
                raise _answered(server, line.status, line.body)
            yield line
    except requests.RequestException as exc:
        # a read that timed out mid-stream comes as a ConnectionError around urllib3's ReadTimeoutError
        if isinstance(exc, requests.Timeout) or any(isinstance(a, ReadTimeoutError) for a in exc.args):
            raise watch.timed_out() from None
        raise UpstreamError(f"{name} broke off its answer: {type(exc).__name__}", transport=True) from None
    finally:
        resp.close()


def _prepend(head, rest):
    try:
        yield head
        yield from rest
    finally:
        rest.close()
