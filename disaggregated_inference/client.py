"""The client: route each request to a prefill/decode pair, fail over, fall back.

``client.generate(model=..., prompt=..., max_tokens=...)`` returns ``(text,
metrics)``. One request goes:

1. ``POST /prefill`` on the least-loaded healthy prefill server of the model
   (another one if it fails);
2. ``POST /decode`` on a decode server with the KV reference; the decode server
   pulls the bundle from the prefill server itself (a decode server that does not
   accept the connection is tried once more before the next one: the request never
   reached it, so the KV lease it names is intact);
3. a lost KV (lease expired, prefill server gone) is recomputed once: a new
   prefill, a new decode;
4. with no prefill server left, or a handoff that failed twice, the decode
   server generates alone (``POST /generate``) and ``metrics["method"]`` says
   ``decode_only_fallback``, with a warning;
5. with no decode server able to serve, ``NoServerAvailable`` is raised within
   the configured timeouts.

What every server would refuse (server/parse.py, with the config's limits) is
refused before any server is chosen, even when none is up. Every answer is read
as progress lines (``watch.py``): a server that falls silent or stops making
progress is given up in seconds and marked down; a caller's own
``prefill_timeout``/``decode_timeout`` that runs out while the server works blames
no server. A server marked down is probed again (its ``/health``) as requests
come, with or without the background health checker, and serves again as soon
as it answers.

The client is safe to share between threads; ``generate_many`` runs several
requests (e.g. the two models of the grader) concurrently.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import requests
from requests.adapters import HTTPAdapter
from urllib3.exceptions import NewConnectionError, ReadTimeoutError

from . import chat
from . import config as cluster_config
from . import resume  # issue 42: an answer survives its decode server
from . import routing
from .errors import BadRequest, DisaggError, NoServerAvailable, UpstreamError, UpstreamTimeout, from_body
from .server.parse import Limits, parse_generate
from .watch import Watch

log = logging.getLogger(__name__)

# Decode-server answers that mean "the KV is gone, recompute": unknown/expired
# handle, unreachable prefill server, unusable bundle, a state that failed its canary.
KV_LOST_CODES = {"not_found", "lease_expired", "upstream_error", "upstream_timeout", "bad_bundle", "canary_mismatch"}
# A decode server that could not be connected to is tried once more after this pause before it is
# marked down: the request never reached it, so its KV lease is intact and the retry costs the pause.
DECODE_CONNECT_RETRY_DELAY = 0.5
# A server marked down is probed again (GET /health) this long after, then twice as long after each
# probe it fails, up to REVIVE_MAX_INTERVAL; at once when a request finds no server of its role up.
REVIVE_INTERVAL = 1.0
REVIVE_MAX_INTERVAL = 30.0


def _connect_failed(exc: requests.RequestException) -> bool:
    """The connection was never made (refused, unreachable, connect timeout): nothing was sent."""
    reason = getattr(exc.args[0], "reason", None) if exc.args else None
    return isinstance(exc, requests.ConnectTimeout) or isinstance(reason, NewConnectionError)


class FallbackWarning(UserWarning):
    """A request was served in a degraded mode (decode-only, recompute)."""


@dataclass
class TrackedServer:
    entry: cluster_config.ServerEntry
    up: bool = True           # optimistic until a check or a request says otherwise
    failures: int = 0
    last_error: str | None = None
    last_checked: float | None = None
    latency_s: float | None = None
    outstanding: int = 0
    served: int = 0
    health: dict = field(default_factory=dict)
    revive_at: float = 0.0  # monotonic: when a server marked down is probed again
    revive_interval: float = 0.0
    probe: object = None  # the thread probing it now (threading.Thread), if any

    @property
    def slots(self) -> int:
        """Requests the server serves at once, as its last /health said (1 until it has said)."""
        return int((self.health.get("slots") or {}).get("total") or 1)

    @property
    def free_slots(self) -> int:
        return self.slots - self.outstanding

    def as_dict(self) -> dict:
        e = self.entry
        return {"name": e.name, "role": e.role, "model": e.model, "url": e.url, "up": self.up,
                "failures": self.failures, "last_error": self.last_error, "last_checked": self.last_checked,
                "latency_s": self.latency_s, "outstanding": self.outstanding, "slots": self.slots,
                "served": self.served,
                "loaded": self.health.get("loaded"), "backend": self.health.get("backend"),
                "handoff": self.health.get("handoff")}


class _Attempt(Exception):
    """One server failed; the caller may try another."""

    def __init__(self, server: TrackedServer, error: DisaggError, retryable: bool = True):
        super().__init__(str(error))
        self.server, self.error, self.retryable = server, error, retryable


@dataclass
class Served:
    """How one request was served: the servers it went to, what they answered, and when."""

    decode_server: TrackedServer
    method: str  # kv_handoff, token_ids_recompute, decode_only or decode_only_fallback
    prefill_server: TrackedServer | None = None
    prefill: dict | None = None  # the prefill server's answer (a handoff)
    decode: dict | None = None  # the decode server's answer: generated_text, finish_reason, metrics
    decode_sent_at: float | None = None  # when the request that the decode server answered was sent
    decode_connect_retries: list = field(default_factory=list)  # connections it refused, each retried once
    first_piece_at: float | None = None  # a stream: when its first piece arrived
    lines: object = None  # a stream: the decode server's NDJSON lines, open until the last

    def prefill_metrics(self) -> dict:
        """The prefill's metrics: its /prefill answer's, and for a streamed handoff (answered before the prompt
        was evaluated) those its KV stream ended with, which the decode server passes on."""
        pre = dict((self.prefill or {}).get("metrics", {}))
        pre.update((self.decode or {}).get("metrics", {}).get("prefill_metrics") or {})
        return pre

    def metrics(self, started: float, notes: list) -> dict:
        """The request's metrics, as ``generate`` returns them (``started``: when it began)."""
        pre = self.prefill_metrics()
        dec = self.decode["metrics"]
        prompt_tokens = dec.get("prompt_tokens") or pre.get("prompt_tokens") or 0
        completion = dec.get("completion_tokens", 0)
        prefill_time = pre.get("prefill_time", dec.get("prompt_eval_time", 0.0)) if self.prefill else dec.get(
            "prompt_eval_time", 0.0)
        metrics = {
            "prefill_time": prefill_time,
            "decode_time": dec.get("decode_time"),
            "total_time": round(time.perf_counter() - started, 6),
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prefill_speed": pre.get("prefill_speed") if self.prefill else dec.get("prompt_eval_speed"),
            "decode_speed": dec.get("decode_speed"),
            "method": self.method,
            "prefill_server": self.prefill_server.entry.address if self.prefill_server else None,
            "decode_server": self.decode_server.entry.address,
            "kv_bytes": dec.get("kv_bytes", 0),
            "kv_transfer_time": dec.get("kv_transfer_time", 0.0),
            "kv_load_time": dec.get("kv_load_time"),
            "ttft": dec.get("ttft"),
            # a stream's first piece arrives here: measured whole on the client's clock
            "ttft_end_to_end": (round(self.first_piece_at - started, 6) if self.first_piece_at is not None
                                else _end_to_end_ttft(started, self.decode_sent_at, dec.get("ttft"))),
            "decode_connect_retries": len(self.decode_connect_retries),
            "prompt_tokens_recomputed": dec.get("prompt_tokens_recomputed"),
            # prompt tokens whose KV the evaluating server's slot already held (its prefix cache)
            "prompt_tokens_cached": (pre if self.prefill else dec).get("prompt_tokens_cached"),
            "finish_reason": self.decode.get("finish_reason"),
            # of completion_tokens, those the model reasoned with (None: the server does not say)
            "reasoning_tokens": dec.get("reasoning_tokens"),
        }
        # what the model's chat format read apart from the answer: never part of the text
        for key in ("reasoning", "tool_calls"):
            if self.decode.get(key):
                metrics[key] = self.decode[key]
        # the handoff's canary (kv/canary.py): what the decode side found, and what making it cost
        for key in ("canary", "canary_top1_match", "canary_divergence", "canary_tolerance", "canary_check_ms"):
            if key in dec:
                metrics[key] = dec[key]
        # how the KV went (whole after the prefill, or streamed during it) and, streamed, what was left after it
        if self.prefill:
            metrics["handoff_mode"] = dec.get("handoff_mode") or pre.get("handoff_mode") or "whole"
            for key in ("handoff_mode_reason", "kv_import", "kv_wait_time", "kv_exposed_time"):
                value = dec.get(key, pre.get(key))
                if value is not None:
                    metrics[key] = value
        if pre.get("canary_ms") is not None:
            metrics["canary_ms"] = pre["canary_ms"]
        # speculative decoding on the decode server: guesses verified and kept
        for key in ("speculation", "draft_tokens", "accepted_tokens"):
            if key in dec:
                metrics[key] = dec[key]
        notes = notes + [f"decode server did not accept the connection, retried once: {m}"
                         for m in self.decode_connect_retries]
        if notes:
            metrics["warnings"] = list(notes)
        return metrics


class DisaggregatedClient:
    def __init__(self, config=None, *, health_check: bool = True, api_token: str | None = None):
        self.config = cluster_config.coerce(config)
        opts = self.config.client
        self.prefill_timeout = float(opts["prefill_timeout"])
        self.decode_timeout = float(opts["decode_timeout"])
        self.connect_timeout = float(opts["connect_timeout"])
        self.health_timeout = float(opts["health_timeout"])
        self.progress_timeout = float(opts["progress_timeout"])
        self.limits = Limits(prompt_chars=self.config.server["max_prompt_chars"],
                             schema_bytes=self.config.server["max_schema_bytes"])
        self.retries = int(opts["retries"])
        self.failures_before_down = int(opts["failures_before_down"])
        self.route = opts["route"]
        self.handoff_mode = opts["handoff_mode"]
        self.costs = routing.CostModel()  # what this client has measured, for route "auto"
        self.api_token = api_token or opts.get("api_token") or self.config.server.get("api_token")
        self.history: deque = deque(maxlen=int(opts["history_size"]))
        self._lock = threading.Lock()
        self._local = threading.local()
        self._rr = 0
        self.servers = {e.name: TrackedServer(e) for e in self.config.servers}
        self._stop = threading.Event()
        self._monitor = None
        interval = float(opts["health_check_interval"])
        if health_check and interval > 0:
            self._monitor = threading.Thread(target=self._monitor_loop, args=(interval,), name="health-monitor",
                                             daemon=True)
            self._monitor.start()

    # -- HTTP plumbing -------------------------------------------------------------------------

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
        """One request's whole answer from ``server``: the /prefill answer, or a /decode or /generate one
        (``generated_text``, ``finish_reason``, ``metrics``), read as progress lines (``_lines``) so that a
        hung or stuck server is given up in seconds; ``timeout`` is the caller's deadline for it."""
        started = time.perf_counter()
        stream = path != "/prefill"
        watch = self._watch(server, path, timeout, body=body)
        lines = self._lines(server, path, {**body, "stream": True} if stream else body, watch)
        pieces = _Pieces()
        try:
            if not stream:
                answer = next(lines)
                answer.pop("done", None)
            else:
                answer = None
                for line in lines:
                    if line.get("done"):
                        answer = pieces.answer(line)
                        break
                    pieces.add(line)
        except StopIteration:
            answer = None
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

    # -- server choice and health --------------------------------------------------------------

    def _kv_kind(self, model_key: str) -> dict:
        """The bundle kind to ask the prefill server for: nothing when every decode server of the model
        continues what its prefill servers hand over (their last /health ``handoff`` and ``accepts``), else
        ``{"kv_kind": "neutral_kv"}`` when every one of them reads that (an MLX decode server behind a
        llama.cpp prefill server). Before the prefill servers' health is known: ``neutral_kv`` when no decode server
        reads llama.cpp state, else nothing (the prefill backend's own kind)."""
        with self._lock:  # not _candidates(): that advances the round-robin
            accepts = [s.health.get("accepts") for s in self.servers.values()
                       if s.entry.role == "decode" and s.entry.model == model_key and s.up]
            handed = {s.health.get("handoff") for s in self.servers.values()
                      if s.entry.role == "prefill" and s.entry.model == model_key and s.up}
        handed.discard(None)
        if not accepts or not all(accepts):
            return {}
        if handed:  # what the prefill servers hand over is known
            if all(kind in a for a in accepts for kind in handed):
                return {}
            return {"kv_kind": "neutral_kv"} if all("neutral_kv" in a for a in accepts) else {}
        if all("neutral_kv" in a and "llama_seq_state" not in a for a in accepts):
            return {"kv_kind": "neutral_kv"}
        return {}

    def _streams(self, model_key: str) -> bool:
        """Whether to ask for the overlapped handoff: ``client.handoff_mode`` is "streamed" and no decode server
        of the model said (in its last /health) that it takes only whole bundles (an older server)."""
        if self.handoff_mode != "streamed":
            return False
        with self._lock:
            modes = [s.health.get("handoff_modes") for s in self.servers.values()
                     if s.entry.role == "decode" and s.entry.model == model_key and s.up and s.health]
        return all(m is not None and "streamed" in m for m in modes)

    def _candidates(self, role: str, model_key: str, wait: bool = False) -> list[TrackedServer]:
        """The servers of a role to try, in order. Servers marked down are probed again as their time comes
        (``_revive``); with ``wait``, when none is up, every one marked down is probed now and waited for
        (a request with no other way to go)."""
        with self._lock:
            pool = [s for s in self.servers.values() if s.entry.role == role and s.entry.model == model_key]
        self._revive([s for s in pool if not s.up], now=wait and not any(s.up for s in pool))
        with self._lock:
            healthy = [s for s in pool if s.up]
            self._rr += 1
            rr = self._rr
        # most free slots first (a server's slots, from /health, less what this client has in flight there);
        # round-robin among ties
        order = sorted(range(len(healthy)), key=lambda i: (-healthy[i].free_slots, (i - rr) % max(1, len(healthy))))
        return [healthy[i] for i in order]

    def _revive(self, down: list[TrackedServer], now: bool = False) -> None:
        """Probe the servers marked ``down`` whose time has come (all of them with ``now``, and wait for
        those probes): a server that answers its /health is up again, whether or not the background health
        checker runs. The probes run on threads of their own, so a request does not wait for a server it
        does not need."""
        started = time.monotonic()
        probes = []
        with self._lock:
            for server in down:
                # a server checked a moment ago (a probe that failed just now) waits for its time even when
                # ``now``: a request would otherwise pay for the same probe twice
                just_checked = server.last_checked is not None and time.time() - server.last_checked < REVIVE_INTERVAL
                if server.probe is None and (started >= server.revive_at or (now and not just_checked)):
                    server.probe = threading.Thread(target=self._probe, args=(server,), name="revive", daemon=True)
                    server.probe.start()
                if now and server.probe is not None:
                    probes.append(server.probe)
        for probe in probes:
            probe.join(max(0.0, self.connect_timeout + self.health_timeout - (time.monotonic() - started)))

    def _probe(self, server: TrackedServer) -> None:
        try:
            self._check_one(server)
        finally:
            with self._lock:
                server.probe = None

    def _peek(self, role: str, model_key: str) -> TrackedServer | None:
        """The server ``_candidates`` would try first (without advancing its round-robin)."""
        with self._lock:
            healthy = [s for s in self.servers.values() if s.entry.role == role and s.entry.model == model_key and s.up]
        return max(healthy, key=lambda s: s.free_slots, default=None)

    def _route(self, model_key: str, source: dict, route: str | None) -> routing.Decision:
        """Handoff or decode-only for this request (``route`` overrides ``client.route``)."""
        mode = route or self.route
        if mode not in routing.MODES:
            raise BadRequest(f"route must be one of {', '.join(routing.MODES)}, got {mode!r}", field="route")
        prefill, decode = self._peek("prefill", model_key), self._peek("decode", model_key)
        queue = 0
        if prefill is not None:  # requests ahead on the prefill server: its own queue, and ours beyond its slots
            queue = int((prefill.health.get("slots") or {}).get("queued") or 0)
            queue += max(0, prefill.outstanding + 1 - prefill.slots)
        reported = tuple(s.health.get("prompt_speed") if s is not None else None for s in (prefill, decode))
        # the overlapped handoff, where this client asks for it and the prefill server streams this model
        streamed = self._streams(model_key) and prefill is not None and "streamed" in (
            prefill.health.get("handoff_modes") or ("streamed",))
        chunk = ((prefill.health.get("model_info") or {}).get("n_batch") if prefill is not None else None)
        return self.costs.decide(mode, model_key, routing.prompt_chars(source),
                                 prefill.entry.name if prefill else None, decode.entry.name if decode else None,
                                 prefill_queue=queue, reported=reported, streamed=streamed, chunk_tokens=chunk)

    def _learn(self, model_key: str, source: dict, served: Served, metrics: dict, clean: bool) -> None:
        """Feed what this request measured to the cost model (``clean``: no retry or fallback inflated its times)."""
        method = served.method
        path = routing.HANDOFF if method == "kv_handoff" else routing.LOCAL if method.startswith("decode_only") else None
        if path is None:
            return
        self.costs.observe(model_key, routing.prompt_chars(source), path,
                           served.prefill_server.entry.name if served.prefill_server else None,
                           served.decode_server.entry.name, served.prefill_metrics(),
                           served.decode["metrics"], metrics.get("ttft_end_to_end") if clean else None)

    def _mark_failure(self, server: TrackedServer, error: str, hard: bool = False) -> None:
        with self._lock:
            server.failures += 1
            server.last_error = error
            if hard or server.failures >= self.failures_before_down:
                if server.up:
                    log.warning("server marked down: name=%s error=%s", server.entry.name, error)
                    server.revive_interval = REVIVE_INTERVAL
                else:  # a probe failed: the next one later
                    server.revive_interval = min(REVIVE_MAX_INTERVAL, 2 * (server.revive_interval or REVIVE_INTERVAL))
                server.up = False
                server.revive_at = time.monotonic() + server.revive_interval

    def _mark_ok(self, server: TrackedServer) -> None:
        with self._lock:
            if not server.up:
                log.warning("server marked up: name=%s", server.entry.name)
            server.up, server.failures, server.last_error, server.revive_interval = True, 0, None, 0.0

    def check_health(self) -> list[dict]:
        """Check every server once, now; update their states; return them."""
        for server in list(self.servers.values()):
            self._check_one(server)
        return self.status()

    def _check_one(self, server: TrackedServer) -> None:
        started = time.perf_counter()
        refused = False
        try:
            resp = self.session.get(server.entry.url + "/health", timeout=(self.connect_timeout, self.health_timeout))
            data = resp.json()
            ok = resp.status_code == 200 and data.get("loaded") is True
            error = None if ok else f"health: {data.get('status')} {data.get('error') or data.get('progress') or ''}".strip()
        except (requests.RequestException, ValueError) as exc:
            ok, data, error = False, {}, f"health check failed: {type(exc).__name__}"
            refused = isinstance(exc, requests.ConnectionError) and not isinstance(exc, requests.Timeout)
        server.last_checked = time.time()
        server.latency_s = round(time.perf_counter() - started, 4)
        server.health = data
        if ok:
            self._mark_ok(server)
        else:  # a refused connection is conclusive; a slow or loading server gets another chance
            self._mark_failure(server, error, hard=refused)

    def _monitor_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            for server in list(self.servers.values()):
                if self._stop.is_set():
                    return
                self._check_one(server)

    def status(self) -> list[dict]:
        with self._lock:
            return [s.as_dict() for s in self.servers.values()]

    def close(self) -> None:
        self._stop.set()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- one request ---------------------------------------------------------------------------

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
            with self._lock:
                server.outstanding += 1
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
            finally:
                with self._lock:
                    server.outstanding -= 1
        raise NoServerAvailable(f"no {role} server for model {model_key!r} could serve the request"
                                + (f" (tried: {'; '.join(tried)})" if tried else " (none healthy)"),
                                tried=tried, timed_out=bool(codes) and all(c == "upstream_timeout" for c in codes))

    def check_request(self, source: dict, sampling: dict) -> None:
        """Refuse what every server would (``BadRequest``, ``PayloadTooLarge``, naming the field as the
        servers do): the request parsed here as a decode server parses a /generate (server/parse.py, with
        the config's limits), before any server is chosen, so the answer is the same when none is up."""
        parse_generate({**source, **sampling}, self.limits)

    def generate(self, model: str, prompt: str | None = None, max_tokens: int = 256, temperature: float = 0.0, *,
                 messages: list | None = None, top_p: float = 1.0, seed: int | None = None, stop=None,
                 json_schema: dict | None = None, raw: bool = False, top_k: int | None = None,
                 system: str | None = None, route: str | None = None, tools: list | None = None,
                 tool_choice=None, reasoning_effort: str | None = None,
                 reasoning_budget: int | None = None, ignore_eos: bool = False,
                 speculation: str | None = None) -> tuple[str, dict]:
        """One request; ``route`` ("auto", "handoff", "decode_only") overrides ``client.route`` for it;
        ``speculation`` ("off", "ngram") overrides the decode server's model setting for it.

        The text is the answer alone. A model that reasons (gpt-oss) returns its chain of thought in
        ``metrics["reasoning"]`` and how many tokens it took in ``metrics["reasoning_tokens"]``;
        ``reasoning_effort`` (low, medium, high) asks for more or less of it and ``reasoning_budget`` caps
        it (tokens; by default half of ``max_tokens``), after which the model is moved on to its answer.
        ``tools`` (functions in the OpenAI API's shape) may be called: the calls are in
        ``metrics["tool_calls"]`` (``{"name", "arguments"}``, the arguments as JSON text) and
        ``finish_reason`` is ``tool_calls``; ``tool_choice`` is auto, none, required or a function.
        ``ignore_eos``: exactly ``max_tokens`` (llama.cpp decode servers; others answer 400), for benchmarks."""
        started = time.perf_counter()
        model_key = self.config.resolve_model(model)
        source, sampling = _request_bodies(prompt, messages, raw, system=system, max_tokens=max_tokens,
                                           temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop,
                                           json_schema=json_schema, tools=tools, tool_choice=tool_choice,
                                           reasoning_effort=reasoning_effort, reasoning_budget=reasoning_budget,
                                           ignore_eos=ignore_eos, speculation=speculation)
        self.check_request(source, sampling)
        decision = self._route(model_key, source, route)
        resume.begin(self._local)  # resume hook: moves of this request's answer between decode servers

        def local(method: str) -> Served:
            sent, retries = [], []
            decode_server, data = self._on("decode", model_key, lambda s: self._post_retrying_connect(
                s, "/generate", {**source, **sampling}, sent, retries))
            return Served(decode_server, method, decode=data, decode_sent_at=sent[-1], decode_connect_retries=retries)

        served, notes = self._by_route(model_key, decision,
                                       lambda exclude: self._disaggregated(model_key, source, sampling, exclude),
                                       local, started)
        metrics = resume.finish(self._local, served.metrics(started, notes))  # resume hook
        metrics.update(decision.as_metrics())
        self._learn(model_key, source, served, metrics,  # resume hook: a moved answer's times are no measure
                    clean=not notes and not served.decode_connect_retries and "resumed" not in metrics)
        self._remember(model_key, metrics)
        return served.decode["generated_text"], metrics

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
            return local("decode_only"), notes
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
        return local("decode_only_fallback"), notes

    def _remember(self, model_key: str, metrics: dict) -> None:
        with self._lock:
            self.history.append({"time": time.time(), "model": model_key, **{k: metrics.get(k) for k in (
                "method", "prefill_time", "decode_time", "total_time", "prompt_tokens", "completion_tokens",
                "prefill_speed", "decode_speed", "prefill_server", "decode_server", "kv_bytes", "kv_transfer_time",
                "ttft", "ttft_end_to_end", "prompt_tokens_cached", "canary", "route_reason", "reasoning_tokens",
                "draft_tokens", "accepted_tokens")}})

    def _handoff(self, model_key: str, source: dict, decode, exclude=()) -> tuple:
        """Prefill on one server (asking for the KV kind the decode servers read; none of ``exclude``), then
        ``decode(server, prefilled)`` on a decode server; a decode server's failure to get or read the KV
        raises ``_KVLost``, naming the prefill server in ``details["suspect"]`` when the decode server
        could not pull from it (that server is marked, softly, and left out of the recompute). Returns
        (prefill server, its answer, decode server, what ``decode`` returned)."""
        if not self._candidates("decode", model_key, wait=True):
            raise NoServerAvailable(f"no healthy decode server for model {model_key!r}", role="decode")
        wanted = self._kv_kind(model_key)
        if self._streams(model_key):
            wanted["handoff_mode"] = "streamed"  # the prefill server answers at once where the model allows it
        prefill_server, prefilled = self._on("prefill", model_key, lambda s: self._post(
            s, "/prefill", {**source, **wanted}, self.prefill_timeout), exclude)
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

    def _disaggregated(self, model_key: str, source: dict, sampling: dict, exclude=()) -> Served:
        sent, retries = [], []
        prefill_server, prefilled, decode_server, decoded = self._handoff(
            model_key, source, lambda server, pre: self._post_retrying_connect(
                server, "/decode", {"kv": pre["kv"], **sampling}, sent, retries), exclude)
        return Served(decode_server, decoded["metrics"].get("method", "disaggregated"), prefill_server, prefilled,
                      decoded, decode_sent_at=sent[-1], decode_connect_retries=retries)

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

    def stream(self, model: str, prompt: str | None = None, max_tokens: int = 256, temperature: float = 0.0, *,
               messages: list | None = None, top_p: float = 1.0, top_k: int | None = None, seed: int | None = None,
               stop=None, json_schema: dict | None = None, raw: bool = False, system: str | None = None,
               on_route=None, route: str | None = None, tools: list | None = None, tool_choice=None,
               reasoning_effort: str | None = None, reasoning_budget: int | None = None, parts: bool = False,
               ignore_eos: bool = False, speculation: str | None = None):
        """Like ``generate``, but yield the text pieces as the decode server sends them, then the metrics dict.

        The pieces are the answer's. With ``parts``, the reasoning and the tool calls come too, as they
        arrive, each a ``chat.Part`` (``kind`` ``reasoning`` with its text, or ``tool_call`` with
        ``{"name", "arguments"}``); the answer's pieces stay strings. Either way the metrics carry them whole.

        Routing, failover, the recompute of a lost KV and the decode-only fallback happen as in
        ``generate`` until the decode server's stream has opened (its answer arrives with the first
        piece). After that, a decode server that dies or goes silent hands the answer to another one of
        the model where one is up (``resume.py``: each piece once, ``metrics["resumed"]``); else the error
        ends the stream by raising.
        ``on_route(route)``, if given, is called once the stream is open with what is known then:
        ``method`` (provisional for a handoff: the decode server reports the final one in the
        metrics), ``prefill_server``, ``decode_server``, ``kv_bytes`` (the bundle's size) and
        ``warnings``.
        """
        started = time.perf_counter()
        model_key = self.config.resolve_model(model)
        source, sampling = _request_bodies(prompt, messages, raw, system=system, max_tokens=max_tokens,
                                           temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop,
                                           json_schema=json_schema, tools=tools, tool_choice=tool_choice,
                                           reasoning_effort=reasoning_effort, reasoning_budget=reasoning_budget,
                                           ignore_eos=ignore_eos, speculation=speculation)
        self.check_request(source, sampling)
        sampling["stream"] = True
        decision = self._route(model_key, source, route)

        def local(method: str) -> Served:
            decode_server, lines = self._on("decode", model_key, lambda s: self._open_stream(
                s, "/generate", {**source, **sampling}, self.decode_timeout))
            return Served(decode_server, method, lines=lines)

        def handoff(exclude):
            return self._open_disaggregated(model_key, source, sampling, exclude)

        served, notes = self._by_route(model_key, decision, handoff, local, started)
        lines, served.lines = served.lines, None
        served.first_piece_at = time.perf_counter()  # _open_stream returned once the first line had arrived
        # -- resume hook (issue 42): a decode server that fails mid-answer hands the answer to another (resume.py)
        moved = resume.Continuation(served, lambda: self._serve_by_route(model_key, decision, handoff, local),
                                    lambda: self._candidates("decode", model_key), self._mark_failure)
        decode_server = served.decode_server
        with self._lock:  # busy for the whole stream, so that least-loaded routing sees it
            decode_server.outstanding += 1
        try:
            if on_route is not None:
                kv = (served.prefill or {}).get("kv") or {}
                on_route({"method": served.method, "prefill_server": served.prefill_server.entry.address
                          if served.prefill_server else None, "decode_server": decode_server.entry.address,
                          "kv_bytes": kv.get("bytes", 0), "warnings": list(notes)})
            pieces, final = _Pieces(), None
            try:
                for line in moved.lines(lines):  # an error line raises in _ndjson_lines; resume hook
                    if line.get("done"):
                        final = line
                        break
                    kind, value = pieces.add(line)
                    if kind == chat.CONTENT:
                        yield value
                    elif parts:
                        yield chat.Part(kind, value)
            except UpstreamTimeout as exc:
                if exc.details.get("stalled"):  # it went silent mid-stream: out of service until it answers
                    self._mark_failure(decode_server, exc.message, hard=True)
                raise
        finally:
            lines.close()
            with self._lock:
                decode_server.outstanding -= 1
        if final is None:
            raise UpstreamError(f"{decode_server.entry.name} ended its stream without a final line")
        served = moved.served  # resume hook: the servers that finished the answer
        if not served.method.startswith("decode_only"):
            served.method = final["metrics"].get("method", "disaggregated")
        served.decode = pieces.answer(final)
        metrics = moved.annotate(served.metrics(started, notes))  # resume hook: where it moved, what it recomputed
        metrics.update(decision.as_metrics())
        self._learn(model_key, source, served, metrics, clean=not notes and not moved.moves)  # resume hook
        self._remember(model_key, metrics)
        yield metrics

    def _open_disaggregated(self, model_key: str, source: dict, sampling: dict, exclude=()) -> Served:
        """``_disaggregated`` up to the first line of the decode server's stream."""
        prefill_server, prefilled, decode_server, lines = self._handoff(
            model_key, source, lambda server, pre: self._open_stream(
                server, "/decode", {"kv": pre["kv"], **sampling}, self.decode_timeout), exclude)
        kind = (prefilled.get("kv") or {}).get("kind")
        return Served(decode_server, "token_ids_recompute" if kind == "token_ids" else "kv_handoff", prefill_server,
                      prefilled, lines=lines)

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

    def generate_many(self, requests_: list[dict], max_workers: int | None = None) -> tuple[list, dict]:
        """Run several ``generate`` calls concurrently; results in order.

        Each item is a dict of ``generate`` keyword arguments. Returns
        ``(results, combined)`` where each result is ``(text, metrics)`` or the
        exception it raised, and ``combined`` is ``overlap_figures``: the sum of
        the requests' own times (waiting behind each other included), the wall
        time, and their ratio, the mean number of requests in flight (not a speedup).
        """
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=max_workers or max(1, len(requests_))) as pool:
            futures = [pool.submit(self.generate, **kwargs) for kwargs in requests_]
            results = []
            for future in futures:
                try:
                    results.append(future.result())
                except Exception as exc:  # reported per request, never lost
                    results.append(exc)
        wall = time.perf_counter() - started
        request_time = sum(r[1]["total_time"] for r in results if isinstance(r, tuple))
        return results, {**overlap_figures(request_time, wall), "requests": len(results),
                         "failed": sum(1 for r in results if not isinstance(r, tuple))}


def overlap_figures(request_time: float, wall_time: float) -> dict:
    """What concurrent requests measure, named for what it is: ``request_time`` (the sum of the requests'
    own times, each including any wait behind the others), ``wall_time``, and ``overlap`` = their ratio,
    the mean number of requests in flight. Requests that queue on one server still overlap in flight, so
    this is never a speedup; a speedup needs a measured sequential baseline."""
    return {"request_time": round(request_time, 6), "wall_time": round(wall_time, 6),
            "overlap": round(request_time / wall_time, 3) if wall_time > 0 and request_time > 0 else None}


def describe_overlap(figures: dict) -> str:
    """'N s of request time in M s of wall time (X requests in flight on average)'."""
    overlap = figures.get("overlap")
    return (f"{figures.get('request_time') or 0:.2f} s of request time in {figures.get('wall_time') or 0:.2f} s "
            f"of wall time" + (f" ({overlap:.2f} requests in flight on average)" if overlap else ""))


def _end_to_end_ttft(started: float, decode_sent_at: float, server_ttft: float | None) -> float | None:
    """Seconds from the client's start of the request to the decode server's first token.

    The client's own clock up to sending the /decode (or fallback /generate) that answered:
    routing, the /prefill round trip, failed attempts, retries and recomputes; plus the decode
    server's ``ttft``, measured from that request's arrival: KV pull, queueing, import (or the
    prompt's evaluation) and the first token. Not counted: the one-way time of that request
    from the client to the decode server (no shared clock), so this is a lower bound by that much.
    """
    if server_ttft is None:
        return None
    return round(decode_sent_at - started + server_ttft, 6)


class _KVLost(DisaggError):
    """The decode server could not get the KV bundle: recompute."""

    status, code = 502, "kv_lost"


def _raise_kv_lost(server: TrackedServer, exc: DisaggError) -> None:
    """An answer from the decode server saying the KV is gone (not a failure to reach it): recompute."""
    if exc.code in KV_LOST_CODES and exc.status != 503 and not exc.details.get("transport"):
        # the decode server is fine; the bundle is not: recompute, do not blame the server
        raise _Attempt(server, _KVLost(exc.message), retryable=False) from None


def _request_bodies(prompt, messages, raw, *, system=None, max_tokens, temperature, top_p, top_k=None, seed=None,
                    stop=None, json_schema=None, tools=None, tool_choice=None, reasoning_effort=None,
                    reasoning_budget=None, ignore_eos=False, speculation=None) -> tuple[dict, dict]:
    """The prompt part (for /prefill and /generate) and the sampling part (for /decode) of a request. The tools
    go in both: the prompt renders them, the decode side reads the calls."""
    if (prompt is None) == (messages is None):
        raise BadRequest("give prompt or messages", field="prompt")
    source = {"messages": messages} if messages is not None else {"prompt": prompt}
    if raw:
        source["raw"] = True
    if system is not None:
        source["system"] = system
    sampling = {"max_new_tokens": max_tokens, "temperature": temperature, "top_p": top_p}
    if top_k is not None:
        sampling["top_k"] = top_k
    if seed is not None:
        sampling["seed"] = seed
    if stop:
        sampling["stop"] = stop
    if json_schema is not None:
        sampling["json_schema"] = json_schema
    if speculation is not None:
        sampling["speculation"] = speculation
    if reasoning_effort is not None:
        source["reasoning_effort"] = reasoning_effort
    if reasoning_budget is not None:
        sampling["reasoning_budget"] = reasoning_budget
    for key, value in (("tools", tools), ("tool_choice", tool_choice)):
        if value is not None:
            source[key] = sampling[key] = value
    if ignore_eos:  # exactly max_tokens (llama.cpp decode servers; others answer 400)
        sampling["ignore_eos"] = True
    return source, sampling


def _answered(server: TrackedServer, status: int, data: dict) -> DisaggError:
    """The error a server answered (with its HTTP status, or as a progress stream's last line)."""
    err = from_body(status, data)
    err.message = f"{server.entry.name} answered {status}: {err.message}"
    err.args = (err.message,)
    return err


class _Pieces:
    """A decode server's answer as its stream's lines bring it (server/decode.py): text pieces, reasoning
    and tool calls, which ``answer`` gives back in the shape of the server's JSON answer."""

    def __init__(self):
        self.text, self.reasoning, self.calls = [], [], []

    @property
    def count(self) -> int:
        """Lines kept so far (resume hook)."""
        return len(self.text) + len(self.reasoning) + len(self.calls)

    def add(self, line: dict) -> tuple[str, object]:
        """Keep a line that is not the last; returns (``chat.CONTENT``, ``chat.REASONING`` or ``chat.TOOL_CALL``,
        what it carries)."""
        if line.get("reasoning") is not None:
            self.reasoning.append(line["reasoning"])
            return chat.REASONING, line["reasoning"]
        if line.get("tool_call") is not None:
            self.calls.append(line["tool_call"])
            return chat.TOOL_CALL, line["tool_call"]
        self.text.append(line.get("text") or "")
        return chat.CONTENT, self.text[-1]

    def answer(self, final: dict) -> dict:
        """The whole answer, given the stream's last line (``done``)."""
        body = {"generated_text": "".join(self.text), "finish_reason": final.get("finish_reason"),
                "metrics": final.get("metrics") or {}}
        if self.reasoning:
            body["reasoning"] = "".join(self.reasoning)
        if self.calls:
            body["tool_calls"] = self.calls
        return body


def _ndjson_lines(resp, server: TrackedServer, watch: Watch):
    """The lines of a progress answer that are not heartbeats; an error line raises as the error it is,
    transport failures as Upstream errors (``watch`` decides when silence is too long)."""
    name = server.entry.name
    try:
        for raw in resp.iter_lines():
            if not raw:
                continue
            line = json.loads(raw)
            if not isinstance(line, dict):
                raise UpstreamError(f"{name} sent a line that is not a JSON object", transport=True)
            if watch.heard(line):
                continue
            if line.get("error") is not None:
                status = line.get("status")
                raise _answered(server, status if isinstance(status, int) else 502,
                                {k: v for k, v in line.items() if k not in ("done", "status")})
            yield line
    except requests.RequestException as exc:
        # a read that timed out mid-stream comes as a ConnectionError around urllib3's ReadTimeoutError
        if isinstance(exc, requests.Timeout) or any(isinstance(a, ReadTimeoutError) for a in exc.args):
            raise watch.timed_out() from None
        raise UpstreamError(f"{name} broke off its answer: {type(exc).__name__}", transport=True) from None
    except ValueError:
        raise UpstreamError(f"{name} sent a line that is not JSON", transport=True) from None
    finally:
        resp.close()


def _prepend(head, rest):
    try:
        yield head
        yield from rest
    finally:
        rest.close()
