"""Issue 33 §2: no body a client can send is a 5xx. A seeded fuzzer (``random``, no extra dependency)
sends malformed bodies to the real Flask apps (``app.test_client()``): the prefill and decode servers
(an engine that says the prompt's bytes back stands in for a model: what is tested is the parse layer) and
the gateway (its config names servers that are not there: a malformed body is refused before any server
is looked for). Every body is malformed by construction: random nesting, huge numbers, duplicate keys,
invalid UTF-8, lone surrogates, NaN and Infinity, a wrong type at every field, truncated JSON. Each must
get a 4xx naming the field at fault (``field``; ``error.param`` under ``/v1``)."""
from __future__ import annotations

import io
import json
import random
import socket

import pytest

from disaggregated_inference.backends.base import Backend, Event, ModelSettings, Prefilled
from disaggregated_inference.gateway.app import create_app as create_gateway
from disaggregated_inference.kv.bundle import KIND_TOKEN_IDS
from disaggregated_inference.server import decode, prefill
from disaggregated_inference.http import MAX_JSON_DEPTH
from disaggregated_inference.metrics import ServerFigures

SEED = 33
CASES = 25  # per endpoint and kind of damage


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Bytes(Backend):
    """Token ids are the prompt's UTF-8 bytes; it answers with the first few of them (not registered:
    handed to the apps as an instance)."""

    name, handoff_kind, accepts = "bytes", KIND_TOKEN_IDS, (KIND_TOKEN_IDS,)

    def load(self, progress=lambda message: None):
        pass

    def fingerprint(self):
        return {"backend": self.name, "n_vocab": 256}

    def prefill(self, prompt):
        ids = list((prompt.text or "".join(m["content"] for m in prompt.messages)).encode())
        return Prefilled(KIND_TOKEN_IDS, ids, b"", self.fingerprint(), ServerFigures.of(prompt_tokens=len(ids)))

    def decode(self, received, sampling, cancelled):
        received.verify()
        yield Event(piece=bytes(received.tokens[:sampling.max_new_tokens]).decode(errors="replace"))
        yield Event(metrics=ServerFigures.of(method="token_ids_recompute", finish_reason="length"))

    def generate(self, prompt, sampling, cancelled):
        yield Event(piece="ok")
        yield Event(metrics=ServerFigures.of(method="decode_only", finish_reason="length"))


@pytest.fixture(scope="module")
def apps():
    server = {"model": {"name": "qwen"}}
    gateway = {"models": {"qwen": {}},
               "prefill_servers": [{"name": "p", "host": "127.0.0.1", "port": _free_port(), "model": "qwen"}],
               "decode_servers": [{"name": "d", "host": "127.0.0.1", "port": _free_port(), "model": "qwen"}],
               "client": {"health_check_interval": 0, "connect_timeout": 0.2, "retries": 0}}
    clients = {"prefill": prefill.create_app(server, Bytes(ModelSettings(name="qwen"))).test_client(),
               "decode": decode.create_app(server, Bytes(ModelSettings(name="qwen"))).test_client(),
               "gateway": create_gateway(gateway).test_client()}
    for name in ("prefill", "decode"):
        for _ in range(200):
            if clients[name].get("/health").get_json()["loaded"]:
                break
    return clients


# endpoint -> (app, a valid body, its fields and what each must be)
STR, INT, NUM, BOOL, LIST, OBJ, STOP = "str", "int", "num", "bool", "list", "obj", "stop"
ENDPOINTS = {
    "/prefill": ("prefill", {"prompt": "Hi", "model": "qwen", "lease_seconds": 5},
                 {"prompt": STR, "model": STR, "lease_seconds": NUM, "system": STR, "raw": BOOL, "kv_kind": STR}),
    "/generate": ("decode", {"messages": [{"role": "user", "content": "Hi"}], "max_new_tokens": 2},
                  {"messages": LIST, "max_new_tokens": INT, "temperature": NUM, "top_p": NUM, "top_k": INT,
                   "seed": INT, "stop": STOP, "json_schema": OBJ, "stream": BOOL, "system": STR}),
    "/decode": ("decode", {"tokens": [1, 2, 3], "max_new_tokens": 2},
                {"tokens": LIST, "max_new_tokens": INT, "temperature": NUM, "stream": BOOL, "fingerprint": OBJ,
                 "kv": OBJ, "model": STR}),
    "/v1/chat/completions": ("gateway", {"model": "qwen", "messages": [{"role": "user", "content": "Hi"}]},
                             {"model": STR, "messages": LIST, "max_tokens": INT, "temperature": NUM, "top_p": NUM,
                              "seed": INT, "stop": STOP, "stream": BOOL, "response_format": OBJ, "n": INT}),
    "/v1/completions": ("gateway", {"model": "qwen", "prompt": "Hi"},
                        {"model": STR, "prompt": STR, "max_tokens": INT, "temperature": NUM, "stream": BOOL}),
    "/api/chat": ("gateway", {"model": "qwen", "messages": [{"role": "user", "content": "Hi"}], "stream": False},
                  {"model": STR, "messages": LIST, "stream": BOOL, "options": OBJ, "format": OBJ,
                   "options.temperature": NUM, "options.num_predict": INT, "options.stop": STOP}),
    "/api/generate": ("gateway", {"model": "qwen", "prompt": "Hi", "stream": False},
                      {"model": STR, "prompt": STR, "system": STR, "raw": BOOL, "options": OBJ,
                       "options.top_p": NUM, "options.seed": INT, "options.top_k": INT}),
}


def _wrong(kind: str, rng: random.Random):
    """A value that is not of ``kind`` (never null: null is an absent optional field)."""
    others = {
        STR: [7, 2.5, True, ["x"], {"a": 1}],
        INT: ["7", 2.5, True, [1], {"a": 1}],
        NUM: ["0.5", True, [1], {"a": 1}],
        BOOL: ["true", 1, 0.0, [True], {"a": True}],
        LIST: ["x", 3, True, {"a": 1}],
        OBJ: ["x", 3, True, [1, 2]],
        STOP: [3, True, {"a": 1}, [1], [""], ["x"] * 17],  # a string, or up to 16 of them, is a valid stop
    }[kind]
    return rng.choice(others)


def _with(body: dict, key: str, value) -> dict:
    """``body`` with ``key`` (``options.seed``: inside ``options``) set to ``value``."""
    if "." in key:
        outer, inner = key.split(".", 1)
        return {**body, outer: {inner: value}}
    return {**body, key: value}


def _nested(depth: int, rng: random.Random) -> str:
    opens = [rng.choice('[{') for _ in range(depth)]
    text = "".join("[" if o == "[" else '{"k":' for o in opens) + "0"
    return text + "".join("]" if o == "[" else "}" for o in reversed(opens))


def _damaged(endpoint: str, kind: str, rng: random.Random) -> tuple[bytes, str | None]:
    """A malformed body for ``endpoint``, and the field that must be named (None: any field)."""
    _, valid, fields = ENDPOINTS[endpoint]
    body = dict(valid)
    text_field = next(f for f in ("prompt", "messages") if f in valid) if endpoint != "/decode" else "model"
    if kind == "nesting":
        depth = rng.choice([MAX_JSON_DEPTH + 1, MAX_JSON_DEPTH + 50, 5_000, 100_000])
        where = rng.choice(["body", "field"])
        if where == "body":
            return _nested(depth, rng).encode(), "body"
        key = rng.choice(sorted(fields))
        raw = json.dumps(_with(body, key, "@@")).replace('"@@"', _nested(depth, rng))
        return raw.encode(), "body"
    if kind == "huge_number":
        key = rng.choice([f for f, k in fields.items() if k in (INT, NUM)])
        digits = rng.choice([30, 400, 4000, 5000, 20_000])
        number = rng.choice(["", "-"]) + "9" * digits + rng.choice(["", ".5", "e999"])
        raw = json.dumps(_with(body, key, "@@")).replace('"@@"', number)
        return raw.encode(), None  # the number's field when it parses, else the body
    if kind == "duplicate_key":
        key = rng.choice(sorted(body))
        raw = json.dumps(body)
        return (raw[:-1] + f", {json.dumps(key)}: {json.dumps(body[key])}}}").encode(), "body"
    if kind == "invalid_utf8":
        raw = json.dumps(body).encode()
        quotes = [i + 1 for i, c in enumerate(raw) if c == ord('"')]
        cut = rng.choice(quotes + [rng.randrange(1, len(raw))])  # mostly at a string's edge, some anywhere
        junk = rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80",
                           bytes([rng.randrange(128, 256)])])
        # not UTF-8 (the body), or UTF-8's encoding of a surrogate, which Python's JSON decoder lets through
        # as one (the string's field, then)
        return raw[:cut] + junk + raw[cut:], None
    if kind == "lone_surrogate":
        surrogate = "\\u" + rng.choice(["d800", "dbff", "dc00", "dfff", "da12"])
        where = rng.choice(["value", "key"])
        if where == "key":
            raw = json.dumps(body)[:-1] + f', "x{surrogate}": 1}}'
            return raw.encode(), None
        if text_field == "messages":
            raw = json.dumps({**body, "messages": [{"role": "user", "content": "@@"}]})
            return raw.replace('"@@"', f'"Hi {surrogate} there"').encode(), "messages[0].content"
        raw = json.dumps({**body, text_field: "@@"}).replace('"@@"', f'"a{surrogate}"')
        return raw.encode(), text_field
    if kind == "constant":
        key = rng.choice([f for f, k in fields.items() if k in (INT, NUM)])
        raw = json.dumps(_with(body, key, "@@")).replace('"@@"', rng.choice(["NaN", "Infinity", "-Infinity"]))
        return raw.encode(), "body"
    if kind == "wrong_type":
        key = rng.choice(sorted(fields))
        return json.dumps(_with(body, key, _wrong(fields[key], rng))).encode(), None
    if kind == "truncated":
        raw = json.dumps(body).encode()
        return raw[:rng.randrange(0, len(raw) - 1)], "body"
    raise AssertionError(kind)


KINDS = ["nesting", "huge_number", "duplicate_key", "invalid_utf8", "lone_surrogate", "constant", "wrong_type",
         "truncated"]


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_every_malformed_body_is_a_4xx_naming_its_field(apps, endpoint):
    rng = random.Random(f"{SEED}:{endpoint}")
    app = apps[ENDPOINTS[endpoint][0]]
    failures = []
    for kind in KINDS:
        for _ in range(CASES):
            data, expected = _damaged(endpoint, kind, rng)
            resp = app.post(endpoint, data=data, content_type="application/json")
            body = resp.get_json(silent=True) or {}
            field = body.get("error", {}).get("param") if endpoint.startswith("/v1") else body.get("field")
            if not 400 <= resp.status_code < 500 or not field or (expected and field != expected):
                failures.append((kind, resp.status_code, field, expected, data[:200], str(body)[:300]))
    assert not failures, f"{len(failures)} bodies not refused as they should be, e.g. {failures[:5]}"


def test_the_valid_bodies_the_fuzzer_starts_from_are_served(apps):
    """The fuzzer's starting points are valid (each damage is what makes a body fail): the servers answer
    them, and the gateway only finds no server to send them to."""
    for endpoint, (name, valid, _) in ENDPOINTS.items():
        resp = apps[name].post(endpoint, json=valid)
        expected = 503 if name == "gateway" else 200
        assert resp.status_code == expected, (endpoint, resp.status_code, resp.get_data(as_text=True)[:300])


def test_a_chunked_body_over_the_limit_is_a_413_naming_the_body(apps):
    """Werkzeug counts a chunked body (no Content-Length) against the limit itself, with its own 413;
    the servers answer theirs, naming ``body``, as for a body whose Content-Length is too large."""
    big = io.BytesIO(b'{"prompt": "' + b"a" * (8 << 20) + b'"}')
    for name, path in (("prefill", "/prefill"), ("decode", "/generate")):
        big.seek(0)
        resp = apps[name].post(path, input_stream=big, content_type="application/json",
                               headers={"Transfer-Encoding": "chunked"},
                               environ_overrides={"wsgi.input_terminated": True})
        assert resp.status_code == 413 and resp.get_json()["field"] == "body", resp.get_json()
        assert resp.get_json()["code"] == "payload_too_large"
