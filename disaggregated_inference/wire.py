"""The wire between the client and the servers: each message's type, with its writer and its reader.

What travels as JSON between ``client`` and the prefill and decode servers:

- ``KVRef``: where a prefilled KV bundle is pulled from (the ``kv`` object of a
  /prefill answer, sent back as is in a /decode request);
- ``PrefillAnswer``: the /prefill answer (the prompt's token ids, the KV reference,
  the prefill's figures);
- the lines of a progress answer and of a decode stream (NDJSON, server/progress.py,
  server/decode.py): ``Heartbeat`` (``{"status": ...}`` while the request waits or
  is evaluated), ``Piece`` (a piece of the answer, of its reasoning, or a tool
  call), ``Final`` (the last line: ``done``, ``finish_reason``, ``metrics``) and
  ``ErrorLine`` (an error in-band: its JSON body, its HTTP ``status``, ``done``).

Each type's ``write()`` gives the JSON object the servers send; ``read_*`` (or the
type's ``read``) takes such an object back, refusing what is not one. This module
imports nothing of the package but ``errors`` and ``metrics``: both sides import it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from .errors import BadRequest
from .metrics import ServerFigures

HANDOFF_MODES = ("whole", "streamed")


# -- the KV reference --------------------------------------------------------------------------

@dataclass(frozen=True)
class KVRef:
    """Where a prefilled bundle can be fetched, as a prefill server described it (``streamed``: its
    pieces leave as the prompt is evaluated; the bundle has no whole-payload checksum). The rest
    (``kind``, ``sent_as``, ``expires_at``, ``lease_seconds``) describes it for the caller."""

    url: str
    handle: str
    bytes: int | None = None
    crc32c: int | None = None
    streamed: bool = False
    kind: str | None = None
    sent_as: str | None = None
    expires_at: float | None = None
    lease_seconds: float | None = None

    @property
    def mode(self) -> str:
        return "streamed" if self.streamed else "whole"

    def write(self) -> dict:
        return {"url": self.url, "handle": self.handle, "kind": self.kind, "bytes": self.bytes,
                "crc32c": self.crc32c, "sent_as": self.sent_as, "mode": self.mode, "expires_at": self.expires_at,
                "lease_seconds": self.lease_seconds}


def read_kv_ref(value, name: str = "kv") -> KVRef:
    """A ``kv`` object as a /decode request sends it (``BadRequest`` naming the field, spelled ``name``)."""
    if not isinstance(value, dict):
        raise BadRequest(f"'{name}' must be the object a /prefill answer gave", field=name)
    for key in ("url", "handle"):
        if not isinstance(value.get(key), str) or not value[key]:
            raise BadRequest(f"'{name}.{key}' must be a non-empty string", field=f"{name}.{key}")
    if not value["url"].startswith(("http://", "https://")):
        raise BadRequest(f"'{name}.url' must be an http(s) URL", field=f"{name}.url")
    if urlsplit(value["url"]).path.rsplit("/kv/", 1)[-1] != value["handle"]:
        raise BadRequest(f"'{name}.handle' is not the handle in '{name}.url' (…/kv/<handle>)", field=f"{name}.handle")
    size = value.get("bytes")
    crc = value.get("crc32c")
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
        raise BadRequest(f"'{name}.bytes' must be a non-negative integer", field=f"{name}.bytes")
    if crc is not None and (not isinstance(crc, int) or isinstance(crc, bool)):
        raise BadRequest(f"'{name}.crc32c' must be an integer", field=f"{name}.crc32c")
    mode = value.get("mode", "whole")
    if mode not in HANDOFF_MODES:
        raise BadRequest(f"'{name}.mode' must be one of {', '.join(HANDOFF_MODES)}", field=f"{name}.mode")
    kind = value.get("kind")
    return KVRef(url=value["url"], handle=value["handle"], bytes=size, crc32c=crc, streamed=mode == "streamed",
                 kind=kind if isinstance(kind, str) else None, sent_as=value.get("sent_as"),
                 expires_at=value.get("expires_at"), lease_seconds=value.get("lease_seconds"))


# -- the prefill answer ------------------------------------------------------------------------

@dataclass(frozen=True)
class PrefillAnswer:
    """A /prefill answer: the KV's reference, the prompt's token ids (the design documents' ``context``:
    ``POST /decode {"context": ...}`` recomputes from them), the prefill's figures (``metrics``)."""

    kv: KVRef
    context: tuple
    metrics: ServerFigures
    prompt_tokens: int = 0
    model: str | None = None  # as the server's /health names it
    model_key: str | None = None  # the config's key
    server: str | None = None
    fingerprint: dict | None = None
    handoff_mode: str = "whole"
    handoff_mode_reason: str | None = None

    @property
    def handoff(self) -> str | None:
        """The bundle's kind (``llama_seq_state``, ``neutral_kv``, ``token_ids``...)."""
        return self.kv.kind

    def write(self) -> dict:
        body = {"model": self.model, "model_key": self.model_key, "server": self.server,
                "prompt_tokens": self.prompt_tokens, "context": [int(t) for t in self.context],
                "handoff": self.handoff, "handoff_mode": self.handoff_mode}
        if self.handoff_mode_reason:
            body["handoff_mode_reason"] = self.handoff_mode_reason
        body.update(metrics=self.metrics.as_dict(), fingerprint=self.fingerprint, kv=self.kv.write())
        return body

    @classmethod
    def read(cls, body: dict) -> PrefillAnswer:
        if not isinstance(body, dict) or not isinstance(body.get("kv"), dict):
            raise ValueError("a /prefill answer is a JSON object with a 'kv' object")
        kv = body["kv"]
        ref = KVRef(url=kv.get("url"), handle=kv.get("handle"), bytes=kv.get("bytes"), crc32c=kv.get("crc32c"),
                    streamed=kv.get("mode") == "streamed", kind=kv.get("kind") or body.get("handoff"),
                    sent_as=kv.get("sent_as"), expires_at=kv.get("expires_at"),
                    lease_seconds=kv.get("lease_seconds"))
        return cls(kv=ref, context=tuple(body.get("context") or ()),
                   metrics=ServerFigures.from_dict(body.get("metrics") or {}),
                   prompt_tokens=body.get("prompt_tokens") or len(body.get("context") or ()),
                   model=body.get("model"), model_key=body.get("model_key"), server=body.get("server"),
                   fingerprint=body.get("fingerprint"), handoff_mode=body.get("handoff_mode") or "whole",
                   handoff_mode_reason=body.get("handoff_mode_reason"))


# -- the lines of a progress answer and of a decode stream ------------------------------------

@dataclass(frozen=True)
class Heartbeat:
    """What a request is doing while its answer is not there yet: ``status`` (accepted, tokenizing, queued,
    fetching, importing, prefill with ``tokens``/``evaluated``, decode with ``generated``)."""

    status: str
    tokens: int | None = None
    evaluated: int | None = None
    generated: int | None = None

    def write(self) -> dict:
        line = {"status": self.status}
        for key in ("tokens", "evaluated", "generated"):
            if getattr(self, key) is not None:
                line[key] = getattr(self, key)
        return line


@dataclass(frozen=True)
class Piece:
    """One piece of a generation: of the answer (``text``), of its reasoning, or a tool call."""

    text: str | None = None
    reasoning: str | None = None
    tool_call: dict | None = None

    def write(self) -> dict:
        if self.reasoning is not None:
            return {"reasoning": self.reasoning, "done": False}
        if self.tool_call is not None:
            return {"tool_call": self.tool_call, "done": False}
        return {"text": self.text, "done": False}


@dataclass(frozen=True)
class Final:
    """A decode stream's last line: why it ended and the decode's figures."""

    finish_reason: str | None
    metrics: ServerFigures = field(default_factory=ServerFigures)

    def write(self) -> dict:
        return {"done": True, "finish_reason": self.finish_reason, "metrics": self.metrics.as_dict()}


@dataclass(frozen=True)
class ErrorLine:
    """An error as a stream's last line: the error's JSON body (``error``, ``code``, ...) and its HTTP status."""

    body: dict
    status: int = 502

    def write(self) -> dict:
        return {**self.body, "status": self.status, "done": True}


@dataclass(frozen=True)
class DecodeAnswer:
    """A /decode or /generate answer whole: its text, why it ended, the decode's figures, and what the model's
    chat format read apart from the text (``reasoning``, ``tool_calls``). A stream brings it piece by piece."""

    generated_text: str
    finish_reason: str | None
    metrics: ServerFigures = field(default_factory=ServerFigures)
    reasoning: str | None = None
    tool_calls: list | None = None

    def write(self) -> dict:
        body = {"generated_text": self.generated_text, "finish_reason": self.finish_reason,
                "metrics": self.metrics.as_dict()}
        if self.reasoning:
            body["reasoning"] = self.reasoning
        if self.tool_calls:
            body["tool_calls"] = self.tool_calls
        return body

    @classmethod
    def read(cls, body: dict) -> DecodeAnswer:
        if not isinstance(body, dict):
            raise ValueError("a decode answer is a JSON object")
        return cls(body.get("generated_text") or "", body.get("finish_reason"),
                   ServerFigures.from_dict(body.get("metrics") or {}),
                   body.get("reasoning"), body.get("tool_calls"))


@dataclass(frozen=True)
class Answer:
    """The last line of a progress answer that is not a decode stream's (the /prefill answer, ``done``)."""

    body: dict


def read_line(line) -> Heartbeat | Piece | Final | ErrorLine | Answer:
    """One line of a progress answer or a decode stream, as its type (``ValueError``: not a JSON object)."""
    if not isinstance(line, dict):
        raise ValueError("a line that is not a JSON object")
    if line.get("error") is not None:
        status = line.get("status")
        return ErrorLine({k: v for k, v in line.items() if k not in ("done", "status")},
                         status if isinstance(status, int) else 502)
    status = line.get("status")
    if isinstance(status, str):
        return Heartbeat(status, line.get("tokens"), line.get("evaluated"), line.get("generated"))
    if line.get("done"):
        if "finish_reason" in line:
            return Final(line.get("finish_reason"), ServerFigures.from_dict(line.get("metrics") or {}))
        return Answer({k: v for k, v in line.items() if k != "done"})
    if line.get("reasoning") is not None:
        return Piece(reasoning=line["reasoning"])
    if line.get("tool_call") is not None:
        return Piece(tool_call=line["tool_call"])
    return Piece(text=line.get("text") or "")
