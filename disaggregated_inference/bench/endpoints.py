"""Where the bench sends requests: the cluster (through the client, or its gateway) and the peers.

Every endpoint streams a request as ``DisaggregatedClient.stream`` does: text pieces, then one metrics dict
(``prompt_tokens``, ``completion_tokens``, and whatever else the endpoint says), so that one timer
(``measure.time_stream``) times them all on the same clock. A peer is any OpenAI-API endpoint
(``/v1/chat/completions``: llama.cpp's ``llama-server``, vLLM, the project's own gateway) or Ollama
(``/api/chat``), named ``--peer NAME=URL`` (``NAME=openai:URL`` or ``NAME=ollama:URL`` to say which; by
default an endpoint that answers Ollama's ``/api/version`` is taken for Ollama: the project's gateway speaks
both).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import requests

from ..errors import ConfigError, UpstreamError
from .workloads import BenchRequest

PROTOCOLS = ("openai", "ollama")


@dataclass
class PeerSpec:
    name: str
    url: str
    protocol: str | None = None  # None: ask the peer


def parse_peer(text: str) -> PeerSpec:
    """``NAME=URL``, ``NAME=openai:URL`` or ``NAME=ollama:URL`` (argparse ``type``)."""
    import argparse

    name, sep, rest = text.partition("=")
    if not sep or not name.strip() or not rest.strip():
        raise argparse.ArgumentTypeError(f"a peer is NAME=URL (e.g. mac-only=http://mac:11434), not {text!r}")
    protocol = None
    for p in PROTOCOLS:
        if rest.startswith(p + ":") and not rest.startswith(p + "://"):
            protocol, rest = p, rest[len(p) + 1:]
    if not rest.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"peer {name}: {rest!r} is not an http(s) URL")
    if name.strip() == "ours":
        raise argparse.ArgumentTypeError("'ours' names the cluster itself: give the peer another name")
    return PeerSpec(name.strip(), rest.rstrip("/"), protocol)


def openai_body(request: BenchRequest, model_name: str) -> dict:
    """The request as OpenAI's chat completions take it: the same prompt, budget, seed and temperature; a
    JSON schema as ``response_format``."""
    kw = request.kwargs
    messages = list(kw.get("messages") or [{"role": "user", "content": kw["prompt"]}])
    if kw.get("system"):
        messages.insert(0, {"role": "system", "content": kw["system"]})
    body = {"model": model_name, "messages": messages, "max_tokens": kw["max_tokens"],
            "temperature": kw.get("temperature", 0.0), "stream": True, "stream_options": {"include_usage": True}}
    if kw.get("seed") is not None:
        body["seed"] = kw["seed"]
    if kw.get("json_schema"):
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer",
                                                                          "schema": kw["json_schema"]}}
    return body


def ollama_body(request: BenchRequest, model_name: str) -> dict:
    kw = request.kwargs
    messages = list(kw.get("messages") or [{"role": "user", "content": kw["prompt"]}])
    if kw.get("system"):
        messages.insert(0, {"role": "system", "content": kw["system"]})
    options = {"num_predict": kw["max_tokens"], "temperature": kw.get("temperature", 0.0)}
    if kw.get("seed") is not None:
        options["seed"] = kw["seed"]
    body = {"model": model_name, "messages": messages, "stream": True, "options": options}
    if kw.get("json_schema"):
        body["format"] = kw["json_schema"]
    return body


@dataclass
class HttpEndpoint:
    """An OpenAI- or Ollama-API endpoint: a peer, or the cluster's gateway (``--via gateway``)."""

    name: str
    url: str
    protocol: str
    model_names: dict = field(default_factory=dict)  # model key -> the name this endpoint knows it by
    timeout: float = 180.0
    role: str = "peer"  # or "gateway": the cluster's own (--via gateway)
    session: requests.Session = field(default_factory=requests.Session)

    def model_name(self, key: str) -> str:
        return self.model_names.get(key, key)

    def stream(self, request: BenchRequest):
        name = self.model_name(request.model)
        if self.protocol == "ollama":
            path, body, read = "/api/chat", ollama_body(request, name), _ollama_lines
        else:
            path, body, read = "/v1/chat/completions", openai_body(request, name), _sse_lines
        try:
            resp = self.session.post(self.url + path, json=body, stream=True, timeout=(5, self.timeout))
        except requests.RequestException as exc:
            raise UpstreamError(f"{self.name}: {type(exc).__name__}: {exc}") from None
        with resp:
            if resp.status_code != 200:
                raise UpstreamError(f"{self.name}: HTTP {resp.status_code}: {resp.text[:200]}")
            try:
                yield from read(resp)
            except requests.RequestException as exc:
                raise UpstreamError(f"{self.name}: {type(exc).__name__}: {exc}") from None

    def check(self) -> None:
        """Raise a ConfigError naming this endpoint if it does not answer (before any load is sent)."""
        path = "/api/tags" if self.protocol == "ollama" else "/v1/models"
        try:
            resp = self.session.get(self.url + path, timeout=5)
        except requests.RequestException as exc:
            raise ConfigError(f"{self._label} at {self.url} does not answer: {type(exc).__name__}",
                              field=self._flag) from None
        if resp.status_code >= 400:
            raise ConfigError(f"{self._label} at {self.url}: GET {path} answered HTTP {resp.status_code}",
                              field=self._flag)

    @property
    def _label(self) -> str:
        return f"peer {self.name}" if self.role == "peer" else "the cluster's gateway"

    @property
    def _flag(self) -> str:
        return "--peer" if self.role == "peer" else "--via"

    def close(self) -> None:
        self.session.close()


def detect_protocol(url: str) -> str:
    """``ollama`` if the endpoint answers Ollama's ``/api/version``, else ``openai``."""
    try:
        resp = requests.get(url + "/api/version", timeout=5)
        if resp.status_code == 200 and "version" in resp.json():
            return "ollama"
    except (requests.RequestException, ValueError):
        pass
    return "openai"


def _sse_lines(resp):
    final = {}
    pieces = 0
    for raw in resp.iter_lines():
        if not raw or not raw.startswith(b"data:"):
            continue
        data = raw[5:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if chunk.get("error"):
            raise UpstreamError(f"stream error: {chunk['error']}")
        for choice in chunk.get("choices") or []:
            text = (choice.get("delta") or {}).get("content") or (choice.get("delta") or {}).get("reasoning_content")
            if text:
                pieces += 1
                yield text
            if choice.get("finish_reason"):
                final["finish_reason"] = choice["finish_reason"]
        if chunk.get("usage"):
            final["prompt_tokens"] = chunk["usage"].get("prompt_tokens") or 0
            final["completion_tokens"] = chunk["usage"].get("completion_tokens") or 0
    if "completion_tokens" not in final:  # no usage: the pieces are the nearest count
        final.update(completion_tokens=pieces, usage_missing=True)
    yield final


def _ollama_lines(resp):
    for raw in resp.iter_lines():
        if not raw:
            continue
        line = json.loads(raw)
        if line.get("error"):
            raise UpstreamError(f"stream error: {line['error']}")
        text = (line.get("message") or {}).get("content") or (line.get("message") or {}).get("thinking")
        if text:
            yield text
        if line.get("done"):
            ns = 1e-9
            yield {"prompt_tokens": line.get("prompt_eval_count") or 0,
                   "completion_tokens": line.get("eval_count") or 0,
                   "prefill_time": (line.get("prompt_eval_duration") or 0) * ns or None,
                   "decode_time": (line.get("eval_duration") or 0) * ns or None,
                   "finish_reason": line.get("done_reason")}
            return


class ClientEndpoint:
    """The cluster through ``DisaggregatedClient``, as the grader uses it: its metrics are the client's own
    (``(text, metrics)``'s dict, read by key), handoff parts included."""

    name = "ours"

    def __init__(self, config=None, client=None):
        from ..client import DisaggregatedClient

        self.client = client if client is not None else DisaggregatedClient(config, health_check=False)

    def stream(self, request: BenchRequest):
        return self.client.stream(**request.kwargs)

    def close(self) -> None:
        self.client.close()


def peer_endpoint(spec: PeerSpec, config, model_map: dict, timeout: float) -> HttpEndpoint:
    """A peer's endpoint: each model asked for by the name ``--peer-model`` gives, else the model's first alias
    (the production name, as Ollama knows it: qwen3-coder:30b), else its key."""
    names = {key: model_map.get(key) or (entry.get("aliases") or [key])[0] for key, entry in config.models.items()}
    return HttpEndpoint(spec.name, spec.url, spec.protocol or detect_protocol(spec.url), names, timeout)
