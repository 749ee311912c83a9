"""The client's handoff: a prefill on one server, a decode of its KV on another, and what happens when either fails.

``_on`` tries the servers of a role until one serves; ``_handoff`` prefills and then
decodes the KV it made; a KV the decode server could not get or read (``KV_LOST_CODES``)
is ``_KVLost``: ``_serve_by_route`` recomputes it once, elsewhere, then falls back to
the decode server alone with a ``FallbackWarning``.
"""
from __future__ import annotations

import logging
import time
import warnings

from .. import routing
from ..errors import DisaggError, NoServerAvailable
from ..metrics import Method
from ..request import GenerationRequest
from ..wire import DecodeAnswer, PrefillAnswer
from .figures import Served, method_of
from .servers import TrackedServer

log = logging.getLogger(__name__)

# Decode-server answers that mean "the KV is gone, recompute": unknown/expired
# handle, unreachable prefill server, unusable bundle, a state that failed its canary.
KV_LOST_CODES = {"not_found", "lease_expired", "upstream_error", "upstream_timeout", "bad_bundle", "canary_mismatch"}
# A decode server that could not be connected to is tried once more after this pause before it is
# marked down: the request never reached it, so its KV lease is intact and the retry costs the pause.
DECODE_CONNECT_RETRY_DELAY = 0.5


class FallbackWarning(UserWarning):
    """A request was served in a degraded mode (decode-only, recompute)."""


class _Attempt(Exception):
    """One server failed; the caller may try another."""

    def __init__(self, server: TrackedServer, error: DisaggError, retryable: bool = True):
        super().__init__(str(error))
        self.server, self.error, self.retryable = server, error, retryable


class _KVLost(DisaggError):
    """The decode server could not get the KV bundle: recompute."""

    status, code = 502, "kv_lost"


def _raise_kv_lost(server: TrackedServer, exc: DisaggError) -> None:
    """An answer from the decode server saying the KV is gone (not a failure to reach it): recompute."""
    if exc.code in KV_LOST_CODES and exc.status != 503 and not exc.details.get("transport"):
        # the decode server is fine; the bundle is not: recompute, do not blame the server
        raise _Attempt(server, _KVLost(exc.message), retryable=False) from None


class Handoff:
    """Serving one request across servers (``DisaggregatedClient``'s part)."""

    def _on(self, role: str, model_key: str, call, exclude=()):
        """Run ``call(server)`` on the first server of a role that succeeds; mark failures. When every
        server tried was only busy (503 overloaded), wait as its Retry-After says and go round again,
        for at most the role's timeout."""
        patience = self.prefill_timeout if role == "prefill" else self.decode_timeout
        deadline = time.monotonic() + patience
        while True:
            busy: list = []
            try:
                return self._on_once(role, model_key, call, exclude, busy)
            except NoServerAvailable:
                if not busy or time.monotonic() + min(busy) > deadline:
                    raise
                time.sleep(min(busy))

    def _on_once(self, role: str, model_key: str, call, exclude, busy: list):
        tried, codes = [], []
        for server in self._candidates(role, model_key, wait=role == "decode"):  # no fallback after decode
            if server.entry.name in exclude:
                continue
            with self._counted(server, "outstanding"):
                try:
                    result = call(server)
                    with self._lock:
                        server.served += 1
                    self._mark_ok(server)
                    return server, result
                except _Attempt as attempt:
                    tried.append(f"{server.entry.name}: {attempt.error.message}")
                    if not attempt.retryable:
                        raise attempt.error from None
                except DisaggError as exc:
                    tried.append(f"{server.entry.name}: {exc.message}")
                    codes.append(exc.code)
                    if 400 <= exc.status < 500 and exc.status not in (404, 408, 409, 429):
                        raise  # the request is at fault, not the server
                    if exc.code == "overloaded" and not exc.details.get("transport"):
                        busy.append(min(5.0, float(exc.details.get("retry_after") or 1.0)))
                        continue  # busy, not dead: try the next server and keep this one up
                    if exc.details.get("deadline"):  # the caller's time ran out while the server worked: no blame
                        if role == "decode":
                            raise
                        continue
                    self._mark_failure(server, exc.message, hard=exc.code in ("upstream_error", "upstream_timeout"))
        raise NoServerAvailable(f"no {role} server for model {model_key!r} could serve the request"
                                + (f" (tried: {'; '.join(tried)})" if tried else " (none healthy)"),
                                tried=tried, timed_out=bool(codes) and all(c == "upstream_timeout" for c in codes))


    def _by_route(self, model_key: str, decision, handoff, local, started: float) -> tuple[Served, list[str]]:
        """Serve a request the way ``decision`` chose: ``local("decode_only")`` when the router kept it
        on the decode server; else ``handoff(exclude)``, recomputing a lost KV up to ``retries`` times
        (elsewhere than on a prefill server its KV could not be pulled from), then
        ``local("decode_only_fallback")`` with a ``FallbackWarning`` when no handoff could be made.
        Returns (what the chosen call returned, the notes of what went wrong on the way). A request
        no server could serve goes into the history too (``error``), then its error is raised."""
        try:
            return self._serve_by_route(model_key, decision, handoff, local)
        except DisaggError as exc:
            with self._lock:
                self.history.append({"time": time.time(), "model": model_key, "error": exc.code,
                                     "error_message": exc.message[:300],
                                     "total_time": round(time.perf_counter() - started, 6)})
            raise

    def _serve_by_route(self, model_key: str, decision, handoff, local) -> tuple[Served, list[str]]:
        notes: list[str] = []
        if decision.path == routing.LOCAL:  # chosen, not a fallback: no warning
            return local(Method.DECODE_ONLY), notes
        exclude: set = set()  # prefill servers a decode server could not pull the KV from
        for attempt in range(1 + self.retries):
            try:
                return handoff(tuple(exclude)), notes
            except NoServerAvailable as exc:
                if exc.details.get("role") == "decode":
                    raise
                notes.append(str(exc.message))
                if not self._candidates("prefill", model_key):
                    break
            except _KVLost as exc:
                notes.append(f"KV handoff failed ({exc}); recomputing" if attempt == 0 else f"KV handoff failed again ({exc})")
                if exc.details.get("suspect"):
                    exclude.add(exc.details["suspect"])
        message = "; ".join(notes) or "no prefill server available"
        warnings.warn(f"Using fallback mode (decode-only, slower): {message}", FallbackWarning, stacklevel=3)
        return local(Method.DECODE_ONLY_FALLBACK), notes


    def _handoff(self, model_key: str, request: GenerationRequest, decode, exclude=()) -> tuple:
        """Prefill on one server (its answer a ``wire.PrefillAnswer``; asking for the KV kind the decode servers read; none of ``exclude``), then
        ``decode(server, prefilled)`` on a decode server; a decode server's failure to get or read the KV
        raises ``_KVLost``, naming the prefill server in ``details["suspect"]`` when the decode server
        could not pull from it (that server is marked, softly, and left out of the recompute). Returns
        (prefill server, its answer, decode server, what ``decode`` returned)."""
        if not self._candidates("decode", model_key, wait=True):
            raise NoServerAvailable(f"no healthy decode server for model {model_key!r}", role="decode")
        wanted = self._kv_kind(model_key)
        if self._streams(model_key):
            wanted["handoff_mode"] = "streamed"  # the prefill server answers at once where the model allows it
        evaluating = []  # the prefill server while it evaluates this prompt (``TrackedServer.prompting``)

        def done_evaluating():
            with self._lock:
                while evaluating:
                    evaluating.pop().prompting -= 1

        def prefill_on(server: TrackedServer):
            with self._lock:
                server.prompting += 1
            evaluating.append(server)
            try:
                answer = PrefillAnswer.read(self._post(server, "/prefill", request.prefill_body(**wanted),
                                                       self.prefill_timeout))
            except BaseException:
                done_evaluating()
                raise
            if answer.handoff_mode != "streamed":  # answered once the prompt was evaluated
                done_evaluating()
            return answer

        try:
            return self._handoff_from(model_key, request, decode, prefill_on, exclude)
        finally:  # streamed: the prompt is evaluated by the time the decode server has the KV (or gave up)
            done_evaluating()

    def _handoff_from(self, model_key: str, request: GenerationRequest, decode, prefill_on, exclude) -> tuple:
        prefill_server, prefilled = self._on("prefill", model_key, prefill_on, exclude)
        unreachable = []

        def decode_on(server: TrackedServer):
            try:
                return decode(server, prefilled)
            except DisaggError as exc:
                if exc.code in ("upstream_error", "upstream_timeout") and not exc.details.get("transport"):
                    # the decode server answered that it could not pull the KV: the prefill server is suspect
                    self._mark_failure(prefill_server, f"its KV could not be pulled: {exc.message}")
                    unreachable.append(prefill_server.entry.name)
                _raise_kv_lost(server, exc)
                raise

        try:
            decode_server, decoded = self._on("decode", model_key, decode_on)
        except NoServerAvailable as exc:
            exc.details["role"] = "decode"
            raise
        except _KVLost as exc:
            exc.details["suspect"] = unreachable[0] if unreachable else None
            raise
        return prefill_server, prefilled, decode_server, decoded

    def _disaggregated(self, model_key: str, request: GenerationRequest, exclude=()) -> Served:
        sent, retries = [], []
        prefill_server, prefilled, decode_server, decoded = self._handoff(
            model_key, request, lambda server, pre: DecodeAnswer.read(self._post_retrying_connect(
                server, "/decode", request.decode_body(pre.kv.write()), sent, retries)), exclude)
        return Served(decode_server, method_of(prefilled, decoded), prefill_server, prefilled, decoded,
                      decode_sent_at=sent[-1], decode_connect_retries=retries)

    def _post_retrying_connect(self, server: TrackedServer, path: str, body: dict, sent: list, retries: list) -> dict:
        """POST to a decode server; one that could not be connected to gets one more try, the same
        server after ``DECODE_CONNECT_RETRY_DELAY``. Appends each send's
        time to ``sent`` and each retried failure to ``retries``."""
        sent.append(time.perf_counter())
        try:
            return self._post(server, path, body, self.decode_timeout)
        except DisaggError as exc:
            if not exc.details.get("connect_failed"):
                raise
            retries.append(exc.message)
            log.warning("decode server did not accept the connection, retrying once: name=%s error=%s",
                        server.entry.name, exc.message)
        self._pause_before_retry()
        sent.append(time.perf_counter())
        return self._post(server, path, body, self.decode_timeout)

    def _pause_before_retry(self) -> None:
        time.sleep(DECODE_CONNECT_RETRY_DELAY)

    def _open_disaggregated(self, model_key: str, request: GenerationRequest, exclude=()) -> Served:
        """``_disaggregated`` up to the first line of the decode server's stream."""
        prefill_server, prefilled, decode_server, lines = self._handoff(
            model_key, request, lambda server, pre: self._open_stream(
                server, "/decode", request.decode_body(pre.kv.write(), stream=True), self.decode_timeout), exclude)
        # provisional: the decode server reports the final one in its last line
        return Served(decode_server, method_of(prefilled), prefill_server, prefilled, lines=lines)

