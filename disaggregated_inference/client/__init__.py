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

What every server would refuse (``GenerationRequest.check``, with the config's
limits) is refused before any server is chosen, even when none is up. Every answer is read
as progress lines (``watch.py``): a server that falls silent or stops making
progress is given up in seconds and marked down; a caller's own
``prefill_timeout``/``decode_timeout`` that runs out while the server works blames
no server. A server marked down is probed again (its ``/health``) as requests
come, with or without the background health checker, and serves again as soon
as it answers.

The client is safe to share between threads; ``generate_many`` runs several
requests (e.g. the two models of the grader) concurrently.

Its parts: ``servers`` (their health and the choice among them), ``transport`` (HTTP,
progress lines), ``handoff`` (prefill then decode, failover, recompute, fallback) and
``figures`` (a request's metrics, merged once).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from .. import chat
from .. import config as cluster_config
from .. import resume  # issue 42: an answer survives its decode server
from .. import routing
from ..errors import BadRequest, UpstreamError, UpstreamTimeout
from ..metrics import Method, RequestMetrics
from ..request import GenerationRequest, Limits
from ..wire import DecodeAnswer, Final
from .figures import Served, describe_overlap, method_of, overlap_figures
from .handoff import DECODE_CONNECT_RETRY_DELAY, KV_LOST_CODES, FallbackWarning, Handoff
from .servers import REVIVE_INTERVAL, REVIVE_MAX_INTERVAL, ServerPool, TrackedServer
from .transport import Transport, _Pieces

__all__ = ["DisaggregatedClient", "FallbackWarning", "GenerationRequest", "TrackedServer", "KV_LOST_CODES",
           "DECODE_CONNECT_RETRY_DELAY", "REVIVE_INTERVAL", "REVIVE_MAX_INTERVAL", "overlap_figures",
           "describe_overlap"]


class DisaggregatedClient(ServerPool, Transport, Handoff):
    """The cluster's client: ``generate`` / ``stream`` (keyword arguments, or a ``GenerationRequest``; metrics as
    a dict), ``serve`` / ``serve_stream`` (a ``GenerationRequest``; metrics as ``RequestMetrics``)."""

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

    def check_request(self, request: GenerationRequest) -> None:
        """Refuse what every server would (``BadRequest``, ``PayloadTooLarge``, naming the field as the
        servers do), with the config's limits, before any server is chosen, so the answer is the same when
        none is up."""
        request.check(self.limits)

    def _admit(self, request: GenerationRequest, route: str | None) -> tuple[str, dict, routing.Decision]:
        """A request checked and routed: (its model's key, its prompt part, the router's decision)."""
        model_key = self.config.resolve_model(request.model)
        self.check_request(request)
        source = request.prompt_body()
        return model_key, source, self._route(model_key, source, route)

    def generate(self, model: str | GenerationRequest, prompt: str | None = None, max_tokens: int = 256,
                 temperature: float = 0.0, *, messages: list | None = None, top_p: float = 1.0,
                 seed: int | None = None, stop=None, json_schema: dict | None = None, raw: bool = False,
                 top_k: int | None = None, system: str | None = None, route: str | None = None,
                 tools: list | None = None, tool_choice=None, reasoning_effort: str | None = None,
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
        ``ignore_eos``: exactly ``max_tokens`` (llama.cpp decode servers; others answer 400), for benchmarks.
        ``model`` may be a whole ``GenerationRequest`` instead (the other arguments but ``route`` unused)."""
        request = model if isinstance(model, GenerationRequest) else GenerationRequest.of(
            model, prompt, max_tokens, temperature, messages=messages, top_p=top_p, seed=seed, stop=stop,
            json_schema=json_schema, raw=raw, top_k=top_k, system=system, tools=tools, tool_choice=tool_choice,
            reasoning_effort=reasoning_effort, reasoning_budget=reasoning_budget, ignore_eos=ignore_eos,
            speculation=speculation)
        text, metrics = self.serve(request, route)
        return text, metrics.as_dict()

    def serve(self, request: GenerationRequest, route: str | None = None) -> tuple[str, RequestMetrics]:
        """``generate`` for a ``GenerationRequest``, its metrics as their type."""
        started = time.perf_counter()
        model_key, source, decision = self._admit(request, route)
        resume.begin(self._local)  # resume hook: moves of this request's answer between decode servers

        def local(method: Method) -> Served:
            sent, retries = [], []
            decode_server, data = self._on("decode", model_key, lambda s: self._post_retrying_connect(
                s, "/generate", request.generate_body(), sent, retries))
            return Served(decode_server, method, decode=DecodeAnswer.read(data), decode_sent_at=sent[-1],
                          decode_connect_retries=retries)

        served, notes = self._by_route(model_key, decision,
                                       lambda exclude: self._disaggregated(model_key, request, exclude),
                                       local, started)
        metrics = resume.finish(self._local, served.metrics(started, notes, decision.as_metrics()))  # resume hook
        self._learn(model_key, source, served, metrics,  # resume hook: a moved answer's times are no measure
                    clean=not notes and not served.decode_connect_retries and not metrics.resumed)
        self._remember(model_key, metrics)
        return served.decode.generated_text, metrics

    def stream(self, model: str | GenerationRequest, prompt: str | None = None, max_tokens: int = 256,
               temperature: float = 0.0, *, messages: list | None = None, top_p: float = 1.0,
               top_k: int | None = None, seed: int | None = None, stop=None, json_schema: dict | None = None,
               raw: bool = False, system: str | None = None, on_route=None, route: str | None = None,
               tools: list | None = None, tool_choice=None, reasoning_effort: str | None = None,
               reasoning_budget: int | None = None, parts: bool = False, ignore_eos: bool = False,
               speculation: str | None = None):
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
        ``warnings``. ``model`` may be a whole ``GenerationRequest`` instead.
        """
        request = model if isinstance(model, GenerationRequest) else GenerationRequest.of(
            model, prompt, max_tokens, temperature, messages=messages, top_p=top_p, seed=seed, stop=stop,
            json_schema=json_schema, raw=raw, top_k=top_k, system=system, tools=tools, tool_choice=tool_choice,
            reasoning_effort=reasoning_effort, reasoning_budget=reasoning_budget, ignore_eos=ignore_eos,
            speculation=speculation)
        for item in self.serve_stream(request, route, on_route=on_route, parts=parts):
            yield item.as_dict() if isinstance(item, RequestMetrics) else item

    def serve_stream(self, request: GenerationRequest, route: str | None = None, *, on_route=None,
                     parts: bool = False):
        """``stream`` for a ``GenerationRequest``: its pieces, then its metrics as their type."""
        started = time.perf_counter()
        model_key, source, decision = self._admit(request, route)

        def open_local(server):
            with self._counted(server, "prompting"):
                return self._open_stream(server, "/generate", request.generate_body(stream=True), self.decode_timeout)

        def local(method: Method) -> Served:
            decode_server, lines = self._on("decode", model_key, open_local)
            return Served(decode_server, method, lines=lines)

        def handoff(exclude):
            return self._open_disaggregated(model_key, request, exclude)

        served, notes = self._by_route(model_key, decision, handoff, local, started)
        lines, served.lines = served.lines, None
        served.first_piece_at = time.perf_counter()  # _open_stream returned once the first line had arrived
        # -- resume hook (issue 42): a decode server that fails mid-answer hands the answer to another (resume.py)
        moved = resume.Continuation(served, lambda: self._serve_by_route(model_key, decision, handoff, local),
                                    lambda: self._candidates("decode", model_key), self._mark_failure)
        decode_server = served.decode_server
        try:
            with self._counted(decode_server, "outstanding"):  # for the whole stream: least-loaded routing sees it
                if on_route is not None:
                    on_route({"method": served.method.value, "prefill_server": served.prefill_server.entry.address
                              if served.prefill_server else None, "decode_server": decode_server.entry.address,
                              "kv_bytes": (served.prefill.kv.bytes or 0) if served.prefill else 0,
                              "warnings": list(notes)})
                pieces, final = _Pieces(), None
                try:
                    for line in moved.lines(lines):  # an error line raises in _ndjson_lines; resume hook
                        if isinstance(line, Final):
                            final = line
                            break
                        kind, value = pieces.add(line)
                        if kind == chat.CONTENT:
                            yield value
                        elif parts:
                            yield chat.Part(kind, value)
                except UpstreamTimeout as exc:
                    if exc.details.get("stalled"):  # it went silent mid-stream: out of service until it answers
                        self._mark_failure(moved.served.decode_server, exc.message, hard=True)
                    raise
        finally:
            lines.close()
        if final is None:
            raise UpstreamError(f"{decode_server.entry.name} ended its stream without a final line")
        served = moved.served  # resume hook: the servers that finished the answer
        served.decode = pieces.answer(final)
        if not served.method.local:
            served.method = method_of(served.prefill, served.decode)
        # resume hook: where it moved, what it recomputed
        metrics = moved.annotate(served.metrics(started, notes, decision.as_metrics()))
        self._learn(model_key, source, served, metrics, clean=not notes and not moved.moves)  # resume hook
        self._remember(model_key, metrics)
        yield metrics

    def _route(self, model_key: str, source: dict, route: str | None) -> routing.Decision:
        """Handoff or decode-only for this request (``route`` overrides ``client.route``)."""
        mode = route or self.route
        if mode not in routing.MODES:
            raise BadRequest(f"route must be one of {', '.join(routing.MODES)}, got {mode!r}", field="route")
        prefill, decode = self._peek("prefill", model_key), self._peek("decode", model_key)
        queue = 0
        if prefill is not None:  # prompts ahead on the prefill server: every one of ours it evaluates, in a slot
            # or not (it evaluates them oldest first; a streamed prefill's call has answered at once), and the
            # others its last /health saw waiting for a slot
            waiting = int((prefill.health.get("slots") or {}).get("queued") or 0)
            queue = prefill.prompting + max(0, waiting - max(0, prefill.prompting - prefill.slots))
        reported = tuple(s.health.get("prompt_speed") if s is not None else None for s in (prefill, decode))
        # the overlapped handoff, where this client asks for it and the prefill server streams this model
        streamed = self._streams(model_key) and prefill is not None and "streamed" in (
            prefill.health.get("handoff_modes") or ("streamed",))
        chunk = ((prefill.health.get("model_info") or {}).get("n_batch") if prefill is not None else None)
        return self.costs.decide(mode, model_key, routing.prompt_chars(source),
                                 prefill.entry.name if prefill else None, decode.entry.name if decode else None,
                                 prefill_queue=queue, reported=reported, streamed=streamed, chunk_tokens=chunk,
                                 decode_queue=decode.prompting if decode is not None else 0)

    def _learn(self, model_key: str, source: dict, served: Served, metrics: RequestMetrics, clean: bool) -> None:
        """Feed what this request measured to the cost model (``clean``: no retry or fallback inflated its times)."""
        method = served.method
        path = routing.HANDOFF if method == Method.KV_HANDOFF else routing.LOCAL if method.local else None
        if path is None:
            return
        self.costs.observe(model_key, routing.prompt_chars(source), path,
                           served.prefill_server.entry.name if served.prefill_server else None,
                           served.decode_server.entry.name, served.prefill_metrics(),
                           served.decode.metrics, metrics.ttft_end_to_end if clean else None)


    def _remember(self, model_key: str, metrics: RequestMetrics) -> None:
        figures = metrics.as_dict()
        with self._lock:
            self.history.append({"time": time.time(), "model": model_key, **{k: figures.get(k) for k in (
                "method", "prefill_time", "decode_time", "total_time", "prompt_tokens", "completion_tokens",
                "prefill_speed", "decode_speed", "prefill_server", "decode_server", "kv_bytes", "kv_transfer_time",
                "ttft", "ttft_end_to_end", "prompt_tokens_cached", "canary", "route_reason", "reasoning_tokens",
                "draft_tokens", "accepted_tokens")}})


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

