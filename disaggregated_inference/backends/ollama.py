"""Ollama over its HTTP API (the official ``ollama`` client): a token-id handoff, never a KV one.

What moves
    Ollama cannot export or import a KV cache. ``/api/generate`` answers with
    ``context``: the token ids of the rendered prompt plus the generated text
    (no BOS). So this backend hands over ``token_ids`` bundles and the decode
    machine's Ollama recomputes the whole prompt; its metrics say so
    (``prompt_tokens_recomputed`` is that call's ``prompt_eval_count``, which
    counts cached prompt tokens too, so it is an upper bound). A real KV handoff
    needs the llama_cpp backend, which can load the GGUF Ollama has pulled
    (``ollama:NAME``).

Prefill
    One non-streamed generate with ``num_predict: 1`` (``0`` would mean
    unlimited) and temperature 0: Ollama renders the prompt with the model's
    template, evaluates it and samples one token. Ollama builds ``context`` by
    tokenizing ``rendered prompt + generated text`` (the raw text: a thinking
    parser may hide it from ``response``), so the bundle's ids are ``context``
    minus the sampled token: the rendered prompt's ids. Whether that token is
    in ``context`` follows from the counts: it is not when ``done_reason`` is
    ``"stop"`` (EOS), nor when its text was an incomplete UTF-8 sequence that
    Ollama dropped; ``len(context) - prompt_eval_count`` is ``sampled - bos``
    (``prompt_eval_count`` counts a BOS that ``context`` lacks). A difference
    of 1 or -1 settles it and tells whether the model adds a BOS, which this
    backend remembers; a difference of 0 means "sampled, BOS" unless the model
    is known to add none.

Decode
    The decode machine samples the whole answer again from the prompt boundary:
    ``context`` = the prompt's ids, ``template`` = a Go-template comment (it
    replaces the model's template and renders to nothing) and a placeholder
    ``prompt`` (it must not be empty: an empty prompt only loads the model and
    ignores ``context``). Ollama detokenizes the context, appends the empty
    rendering and runs exactly the text one generate of the same prompt runs, so
    with greedy sampling the answer is the same. We do not continue after the
    prefill's token (``context`` minus it plus its text as the prompt under
    ``{{ .Prompt }}``): that token was sampled greedily and without the
    request's ``format``, stop sequences and seed, which only the decode request
    carries, and re-sampling one token costs nothing next to the recomputed
    prompt. The prefill's token is kept as a check: under greedy sampling the
    decode's text must start with it (metric ``first_token_matches_prefill``).

Prompts
    ``prompt`` (+ ``system``) goes through the model's template as one user turn,
    as ``/api/generate`` does. ``messages`` may be system messages followed by
    one user message (the system texts are joined as Ollama joins them);
    ``/api/generate`` has no messages field and ``/api/chat`` returns no
    ``context``, so a conversation with assistant turns is refused (400), never
    cut silently. ``raw`` prompts use the template ``{{ .Prompt }}`` instead of
    Ollama's ``raw`` flag, because a raw generate returns no ``context``; the
    fallback ``generate`` renders them the same way, so both paths agree.

Known limits
    The prompt boundary relies on re-tokenization: if the first sampled token's
    text merges with the end of the rendered prompt when ``prompt + text`` is
    tokenized again (a newline after a template that ends in one, say), the
    ids are off by that token and ``first_token_matches_prefill`` turns false.
    ``thinking`` output (thinking models) is not forwarded, only ``response``;
    ``reasoning_effort`` is not passed on, and ``tools`` are refused (400).
    Every call sends the same runner options (``num_ctx`` = ``n_ctx``, then
    ``ollama_options``): a change would make Ollama reload the model.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from ..metrics import ServerFigures
from ..kv.bundle import KIND_TOKEN_IDS
from ..errors import (BackendUnavailable, BadRequest, DisaggError, FingerprintMismatch,
                      ModelNotFound, Overloaded, UpstreamError, UpstreamTimeout)
from .base import Backend, Event, ModelSettings, Prefilled, Prompt, Received, Sampling, check_fits, rate
from .options import option

log = logging.getLogger(__name__)

DEFAULT_HOST = "http://127.0.0.1:11434"
# Replaces the model's template on the decode call and renders to nothing: the prompt is all in ``context``.
CONTINUE_TEMPLATE = "{{/* disaggregated-inference: the prompt is the context */}}"
CONTINUE_PROMPT = "(prompt in context)"  # never rendered; an empty prompt would only load the model
RAW_TEMPLATE = "{{ .Prompt }}"
CONNECT_TIMEOUT = 5.0
PROBE_TIMEOUT = 1.0  # /health's calls to Ollama must stay quick
BUSY_RETRY_AFTER = 2


def _seconds(ns) -> float:
    return round((ns or 0) / 1e9, 6)


def canonical_name(name: str) -> str:
    """``qwen3`` -> ``qwen3:latest``; the default registry and namespace dropped, as ``/api/tags`` names them."""
    name = name.strip().lower()
    for prefix in ("registry.ollama.ai/", "library/"):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


@dataclass(frozen=True)
class OllamaSettings(ModelSettings):
    ollama_host: str | None = option(None, f"the Ollama daemon's URL (unset: $OLLAMA_HOST, else {DEFAULT_HOST})")
    ollama_timeout: float = option(300.0, "seconds a call to Ollama may take (loading a big model takes minutes)",
                                   above=0)
    keep_alive: str | int = option("30m", "how long Ollama keeps the model loaded after a request (Ollama's "
                                          "keep_alive: a duration or seconds)")
    ollama_options: dict = option({}, "runner options sent with every request (num_gpu, num_batch, ...; "
                                      "num_ctx comes from n_ctx)")


class OllamaBackend(Backend):
    name = "ollama"
    handoff_kind = KIND_TOKEN_IDS
    accepts = (KIND_TOKEN_IDS,)
    Settings = OllamaSettings

    def __init__(self, settings):
        import httpx
        import ollama  # the official client, imported with the first backend that uses it

        super().__init__(settings)
        host = settings.ollama_host or os.environ.get("OLLAMA_HOST") or DEFAULT_HOST
        # Reads may wait as long as ollama_timeout (a big model loads for minutes); connecting may not.
        timeout = httpx.Timeout(settings.ollama_timeout, connect=min(settings.ollama_timeout, CONNECT_TIMEOUT))
        self.client = ollama.Client(host=host, timeout=timeout)
        # The client's own parsing of the host (default port, scheme), so messages name what it dials.
        self.host = str(self.client._client.base_url).rstrip("/")
        # Plain GETs (/api/version, /api/tags, /api/ps) on a client of their own: /health calls
        # describe() from HTTP threads while the model thread streams on self.client.
        self._http = httpx.Client(base_url=self.host, timeout=timeout)
        self.model = settings.model  # as configured, for messages
        self.model_name = settings.model  # as /api/tags lists it, once found there: requests use this
        self.model_digest: str | None = None
        self.ollama_version: str | None = None
        self._bos: int | None = None  # whether the runner adds a BOS, once a prefill's counts showed it

    # -- errors ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _ollama_errors(self, what: str, timeout: float | None = None):
        """Translate what the client raises into the project's errors, naming host and model."""
        import httpx
        import ollama

        try:
            yield
        except ollama.ResponseError as exc:
            raise self._from_response(exc.status_code, exc.error, what) from None
        except httpx.ConnectTimeout:
            raise BackendUnavailable(f"Ollama at {self.host} did not accept a connection within "
                                     f"{min(timeout or CONNECT_TIMEOUT, CONNECT_TIMEOUT):g}s during {what}",
                                     host=self.host) from None
        except httpx.TimeoutException:
            raise UpstreamTimeout(f"Ollama at {self.host} did not answer {what} within "
                                  f"{timeout or self.settings.ollama_timeout:g}s", host=self.host) from None
        except (ConnectionError, httpx.ConnectError):
            raise BackendUnavailable(f"Ollama is not running at {self.host} (connection refused during {what}); "
                                     "start it with 'ollama serve' or set ollama_host", host=self.host) from None
        except httpx.HTTPError as exc:  # the connection broke off, a malformed response
            raise UpstreamError(f"connection to Ollama at {self.host} failed during {what}: "
                                f"{type(exc).__name__}: {exc}", host=self.host) from None
        except ValueError as exc:  # a line that is not JSON, or not a generate response
            raise UpstreamError(f"Ollama at {self.host} sent something unreadable during {what}: {exc}",
                                host=self.host) from None

    def _from_response(self, status: int, message: str, what: str) -> DisaggError:
        where = f"Ollama at {self.host}"
        if status == 404:
            return ModelNotFound(f"{where} has no model '{self.model}' ({message}); run: ollama pull {self.model}",
                                 field="model", hint=f"ollama pull {self.model}", upstream_status=404)
        if status in (429, 503):
            return Overloaded(f"{where} is busy: {message}", retry_after=BUSY_RETRY_AFTER, upstream_status=status)
        if status == 400:
            return BadRequest(f"{where} refused {what}: {message}", upstream_status=400)
        if status == -1:
            return UpstreamError(f"{where} failed during {what} after it began answering: {message}")
        return UpstreamError(f"{where} answered {status} to {what}: {message}", upstream_status=status)

    def _get(self, path: str, timeout: float | None = None) -> dict:
        import httpx

        with self._ollama_errors(f"GET {path}", timeout):
            resp = self._http.get(path, timeout=timeout or httpx.USE_CLIENT_DEFAULT)
            if resp.status_code != 200:
                raise UpstreamError(f"Ollama at {self.host} answered {resp.status_code} to GET {path}: "
                                    f"{resp.text[:200]}", upstream_status=resp.status_code, host=self.host)
            body = resp.json()
        if not isinstance(body, dict):
            raise UpstreamError(f"{self.host} answered GET {path} with {type(body).__name__}; is it Ollama?")
        return body

    def _find(self, listing: dict) -> dict | None:
        wanted = canonical_name(self.model)
        for entry in listing.get("models") or ():
            if wanted in {canonical_name(entry.get(k) or "") for k in ("name", "model")}:
                return entry
        return None

    # -- loading ---------------------------------------------------------------------------------

    def load(self, progress: Callable[[str], None] = lambda message: None) -> None:
        progress(f"asking Ollama at {self.host}")
        self.ollama_version = self._get("/api/version").get("version")
        entry = self._find(self._get("/api/tags"))
        if entry is None:
            raise ModelNotFound(f"Ollama at {self.host} has not pulled '{self.model}'; run: ollama pull {self.model}",
                                field="model", hint=f"ollama pull {self.model}")
        self.model_name = entry.get("name") or entry.get("model")
        self.model_digest = entry.get("digest")
        progress(f"loading {self.model} into Ollama {self.ollama_version} "
                 f"(num_ctx={self.runner_options()['num_ctx']}, keep_alive={self.settings.keep_alive})")
        started = time.perf_counter()
        with self._ollama_errors("loading the model"):  # an empty prompt only loads: done_reason "load"
            self.client.generate(model=self.model_name, prompt="", stream=False, options=self.runner_options(),
                                 keep_alive=self.settings.keep_alive)
        progress(f"loaded in {time.perf_counter() - started:.1f}s")

    def fingerprint(self) -> dict:
        # Ollama's names are case-insensitive: two machines that pulled "Qwen3" and "qwen3" serve one model.
        return {"backend": self.name, "ollama_model": canonical_name(self.model_name),
                "model_digest": self.model_digest}

    def describe(self) -> dict:
        """For /health: never raises, and asks Ollama with a short timeout."""
        info = {"ollama_host": self.host, "ollama_model": self.model_name, "model_digest": self.model_digest,
                "runner_options": self.runner_options(), "keep_alive": self.settings.keep_alive,
                "handoff": "token ids; the decode machine recomputes the prompt"}
        try:
            info["ollama_version"] = self._get("/api/version", PROBE_TIMEOUT).get("version")
            info["ollama_answers"] = True
            pulled = self._find(self._get("/api/tags", PROBE_TIMEOUT))
            info["model_pulled"] = pulled is not None
            if pulled:
                info["details"] = pulled.get("details")
                info["size"] = pulled.get("size")
            loaded = self._find(self._get("/api/ps", PROBE_TIMEOUT))
            info["model_loaded"] = loaded is not None
            if loaded:
                info["loaded"] = {k: loaded.get(k) for k in ("size_vram", "expires_at", "context_length")}
        except DisaggError as exc:
            info.setdefault("ollama_answers", False)
            info["ollama_error"] = exc.message
        info["ready"] = bool(info.get("ollama_answers") and info.get("model_pulled"))
        return info

    def served_model(self) -> str:
        return self.model_name  # as Ollama lists it once loaded ("qwen3-coder:30b")

    def close(self) -> None:
        self.client.close()
        self._http.close()

    # -- requests --------------------------------------------------------------------------------

    def runner_options(self) -> dict:
        """Options that shape the loaded runner: identical on every call, or Ollama reloads the model."""
        return {"num_ctx": self.settings.n_ctx, **self.settings.ollama_options}

    @staticmethod
    def sampling_options(sampling: Sampling) -> dict:
        options = {"num_predict": sampling.max_new_tokens, "temperature": sampling.temperature,
                   "top_p": sampling.top_p, "top_k": sampling.top_k}
        if sampling.seed is not None:
            options["seed"] = sampling.seed
        if sampling.stop:  # replaces the model's own stop list (its EOS tokens still stop it)
            options["stop"] = list(sampling.stop)
        return options

    def render(self, prompt: Prompt) -> dict:
        """The ``prompt``/``system``/``template`` fields that make Ollama render this prompt."""
        if prompt.tools is not None:
            raise BadRequest("the ollama backend renders no tools (its /api/generate has none); serve tool calls "
                             "with a llama_cpp server of the same GGUF (\"model\": \"ollama:NAME\")", field="tools")
        if prompt.raw:
            if prompt.messages is not None:
                raise BadRequest("'raw' takes a 'prompt' string, not 'messages'", field="raw")
            text = prompt.text if prompt.system is None else f"{prompt.system}\n\n{prompt.text}"
            return {"prompt": text, "template": RAW_TEMPLATE}
        if prompt.messages is None:
            return {"prompt": prompt.text, **({"system": prompt.system} if prompt.system else {})}
        messages = list(prompt.messages)
        system = [prompt.system] if prompt.system else []
        while messages and messages[0]["role"] in ("system", "developer"):
            system.append(messages.pop(0)["content"])
        if len(messages) != 1 or messages[0]["role"] != "user":
            raise BadRequest("the ollama backend renders system messages followed by one user message "
                             "(/api/generate has no conversation); send earlier turns inside that message",
                             field="messages")
        return {"prompt": messages[0]["content"], **({"system": "\n\n".join(system)} if system else {})}

    def _request(self, fields: dict, options: dict, fmt=None) -> dict:
        request = {"model": self.model_name, **fields, "options": options, "keep_alive": self.settings.keep_alive}
        if fmt is not None:
            request["format"] = fmt
        return request

    def _check_fits(self, n_prompt: int) -> None:
        check_fits(n_prompt, self.runner_options()["num_ctx"], "this server's Ollama context (num_ctx)")

    # -- the handoff -----------------------------------------------------------------------------

    def sampled_in_context(self, done_reason: str | None, n_context: int, prompt_eval_count: int | None) -> int:
        """How many ids at the end of a ``num_predict: 1`` context are the sampled token (0 or 1)."""
        diff = n_context - (prompt_eval_count or 0)  # = sampled - bos
        if done_reason != "length":  # EOS (or a stop string): no text was generated
            sampled = 0
        elif self._bos is not None:
            sampled = diff + self._bos
        else:
            sampled = 1 if diff >= 0 else 0
        if (done_reason != "length" or diff in (-1, 1)) and sampled - diff in (0, 1):
            self._bos = sampled - diff  # a property of the model: later ambiguous cases use it
        return min(max(sampled, 0), 1)

    def prefill(self, prompt: Prompt) -> Prefilled:
        started = time.perf_counter()
        options = {**self.runner_options(), "num_predict": 1, "temperature": 0.0}
        request = self._request(self.render(prompt), options)
        with self._ollama_errors("the prefill"):
            resp = self.client.generate(stream=False, **request)
        context = list(resp.context or ())
        if not context:
            raise UpstreamError(f"Ollama at {self.host} returned no context for the prefill")
        sampled = self.sampled_in_context(resp.done_reason, len(context), resp.prompt_eval_count)
        tokens = context[:len(context) - sampled]
        self._check_fits(len(tokens))
        prefill_time = _seconds(resp.prompt_eval_duration)
        n_prompt = resp.prompt_eval_count or 0
        return Prefilled(
            kind=KIND_TOKEN_IDS, tokens=tokens, payload=b"", fingerprint=self.fingerprint(),
            metrics=ServerFigures.of(**{"prompt_tokens": n_prompt, "context_tokens": len(tokens),
                     "prefill_time": prefill_time, "prefill_speed": rate(n_prompt, prefill_time),
                     "sample_time": _seconds(resp.eval_duration), "ollama_load_time": _seconds(resp.load_duration),
                     "ollama_total_time": _seconds(resp.total_duration),
                     "backend_time": round(time.perf_counter() - started, 6)}),
            meta={"ollama_first_token": resp.response or "", "ollama_done_reason": resp.done_reason,
                  "ollama_context_tokens": len(context), "ollama_prompt_eval_count": n_prompt},
        )

    def decode(self, received: Received, sampling: Sampling, cancelled) -> Iterator[Event]:
        if received.kind != KIND_TOKEN_IDS:
            raise FingerprintMismatch(f"the ollama backend continues token ids only, not a {received.kind!r} bundle",
                                      field="kv")
        self._check_fits(len(received.tokens))
        fields = {"prompt": CONTINUE_PROMPT, "template": CONTINUE_TEMPLATE, "context": list(received.tokens)}
        request = self._request(fields, {**self.runner_options(), **self.sampling_options(sampling)},
                                sampling.json_schema)
        greedy = sampling.temperature == 0 and sampling.json_schema is None
        expect = received.meta.get("ollama_first_token") if greedy else None
        yield from self._stream(request, cancelled, method="ollama_context", what="the decode", expect=expect or None)

    def generate(self, prompt: Prompt, sampling: Sampling, cancelled) -> Iterator[Event]:
        request = self._request(self.render(prompt), {**self.runner_options(), **self.sampling_options(sampling)},
                                sampling.json_schema)
        yield from self._stream(request, cancelled, method="decode_only", what="the generation")

    def _stream(self, request: dict, cancelled, *, method: str, what: str, expect: str | None = None):
        started = time.perf_counter()
        stream, final, first_at, lines, head = None, None, None, 0, ""
        try:
            with self._ollama_errors(what):
                stream = self.client.generate(stream=True, **request)  # sends nothing before the first next()
                for part in stream:
                    lines += 1
                    piece = part.response
                    if piece:
                        first_at = first_at or time.perf_counter()
                        if expect is not None and len(head) < len(expect):
                            head += piece
                        yield Event(piece=piece)
                    if part.done:
                        final = part
                        break
                    if cancelled():
                        break
        finally:
            if stream is not None:
                stream.close()  # ends the HTTP response: Ollama stops generating when its client goes
        ended = time.perf_counter()
        if final is None and not cancelled():
            raise UpstreamError(f"Ollama at {self.host} ended {what} without its final line")
        metrics = self._metrics(final, lines, method)
        metrics["first_token_time"] = round((first_at or ended) - started, 6)
        metrics["backend_time"] = round(ended - started, 6)
        if method != "decode_only":  # Ollama shows no logits: a handoff through it cannot be checked
            metrics["canary"] = "unavailable"
        if expect is not None:
            metrics["first_token_matches_prefill"] = head.startswith(expect) if len(head) >= len(expect) else None
            if metrics["first_token_matches_prefill"] is False:
                log.warning("decode text %r does not start with the prefill's token %r: the prompt boundary in "
                            "the context is off", head, expect)
        yield Event(metrics=ServerFigures.of(**metrics))

    @staticmethod
    def _metrics(final, lines: int, method: str) -> dict:
        if final is None:  # cancelled: Ollama's counts never came; one line is about one token
            return {"prompt_tokens": None, "prompt_tokens_recomputed": None, "completion_tokens": lines,
                    "decode_time": None, "decode_speed": None, "kv_load_time": 0.0, "method": method,
                    "finish_reason": "cancelled"}
        n_prompt, n_out = final.prompt_eval_count or 0, final.eval_count or 0
        decode_time, prompt_time = _seconds(final.eval_duration), _seconds(final.prompt_eval_duration)
        return {
            "prompt_tokens": n_prompt,
            "prompt_tokens_recomputed": n_prompt,
            "completion_tokens": n_out,
            "decode_time": decode_time,
            "decode_speed": rate(n_out, decode_time),
            "prefill_time": prompt_time,
            "prefill_speed": rate(n_prompt, prompt_time),
            "ollama_load_time": _seconds(final.load_duration),
            "ollama_total_time": _seconds(final.total_duration),
            "kv_load_time": 0.0,
            "method": method,
            "finish_reason": final.done_reason or "stop",
        }
