"""The client: route each request to a prefill/decode pair, fail over, fall back.

``client.generate(model=..., prompt=..., max_tokens=...)`` returns ``(text,
metrics)``. One request goes:

1. ``POST /prefill`` on the least-loaded healthy prefill server of the model
   (another one if it fails);
2. ``POST /decode`` on a decode server with the KV reference; the decode server
   pulls the bundle from the prefill server itself;
3. a lost KV (lease expired, prefill server gone) is recomputed once: a new
   prefill, a new decode;
4. with no prefill server left, or a handoff that failed twice, the decode
   server generates alone (``POST /generate``) and ``metrics["method"]`` says
   ``decode_only_fallback``, with a warning;
5. with no decode server able to serve, ``NoServerAvailable`` is raised within
   the configured timeouts.

The client is safe to share between threads; ``generate_many`` runs several
requests (e.g. the two models of the grader) concurrently.
"""
from __future__ import annotations

import logging
import threading
import time
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import requests
from requests.adapters import HTTPAdapter

from . import config as cluster_config
from .errors import BadRequest, DisaggError, NoServerAvailable, UpstreamError, UpstreamTimeout, from_body

log = logging.getLogger(__name__)

# Decode-server answers that mean "the KV is gone, recompute": unknown/expired
# handle, unreachable prefill server, unusable bundle.
KV_LOST_CODES = {"not_found", "lease_expired", "upstream_error", "upstream_timeout", "bad_bundle"}


class FallbackWarning(UserWarning):
    """A request was served in a degraded mode (decode-only, recompute)."""


@dataclass
class ServerState:
    entry: cluster_config.ServerEntry
    up: bool = True           # optimistic until a check or a request says otherwise
    failures: int = 0
    last_error: str | None = None
    last_checked: float | None = None
    latency_s: float | None = None
    outstanding: int = 0
    served: int = 0
    health: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        e = self.entry
        return {"name": e.name, "role": e.role, "model": e.model, "url": e.url, "up": self.up,
                "failures": self.failures, "last_error": self.last_error, "last_checked": self.last_checked,
                "latency_s": self.latency_s, "outstanding": self.outstanding, "served": self.served,
                "loaded": self.health.get("loaded"), "backend": self.health.get("backend"),
                "handoff": self.health.get("handoff")}


class _Attempt(Exception):
    """One server failed; the caller may try another."""

    def __init__(self, server: ServerState, error: DisaggError, retryable: bool = True):
        super().__init__(str(error))
        self.server, self.error, self.retryable = server, error, retryable


class DisaggregatedClient:
    def __init__(self, config=None, *, health_check: bool = True, api_token: str | None = None):
        self.config = cluster_config.coerce(config)
        opts = self.config.client
        self.prefill_timeout = float(opts["prefill_timeout"])
        self.decode_timeout = float(opts["decode_timeout"])
        self.connect_timeout = float(opts["connect_timeout"])
        self.health_timeout = float(opts["health_timeout"])
        self.retries = int(opts["retries"])
        self.failures_before_down = int(opts["failures_before_down"])
        self.api_token = api_token or opts.get("api_token") or self.config.server.get("api_token")
        self.history: deque = deque(maxlen=int(opts["history_size"]))
        self._lock = threading.Lock()
        self._local = threading.local()
        self._rr = 0
        self.servers = {e.name: ServerState(e) for e in self.config.servers}
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

    def _post(self, server: ServerState, path: str, body: dict, timeout: float) -> dict:
        url = server.entry.url + path
        started = time.perf_counter()
        try:
            resp = self.session.post(url, json=body, timeout=(self.connect_timeout, timeout))
        except requests.Timeout:
            raise UpstreamTimeout(f"{server.entry.name} ({url}) timed out after {timeout:g}s", transport=True) from None
        except requests.RequestException as exc:
            raise UpstreamError(f"{server.entry.name} ({url}) unreachable: {type(exc).__name__}",
                                transport=True) from None
        server.latency_s = round(time.perf_counter() - started, 4)
        try:
            data = resp.json()
        except ValueError:
            data = {"error": resp.text[:300]}
        if resp.status_code != 200:
            err = from_body(resp.status_code, data)
            err.message = f"{server.entry.name} answered {resp.status_code}: {err.message}"
            err.args = (err.message,)
            raise err
        return data

    # -- server choice and health --------------------------------------------------------------

    def _candidates(self, role: str, model_key: str) -> list[ServerState]:
        with self._lock:
            pool = [s for s in self.servers.values() if s.entry.role == role and s.entry.model == model_key]
            healthy = [s for s in pool if s.up]
            self._rr += 1
            rr = self._rr
        # least outstanding requests first; round-robin among ties
        order = sorted(range(len(healthy)), key=lambda i: (healthy[i].outstanding, (i - rr) % max(1, len(healthy))))
        return [healthy[i] for i in order]

    def _mark_failure(self, server: ServerState, error: str, hard: bool = False) -> None:
        with self._lock:
            server.failures += 1
            server.last_error = error
            if hard or server.failures >= self.failures_before_down:
                if server.up:
                    log.warning("server marked down: name=%s error=%s", server.entry.name, error)
                server.up = False

    def _mark_ok(self, server: ServerState) -> None:
        with self._lock:
            if not server.up:
                log.warning("server marked up: name=%s", server.entry.name)
            server.up, server.failures, server.last_error = True, 0, None

    def check_health(self) -> list[dict]:
        """Check every server once, now; update their states; return them."""
        for server in list(self.servers.values()):
            self._check_one(server)
        return self.status()

    def _check_one(self, server: ServerState) -> None:
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
        """Run ``call(server)`` on the first server of a role that succeeds; mark failures."""
        tried = []
        for server in self._candidates(role, model_key):
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
                if 400 <= exc.status < 500 and exc.status not in (404, 408, 409, 429):
                    raise  # the request is at fault, not the server
                self._mark_failure(server, exc.message, hard=exc.code in ("upstream_error", "upstream_timeout"))
            finally:
                with self._lock:
                    server.outstanding -= 1
        raise NoServerAvailable(f"no {role} server for model {model_key!r} could serve the request"
                                + (f" (tried: {'; '.join(tried)})" if tried else " (none healthy)"),
                                tried=tried)

    def generate(self, model: str, prompt: str | None = None, max_tokens: int = 256, temperature: float = 0.0, *,
                 messages: list | None = None, top_p: float = 1.0, seed: int | None = None, stop=None,
                 json_schema: dict | None = None, raw: bool = False) -> tuple[str, dict]:
        started = time.perf_counter()
        model_key = self.config.resolve_model(model)
        if (prompt is None) == (messages is None):
            raise BadRequest("give prompt or messages", field="prompt")
        source = {"messages": messages} if messages is not None else {"prompt": prompt}
        if raw:
            source["raw"] = True
        sampling = {"max_new_tokens": max_tokens, "temperature": temperature, "top_p": top_p}
        if seed is not None:
            sampling["seed"] = seed
        if stop:
            sampling["stop"] = stop
        if json_schema is not None:
            sampling["json_schema"] = json_schema

        notes: list[str] = []
        answer = None
        for attempt in range(1 + self.retries):
            try:
                answer = self._disaggregated(model_key, source, sampling)
                break
            except NoServerAvailable as exc:
                if exc.details.get("role") == "decode":
                    raise
                notes.append(str(exc.message))
                if not self._candidates("prefill", model_key):
                    break
            except _KVLost as exc:
                notes.append(f"KV handoff failed ({exc}); recomputing" if attempt == 0 else f"KV handoff failed again ({exc})")
        if answer is None:
            message = "; ".join(notes) or "no prefill server available"
            warnings.warn(f"Using fallback mode (decode-only, slower): {message}", FallbackWarning, stacklevel=2)
            decode_server, data = self._on("decode", model_key, lambda s: self._post(
                s, "/generate", {**source, **sampling}, self.decode_timeout))
            answer = {"prefill": None, "prefill_server": None, "decode": data, "decode_server": decode_server,
                      "method": "decode_only_fallback"}
        metrics = self._metrics(answer, started, notes)
        with self._lock:
            self.history.append({"time": time.time(), "model": model_key, **{k: metrics.get(k) for k in (
                "method", "prefill_time", "decode_time", "total_time", "prompt_tokens", "completion_tokens",
                "prefill_speed", "decode_speed", "prefill_server", "decode_server", "kv_bytes")}})
        return answer["decode"]["generated_text"], metrics

    def _disaggregated(self, model_key: str, source: dict, sampling: dict) -> dict:
        if not self._candidates("decode", model_key):
            raise NoServerAvailable(f"no healthy decode server for model {model_key!r}", role="decode")
        prefill_server, prefilled = self._on("prefill", model_key, lambda s: self._post(
            s, "/prefill", source, self.prefill_timeout))

        def decode_on(server: ServerState):
            body = {"kv": prefilled["kv"], **sampling}
            try:
                return self._post(server, "/decode", body, self.decode_timeout)
            except DisaggError as exc:
                # an answer from the decode server saying the KV is gone (not a failure to reach it)
                if exc.code in KV_LOST_CODES and exc.status != 503 and not exc.details.get("transport"):
                    # the decode server is fine; the bundle is not: recompute, do not blame the server
                    raise _Attempt(server, _KVLost(exc.message), retryable=False) from None
                raise

        try:
            decode_server, decoded = self._on("decode", model_key, decode_on)
        except NoServerAvailable as exc:
            exc.details["role"] = "decode"
            raise
        return {"prefill": prefilled, "prefill_server": prefill_server, "decode": decoded,
                "decode_server": decode_server, "method": decoded["metrics"].get("method", "disaggregated")}

    @staticmethod
    def _metrics(answer: dict, started: float, notes: list) -> dict:
        pre = (answer["prefill"] or {}).get("metrics", {})
        dec = answer["decode"]["metrics"]
        prompt_tokens = dec.get("prompt_tokens") or pre.get("prompt_tokens") or 0
        completion = dec.get("completion_tokens", 0)
        prefill_time = pre.get("prefill_time", dec.get("prompt_eval_time", 0.0)) if answer["prefill"] else dec.get(
            "prompt_eval_time", 0.0)
        metrics = {
            "prefill_time": prefill_time,
            "decode_time": dec.get("decode_time"),
            "total_time": round(time.perf_counter() - started, 6),
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prefill_speed": pre.get("prefill_speed") if answer["prefill"] else dec.get("prompt_eval_speed"),
            "decode_speed": dec.get("decode_speed"),
            "method": answer["method"],
            "prefill_server": answer["prefill_server"].entry.address if answer["prefill_server"] else None,
            "decode_server": answer["decode_server"].entry.address,
            "kv_bytes": dec.get("kv_bytes", 0),
            "kv_transfer_time": dec.get("kv_transfer_time", 0.0),
            "kv_load_time": dec.get("kv_load_time"),
            "ttft": dec.get("ttft"),
            "prompt_tokens_recomputed": dec.get("prompt_tokens_recomputed"),
            "finish_reason": answer["decode"].get("finish_reason"),
        }
        if notes:
            metrics["warnings"] = list(notes)
        return metrics

    def generate_many(self, requests_: list[dict], max_workers: int | None = None) -> tuple[list, dict]:
        """Run several ``generate`` calls concurrently; results in order.

        Each item is a dict of ``generate`` keyword arguments. Returns
        ``(results, combined)`` where each result is ``(text, metrics)`` or the
        exception it raised, and ``combined`` has the wall time, the sum of the
        requests' own times and the speedup of running them in parallel.
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
        sequential = sum(r[1]["total_time"] for r in results if isinstance(r, tuple))
        combined = {"wall_time": round(wall, 6), "sequential_time": round(sequential, 6),
                    "speedup": round(sequential / wall, 3) if wall > 0 else None,
                    "requests": len(results), "failed": sum(1 for r in results if not isinstance(r, tuple))}
        return results, combined


class _KVLost(DisaggError):
    """The decode server could not get the KV bundle: recompute."""

    status, code = 502, "kv_lost"
