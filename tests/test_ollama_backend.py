"""The Ollama backend against a stand-in Ollama that speaks its exact HTTP shapes.

The stub is a real HTTP server on a free loopback port (the ``ollama`` client
uses httpx, so it is tested over real sockets). Its "model" is deterministic and
autoregressive: a token is a character (id = code point), the answer depends on
the whole rendered prompt, and any text is continued from where it stands. So a
decode that gets the prompt boundary wrong (one id too many or too few, the
wrong template, a lost system prompt) gives a different text than one generate.
The stub applies Ollama's rules: an empty prompt only loads, ``raw`` refuses
template/system/context, ``context`` is detokenized and the rendered prompt
appended, a request template replaces the model's, ``num_predict: 1`` samples
one token, EOS counts as an evaluated token but adds no text, ``context`` is the
rendered prompt + generated text without BOS, durations are nanoseconds,
errors are ``{"error": ...}`` bodies or an error line after streaming began.
"""
from __future__ import annotations

import json
import re
import socket
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from werkzeug.serving import make_server

from disaggregated_inference import backends
from disaggregated_inference.server import decode
from disaggregated_inference.server import prefill
from disaggregated_inference.backends import ModelSettings, Prompt, Received, Sampling
from disaggregated_inference.kv.bundle import KIND_LLAMA_SEQ_STATE, KIND_TOKEN_IDS
from disaggregated_inference.errors import (BackendUnavailable, BadRequest, ContextOverflow, FingerprintMismatch,
                                            ModelNotFound, Overloaded, UpstreamError, UpstreamTimeout)

MODEL = "qwen3-coder:30b"
DIGEST = "06c1097efce0431c2045fe7b2e5108366e43bee1b4603a7aded8f21689e90bca"
MODEL_TEMPLATE = "{{ if .System }}<|system|>{{ .System }}\n{{ end }}<|user|>{{ .Prompt }}\n<|assistant|>\n"
QUESTION = "What is the capital of France?"
MAX_ANSWER = 64
BUSY = "server busy, please try again.  maximum pending requests exceeded"


# -- the stand-in Ollama ---------------------------------------------------------------------------

def render(template: str, system: str, prompt: str) -> str:
    """The few Go-template forms the tests use; anything else is a template error, as in Ollama."""
    out = re.sub(r"\{\{/\*.*?\*/\}\}|\{\{- /\*.*?\*/ -\}\}", "", template, flags=re.S)  # Go comments
    out = re.sub(r"\{\{ if \.System \}\}(.*?)\{\{ end \}\}", lambda m: m.group(1) if system else "", out, flags=re.S)
    out = out.replace("{{ .System }}", system).replace("{{ .Prompt }}", prompt).replace("{{ .Response }}", "")
    if "{{" in out:
        raise ValueError(f"template: unsupported {template!r}")
    return out


def answer_for(rendered: str, fmt=None) -> str:
    """The greedy answer of the stub model to a rendered prompt ("" means EOS comes first)."""
    digest = zlib.crc32(rendered.encode())
    if "<|user|>silence" in rendered:
        return ""
    if "<|user|>emoji" in rendered:  # its first character is two byte tokens in this vocabulary
        return "\U0001F642 smile."
    if "<|user|>think" in rendered:  # a thinking model: the parser keeps <think>...</think> out of response
        return "<think>hmm</think>ok."
    if fmt is not None:
        return json.dumps({"answer": digest % 1000})
    return f"{'ABCDEFGHIJKLMNOP'[digest % 16]}{digest:08x} alpha beta gamma."


def next_char(text: str, fmt=None):
    """Continue any text: find the split prompt + partial answer that explains its end."""
    for k in range(min(len(text), MAX_ANSWER), -1, -1):
        head, produced = text[:len(text) - k], text[len(text) - k:]
        answer = answer_for(head, fmt)
        if answer.startswith(produced):
            return answer[k] if k < len(answer) else None  # None: EOS
    raise AssertionError("unreachable: k == 0 always matches")


def parse_thinking(out: str) -> tuple[str, str]:
    """(thinking, response) as Ollama's thinking parser has released them for the raw text so far."""
    opening, closing = "<think>", "</think>"
    if opening.startswith(out):
        return "", ""  # maybe a tag: held back
    if not out.startswith(opening):
        return "", out
    body = out[len(opening):]
    if closing in body:
        return body[:body.index(closing)], body[body.index(closing) + len(closing):]
    held = next((j for j in range(len(closing), 0, -1) if body.endswith(closing[:j])), 0)
    return body[:len(body) - held], ""


def tok(text: str) -> list[int]:
    return [ord(c) for c in text]


def rendered_question(text: str = QUESTION, system: str = "") -> str:
    return render(MODEL_TEMPLATE, system, text)


class StubOllama:
    def __init__(self, bos: bool = True):
        self.bos = bos  # whether the runner adds a BOS that prompt_eval_count counts and context lacks
        self.models = {
            MODEL: {"name": MODEL, "model": MODEL, "modified_at": "2025-09-01T10:00:00.000000+00:00",
                    "size": 18556688736, "digest": DIGEST,
                    "details": {"parent_model": "", "format": "gguf", "family": "qwen3moe", "families": ["qwen3moe"],
                                "parameter_size": "30.5B", "quantization_level": "Q4_K_M"}},
            "tiny:latest": {"name": "tiny:latest", "model": "tiny:latest", "modified_at": "2025-09-01T10:00:00Z",
                            "size": 1000, "digest": "ab" * 32,
                            "details": {"format": "gguf", "family": "llama", "families": ["llama"],
                                        "parameter_size": "1M", "quantization_level": "Q8_0"}},
        }
        self.requests: list[tuple[str, str, object]] = []
        self.faults: list[dict] = []
        self.loaded: dict[str, int] = {}  # model -> num_ctx it was loaded with
        self.reloads = 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                stub.handle(self, "GET")

            def do_POST(self):
                stub.handle(self, "POST")

            def log_message(self, *args):
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):
                pass  # a client that hung up (timeouts, cancels) is expected here

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def fail(self, path: str = "/api/generate", **fault) -> None:
        """The next request to ``path`` fails: status/error, sleep, or an error line mid-stream."""
        self.faults.append({"path": path, **fault})

    def generate_bodies(self) -> list[dict]:
        return [body for method, path, body in self.requests if path == "/api/generate"]

    # -- HTTP --

    def handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        body = json.loads(h.rfile.read(length)) if length else None
        self.requests.append((method, h.path, body))
        fault = next((f for f in self.faults if f["path"] == h.path), None)
        if fault:
            self.faults.remove(fault)
            if "sleep" in fault:
                time.sleep(fault["sleep"])
            if "status" in fault:
                return self.send_json(h, fault["status"], {"error": fault["error"]})
        try:
            if method == "GET" and h.path == "/api/version":
                return self.send_json(h, 200, {"version": "0.12.6"})
            if method == "GET" and h.path == "/api/tags":
                return self.send_json(h, 200, {"models": list(self.models.values())})
            if method == "GET" and h.path == "/api/ps":
                return self.send_json(h, 200, {"models": [
                    {**self.models[name], "expires_at": "2025-09-01T10:30:00Z", "size_vram": 19000000000,
                     "context_length": n_ctx} for name, n_ctx in self.loaded.items()]})
            if method == "POST" and h.path == "/api/generate":
                return self.generate(h, body, fault)
            return self.send_json(h, 404, {"error": "404 page not found"})
        except (BrokenPipeError, ConnectionResetError):
            pass

    @staticmethod
    def send_json(h, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json; charset=utf-8")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def generate(self, h, body: dict, fault) -> None:
        name = body.get("model", "")
        if name not in self.models and f"{name}:latest" not in self.models:
            return self.send_json(h, 404, {"error": f"model '{name}' not found"})
        raw, prompt, options = body.get("raw", False), body.get("prompt", ""), body.get("options") or {}
        if raw and (body.get("template") or body.get("system") or body.get("context")):
            return self.send_json(h, 400, {"error": "raw mode does not support template, system, or context"})
        n_ctx = options.get("num_ctx", 2048)
        if self.loaded.get(name, n_ctx) != n_ctx:
            self.reloads += 1  # other runner options: Ollama reloads the model and drops its cache
        self.loaded[name] = n_ctx
        now = "2025-09-01T10:00:00.000000Z"
        if prompt == "":
            return self.send_json(h, 200, {"model": name, "created_at": now, "response": "", "done": True,
                                           "done_reason": "load"})
        if raw:
            text = prompt
        else:
            try:
                rendered = render(body.get("template") or MODEL_TEMPLATE, body.get("system", ""), prompt)
            except ValueError as exc:
                return self.send_json(h, 500, {"error": str(exc)})
            text = "".join(chr(t) for t in body.get("context") or ()) + rendered
        fmt, budget, stops = body.get("format"), options.get("num_predict", -1), options.get("stop") or []
        out, reason, evaluated = "", "length", 0
        while budget < 0 or evaluated < budget:
            evaluated += 1
            ch = next_char(text + out, fmt)
            if ch is None:
                reason = "stop"
                break
            if ord(ch) > 0xFFFF:  # two byte tokens; cut after the first, Ollama drops the invalid UTF-8
                if 0 <= budget <= evaluated:
                    break
                evaluated += 1
            out += ch
            hit = next((s for s in stops if s in out), None)
            if hit:
                out, reason = out[:out.index(hit)], "stop"
                break
        n_prompt = len(text) + (1 if self.bos else 0)
        final = {"model": name, "created_at": now, "response": "", "done": True, "done_reason": reason,
                 "total_duration": 9_000_000 + n_prompt * 1_000_000 + evaluated * 2_000_000,
                 "load_duration": 5_000_000, "prompt_eval_count": n_prompt,
                 "prompt_eval_duration": n_prompt * 1_000_000, "eval_count": evaluated,
                 "eval_duration": evaluated * 2_000_000}
        if not raw:
            final["context"] = tok(text + out)
        if body.get("stream", True) is False:
            if fault and "midstream" in fault:  # non-streamed, Ollama reports it as a status
                return self.send_json(h, 500, {"error": fault["midstream"]})
            thinking, response = parse_thinking(out)
            extra = {"thinking": thinking} if thinking else {}
            return self.send_json(h, 200, {**final, "response": response, **extra})
        lines = []
        for i in range(len(out)):
            (think0, resp0), (think1, resp1) = parse_thinking(out[:i]), parse_thinking(out[:i + 1])
            line = {"model": name, "created_at": now, "response": resp1[len(resp0):], "done": False}
            if len(think1) > len(think0):
                line["thinking"] = think1[len(think0):]
            lines.append(line)
        lines.append(final)
        if fault and "midstream" in fault:
            lines = lines[:fault.get("after", 2)] + [{"error": fault["midstream"]}]
        h.send_response(200)
        h.send_header("Content-Type", "application/x-ndjson")
        h.end_headers()
        for line in lines:
            h.wfile.write(json.dumps(line).encode() + b"\n")
            h.wfile.flush()


# -- fixtures and helpers --------------------------------------------------------------------------

@pytest.fixture
def stub(request):
    server = StubOllama(bos=getattr(request, "param", True))
    yield server
    server.close()


@pytest.fixture
def refused_url():
    """A loopback port that is bound but not listening: connecting is refused at once."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def make_backend(url: str, **settings):
    settings.setdefault("ollama_timeout", 5.0)
    return backends.create(ModelSettings(backend="ollama", model=settings.pop("model", MODEL), ollama_host=url,
                                         **settings))


@pytest.fixture
def backend(stub):
    b = make_backend(stub.url)
    b.load()
    yield b
    b.close()


def never() -> bool:
    return False


def collect(events) -> tuple[str, dict]:
    pieces, metrics = [], None
    for event in events:
        if event.done:
            metrics = event.metrics
        else:
            pieces.append(event.piece)
    return "".join(pieces), metrics


def handed_over(p) -> Received:
    return Received(p.kind, list(p.tokens), p.payload, p.fingerprint, dict(p.meta))


# -- loading, fingerprint, health --------------------------------------------------------------------

def test_load_checks_the_daemon_and_the_model_then_warm_loads_with_the_runner_options(stub):
    b = make_backend(stub.url, ollama_options={"num_batch": 256}, keep_alive="10m")
    said = []
    b.load(said.append)
    assert [(m, p) for m, p, _ in stub.requests] == [("GET", "/api/version"), ("GET", "/api/tags"),
                                                     ("POST", "/api/generate")]
    assert stub.requests[-1][2] == {"model": MODEL, "prompt": "", "stream": False,
                                    "options": {"num_ctx": 4096, "num_batch": 256}, "keep_alive": "10m"}
    assert stub.url in said[0] and "loading qwen3-coder:30b into Ollama 0.12.6" in said[1]
    assert said[-1].startswith("loaded in")
    assert b.fingerprint() == {"backend": "ollama", "ollama_model": MODEL, "model_digest": DIGEST}
    b.close()


def test_fingerprint_names_the_model_as_ollama_lists_it(stub):
    b = make_backend(stub.url, model="Tiny")
    b.load()
    assert b.fingerprint()["ollama_model"] == "tiny:latest"
    assert b.fingerprint()["model_digest"] == "ab" * 32
    assert stub.generate_bodies()[-1]["model"] == "tiny:latest"  # requests use the name Ollama lists


def test_load_refuses_a_model_that_is_not_pulled(stub):
    b = make_backend(stub.url, model="nope:7b")
    with pytest.raises(ModelNotFound) as info:
        b.load()
    assert info.value.status == 404 and "ollama pull nope:7b" in info.value.message
    assert info.value.details["hint"] == "ollama pull nope:7b"
    assert stub.generate_bodies() == []  # nothing was loaded


def test_load_says_ollama_is_not_running(refused_url):
    with pytest.raises(BackendUnavailable) as info:
        make_backend(refused_url).load()
    assert info.value.status == 503 and refused_url in info.value.message and "ollama serve" in info.value.message


def test_host_comes_from_the_environment_when_not_configured(stub, monkeypatch):
    monkeypatch.setenv("OLLAMA_HOST", stub.url)
    b = make_backend(None)
    b.load()
    assert b.host == stub.url


def test_describe_reports_the_daemon_the_model_and_its_runner(stub, backend):
    info = backend.describe()
    assert info["ollama_host"] == stub.url and info["ollama_answers"] is True
    assert info["ollama_version"] == "0.12.6"
    assert info["model_pulled"] is True and info["details"]["quantization_level"] == "Q4_K_M"
    assert info["model_loaded"] is True and info["loaded"]["context_length"] == 4096
    assert info["runner_options"] == {"num_ctx": 4096}


def test_describe_never_raises_when_ollama_is_gone(stub, backend):
    stub.close()
    started = time.perf_counter()
    info = backend.describe()
    assert info["ollama_answers"] is False and stub.url in info["ollama_error"]
    assert time.perf_counter() - started < 3


# -- prefill and decode ------------------------------------------------------------------------------

@pytest.mark.parametrize("stub", [True, False], indirect=True, ids=["bos", "no-bos"])
def test_prefill_evaluates_the_prompt_and_one_token_and_hands_over_the_prompt_ids(stub, backend):
    rendered = rendered_question(system="Be brief.")
    p = backend.prefill(Prompt(text=QUESTION, system="Be brief."))
    body = stub.generate_bodies()[-1]
    assert body == {"model": MODEL, "prompt": QUESTION, "system": "Be brief.", "stream": False,
                    "options": {"num_ctx": 4096, "num_predict": 1, "temperature": 0.0}, "keep_alive": "30m"}
    assert p.kind == KIND_TOKEN_IDS and p.payload == b""
    assert p.tokens == tok(rendered), "the ids are the rendered prompt's, without the sampled token"
    assert p.fingerprint == backend.fingerprint()
    n_prompt = len(rendered) + (1 if stub.bos else 0)
    m = p.metrics
    assert m["prompt_tokens"] == n_prompt and m["context_tokens"] == len(rendered)
    assert m["prefill_time"] == pytest.approx(n_prompt * 1e-3)
    assert m["prefill_speed"] == pytest.approx(1000.0)
    assert m["ollama_load_time"] == pytest.approx(0.005)
    assert p.meta == {"ollama_first_token": answer_for(rendered)[0], "ollama_done_reason": "length",
                      "ollama_context_tokens": len(rendered) + 1, "ollama_prompt_eval_count": n_prompt}


@pytest.mark.parametrize("stub", [True, False], indirect=True, ids=["bos", "no-bos"])
def test_decode_from_the_context_gives_the_text_of_one_generate(stub, backend):
    prompt = Prompt(text=QUESTION, system="Be brief.")
    rendered = rendered_question(system="Be brief.")
    p = backend.prefill(prompt)
    text, m = collect(backend.decode(handed_over(p), Sampling(max_new_tokens=100), never))
    body = stub.generate_bodies()[-1]
    assert body["context"] == p.tokens
    assert body["prompt"] and "system" not in body and "raw" not in body
    assert render(body["template"], "", body["prompt"]) == "", "the decode template must render nothing"
    assert body["stream"] is True and body["keep_alive"] == "30m"
    assert body["options"] == {"num_ctx": 4096, "num_predict": 100, "temperature": 0.0, "top_p": 1.0, "top_k": 40}

    single, gm = collect(backend.generate(prompt, Sampling(max_new_tokens=100), never))
    assert stub.generate_bodies()[-1]["system"] == "Be brief." and "context" not in stub.generate_bodies()[-1]
    assert text == single == answer_for(rendered)

    n_prompt = len(rendered) + (1 if stub.bos else 0)
    assert m["method"] == "ollama_context" and gm["method"] == "decode_only"
    assert m["prompt_tokens_recomputed"] == n_prompt == gm["prompt_tokens_recomputed"]
    assert m["completion_tokens"] == len(text) + 1  # Ollama counts the EOS it sampled
    assert m["decode_time"] == pytest.approx(m["completion_tokens"] * 2e-3)
    assert m["decode_speed"] == pytest.approx(500.0)
    assert m["prefill_time"] == pytest.approx(n_prompt * 1e-3)
    assert m["kv_load_time"] == 0.0 and m["finish_reason"] == "stop"
    assert m["first_token_matches_prefill"] is True
    assert m["canary"] == "unavailable" and "canary" not in gm  # no logits through Ollama: said, not faked
    assert {b["options"]["num_ctx"] for b in stub.generate_bodies()} == {4096} and stub.reloads == 0


def test_decode_from_bare_token_ids(stub, backend):
    rendered = rendered_question()
    received = Received(KIND_TOKEN_IDS, tok(rendered), b"", {})
    text, m = collect(backend.decode(received, Sampling(), never))
    assert text == answer_for(rendered) and "first_token_matches_prefill" not in m


@pytest.mark.parametrize("stub", [True, False], indirect=True, ids=["bos", "no-bos"])
def test_a_prompt_whose_first_token_is_eos_hands_over_the_whole_context(stub, backend):
    rendered = rendered_question("silence please")
    p = backend.prefill(Prompt(text="silence please"))
    assert p.meta["ollama_done_reason"] == "stop" and p.meta["ollama_first_token"] == ""
    assert p.tokens == tok(rendered)
    text, m = collect(backend.decode(handed_over(p), Sampling(), never))
    assert text == "" and m["finish_reason"] == "stop" and m["completion_tokens"] == 1


@pytest.mark.parametrize("stub", [True, False], indirect=True, ids=["bos", "no-bos"])
def test_a_first_token_hidden_by_a_thinking_parser_is_still_cut_off(stub, backend):
    rendered = rendered_question("think first")
    p = backend.prefill(Prompt(text="think first"))
    assert p.meta["ollama_first_token"] == "" and p.meta["ollama_done_reason"] == "length"
    assert p.meta["ollama_context_tokens"] == len(rendered) + 1  # the raw "<" is in the context
    assert p.tokens == tok(rendered)
    text, m = collect(backend.decode(handed_over(p), Sampling(), never))
    single, _ = collect(backend.generate(Prompt(text="think first"), Sampling(), never))
    assert text == single == "ok." and "first_token_matches_prefill" not in m


def test_a_first_token_dropped_as_incomplete_utf8_is_not_cut_off(stub, backend):
    """BOS model: the context is one id shorter than prompt_eval_count, so nothing was sampled into it."""
    rendered = rendered_question("emoji please")
    p = backend.prefill(Prompt(text="emoji please"))
    assert p.meta["ollama_first_token"] == "" and p.meta["ollama_done_reason"] == "length"
    assert p.tokens == tok(rendered)
    text, _ = collect(backend.decode(handed_over(p), Sampling(), never))
    assert text == "\U0001F642 smile."


@pytest.mark.parametrize("stub", [False], indirect=True, ids=["no-bos"])
def test_without_bos_the_learned_bos_settles_the_ambiguous_case(stub, backend):
    """No BOS: an incomplete first token gives len(context) == prompt_eval_count, like "sampled + BOS".
    An earlier prefill showed that this model adds no BOS, and that settles it."""
    backend.prefill(Prompt(text=QUESTION))  # len(context) - prompt_eval_count == 1: sampled, no BOS
    rendered = rendered_question("emoji please")
    p = backend.prefill(Prompt(text="emoji please"))
    assert p.meta["ollama_context_tokens"] == p.meta["ollama_prompt_eval_count"] == len(rendered)
    assert p.tokens == tok(rendered)


def test_first_token_check_catches_a_wrong_boundary(stub, backend):
    p = backend.prefill(Prompt(text=QUESTION))
    wrong = handed_over(p)
    wrong.tokens = wrong.tokens[:-1]  # one prompt id lost: Ollama continues another text
    text, m = collect(backend.decode(wrong, Sampling(), never))
    assert text != answer_for(rendered_question()) and m["first_token_matches_prefill"] is False


def test_sampling_passes_through_as_options(stub, backend):
    answer = answer_for(rendered_question())
    p = backend.prefill(Prompt(text=QUESTION))
    sampling = Sampling(max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=20, seed=42, stop=("zzz",))
    text, m = collect(backend.decode(handed_over(p), sampling, never))
    assert stub.generate_bodies()[-1]["options"] == {"num_ctx": 4096, "num_predict": 5, "temperature": 0.7,
                                                     "top_p": 0.9, "top_k": 20, "seed": 42, "stop": ["zzz"]}
    assert text == answer[:5] and m["finish_reason"] == "length" and m["completion_tokens"] == 5
    assert "first_token_matches_prefill" not in m  # not greedy: no check

    text, m = collect(backend.decode(handed_over(p), Sampling(stop=("beta",)), never))
    assert text == answer[:answer.index("beta")] and m["finish_reason"] == "stop"


def test_json_schema_goes_as_format_and_shapes_the_whole_answer(stub, backend):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    p = backend.prefill(Prompt(text=QUESTION))
    text, m = collect(backend.decode(handed_over(p), Sampling(json_schema=schema), never))
    assert stub.generate_bodies()[-1]["format"] == schema
    single, _ = collect(backend.generate(Prompt(text=QUESTION), Sampling(json_schema=schema), never))
    assert stub.generate_bodies()[-1]["format"] == schema
    assert text == single and isinstance(json.loads(text)["answer"], int)
    assert "first_token_matches_prefill" not in m


def test_messages_render_as_system_and_one_user_turn(stub, backend):
    backend.prefill(Prompt(messages=({"role": "system", "content": "A"}, {"role": "system", "content": "B"},
                                     {"role": "user", "content": "Q?"})))
    body = stub.generate_bodies()[-1]
    assert body["system"] == "A\n\nB" and body["prompt"] == "Q?"
    backend.prefill(Prompt(system="S", messages=({"role": "user", "content": "Q?"},)))
    assert stub.generate_bodies()[-1]["system"] == "S"


@pytest.mark.parametrize("messages", [
    ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "?"}),
    ({"role": "system", "content": "S"},),
    ({"role": "tool", "content": "42"},),
])
def test_a_conversation_is_refused_not_cut(stub, backend, messages):
    before = len(stub.requests)
    with pytest.raises(BadRequest) as info:
        backend.prefill(Prompt(messages=messages))
    assert info.value.field == "messages" and len(stub.requests) == before


def test_raw_prompts_use_the_prompt_template_so_ollama_returns_a_context(stub, backend):
    text = "<|user|>raw question\n<|assistant|>\n"
    p = backend.prefill(Prompt(text=text, raw=True))
    body = stub.generate_bodies()[-1]
    assert body["template"] == "{{ .Prompt }}" and "raw" not in body and body["prompt"] == text
    assert p.tokens == tok(text)
    decoded, _ = collect(backend.decode(handed_over(p), Sampling(), never))
    single, _ = collect(backend.generate(Prompt(text=text, raw=True), Sampling(), never))
    assert decoded == single == answer_for(text)


def test_a_prompt_longer_than_num_ctx_is_refused(stub):
    b = make_backend(stub.url, n_ctx=32)
    b.load()
    with pytest.raises(ContextOverflow) as info:
        b.prefill(Prompt(text="x" * 40))
    assert "num_ctx" in info.value.message
    with pytest.raises(ContextOverflow):
        list(b.decode(Received(KIND_TOKEN_IDS, tok("y" * 40), b"", {}), Sampling(), never))


def test_cancel_stops_reading_the_stream(stub, backend):
    pieces = []
    events = backend.generate(Prompt(text=QUESTION), Sampling(), lambda: len(pieces) >= 3)
    metrics = None
    for event in events:
        if event.done:
            metrics = event.metrics
        else:
            pieces.append(event.piece)
    assert "".join(pieces) == answer_for(rendered_question())[:3]
    assert metrics["finish_reason"] == "cancelled" and metrics["completion_tokens"] == 3


def test_decode_refuses_a_kv_state_bundle(backend):
    with pytest.raises(FingerprintMismatch):
        list(backend.decode(Received(KIND_LLAMA_SEQ_STATE, [1, 2, 3], b"\0" * 8, {}), Sampling(), never))


# -- errors --------------------------------------------------------------------------------------------

FAULTS = {
    "not-pulled": ({"status": 404, "error": f"model '{MODEL}' not found"}, ModelNotFound, f"ollama pull {MODEL}"),
    "bad-request": ({"status": 400, "error": "invalid options: num_ctx"}, BadRequest, "invalid options"),
    "busy": ({"status": 503, "error": BUSY}, Overloaded, "server busy"),
    "crashed": ({"status": 500, "error": "llama runner process has terminated"}, UpstreamError, "runner process"),
    "mid-stream": ({"midstream": "an error was encountered while running the model", "after": 2}, UpstreamError,
                   "error was encountered"),
    "timeout": ({"sleep": 1.0}, UpstreamTimeout, "did not answer"),
}


def run_op(b, op: str):
    if op == "prefill":
        return b.prefill(Prompt(text=QUESTION))
    if op == "decode":
        return collect(b.decode(Received(KIND_TOKEN_IDS, tok(rendered_question()), b"", {}), Sampling(), never))
    return collect(b.generate(Prompt(text=QUESTION), Sampling(), never))


@pytest.mark.parametrize("op", ["prefill", "decode", "generate"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_ollama_errors_map_to_the_project_errors(stub, op, fault):
    spec, kind, says = FAULTS[fault]
    b = make_backend(stub.url, ollama_timeout=0.3)
    b.load()
    stub.fail(**spec)
    with pytest.raises(kind) as info:
        run_op(b, op)
    assert says in info.value.message and stub.url in info.value.message
    if kind is Overloaded:
        assert info.value.status == 503 and info.value.details["retry_after"] >= 1
    if kind is ModelNotFound:
        assert info.value.details["hint"] == f"ollama pull {MODEL}"
    assert run_op(b, "generate")[0] == answer_for(rendered_question()), "the next request works"


@pytest.mark.parametrize("op", ["prefill", "decode", "generate"])
def test_ollama_gone_after_load_is_backend_unavailable(stub, backend, op):
    stub.close()
    with pytest.raises(BackendUnavailable) as info:
        run_op(backend, op)
    assert stub.url in info.value.message


# -- through the real Flask servers ------------------------------------------------------------------

@pytest.fixture
def clean_env(monkeypatch):
    for name in ("DISAGG_SERVER_SETTINGS", "DISAGG_SERVER", "DISAGG_CONFIG", "OLLAMA_HOST"):
        monkeypatch.delenv(name, raising=False)


def app_config(role: str, url: str, **model) -> dict:
    # the decode app pulls KV from the prefill app served on a free loopback port
    return {"role": role, "model": {"backend": "ollama", "model": MODEL, "ollama_host": url, **model},
            "kv_sources": ["127.0.0.1"]}


def wait_loaded(client, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = client.get("/health").get_json()
        if health["loaded"] or health["status"] == "unhealthy" or time.monotonic() > deadline:
            return health
        time.sleep(0.02)


@pytest.fixture
def apps(clean_env):
    """Build apps with create(module, config); their model threads are stopped afterwards."""
    made = []

    def create(module, config):
        app = module.create_app(config)
        made.append(app)
        return app

    yield create
    for app in made:
        app.extensions["disagg"].owner.close()


@pytest.fixture
def prefill_url(stub, apps):
    """The prefill app served for real on a free port, so the decode app can fetch its bundles."""
    app = apps(prefill, app_config("prefill", stub.url))
    assert wait_loaded(app.test_client())["loaded"]
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.fixture
def decode_client(stub, apps):
    client = apps(decode, app_config("decode", stub.url, ollama_timeout=0.3)).test_client()
    assert wait_loaded(client)["loaded"]
    return client


def test_prefill_then_decode_through_the_servers(stub, prefill_url, decode_client):
    import requests

    answer = answer_for(rendered_question())
    pre = requests.post(f"{prefill_url}/prefill", json={"prompt": QUESTION}, timeout=10).json()
    assert pre["handoff"] == KIND_TOKEN_IDS and pre["kv"]["bytes"] == 0
    assert pre["prompt_tokens"] == len(rendered_question())
    assert pre["fingerprint"]["ollama_model"] == MODEL and pre["metrics"]["prompt_tokens"] > 0

    resp = decode_client.post("/decode", json={"kv": pre["kv"], "max_new_tokens": 100})
    assert resp.status_code == 200, resp.get_data(as_text=True)
    out = resp.get_json()
    assert out["generated_text"] == answer and out["finish_reason"] == "stop"
    m = out["metrics"]
    assert m["handoff"] == KIND_TOKEN_IDS and m["method"] == "ollama_context" and m["kv_bytes"] == 0
    assert m["canary"] == "unavailable"
    assert m["prompt_tokens_recomputed"] == len(rendered_question()) + 1
    assert m["first_token_matches_prefill"] is True
    assert stub.generate_bodies()[-1]["context"] == tok(rendered_question())

    mono = decode_client.post("/generate", json={"prompt": QUESTION, "max_new_tokens": 100}).get_json()
    assert mono["generated_text"] == answer and mono["metrics"]["method"] == "decode_only"

    pre = requests.post(f"{prefill_url}/prefill", json={"prompt": QUESTION}, timeout=10).json()
    streamed = decode_client.post("/decode", json={"kv": pre["kv"], "stream": True})
    lines = [json.loads(line) for line in streamed.get_data(as_text=True).splitlines()]
    assert "".join(line["text"] for line in lines[:-1]) == answer
    assert lines[-1]["done"] is True and lines[-1]["metrics"]["method"] == "ollama_context"
    assert stub.reloads == 0


def test_decode_with_token_ids_and_a_fingerprint(decode_client):
    ids = tok(rendered_question())
    ok = decode_client.post("/decode", json={"tokens": ids, "fingerprint": {"backend": "ollama", "ollama_model": MODEL,
                                                                           "model_digest": DIGEST}})
    assert ok.status_code == 200 and ok.get_json()["generated_text"] == answer_for(rendered_question())
    other = decode_client.post("/decode", json={"tokens": ids, "fingerprint": {"backend": "ollama",
                                                                              "ollama_model": "llama3:8b"}})
    assert other.status_code == 409 and other.get_json()["code"] == "fingerprint_mismatch"
    assert "llama3:8b" in other.get_json()["error"]


HTTP_FAULTS = {
    "not-pulled": (FAULTS["not-pulled"][0], 404, "model_not_found", f"ollama pull {MODEL}"),
    "bad-request": (FAULTS["bad-request"][0], 400, "bad_request", "invalid options"),
    "busy": (FAULTS["busy"][0], 503, "overloaded", "server busy"),
    "crashed": (FAULTS["crashed"][0], 502, "upstream_error", "runner process"),
    "mid-stream": (FAULTS["mid-stream"][0], 502, "upstream_error", "error was encountered"),
    "timeout": (FAULTS["timeout"][0], 504, "upstream_timeout", "did not answer"),
}


@pytest.mark.parametrize("fault", list(HTTP_FAULTS))
def test_decode_server_maps_ollama_errors_and_keeps_serving(stub, decode_client, fault):
    spec, status, code, says = HTTP_FAULTS[fault]
    stub.fail(**spec)
    resp = decode_client.post("/generate", json={"prompt": QUESTION})
    body = resp.get_json()
    assert resp.status_code == status and body["code"] == code and says in body["error"], body
    assert stub.url in body["error"]
    if status == 503:
        assert int(resp.headers["Retry-After"]) >= 1
    again = decode_client.post("/generate", json={"prompt": QUESTION})
    assert again.status_code == 200 and again.get_json()["generated_text"] == answer_for(rendered_question())


@pytest.mark.parametrize("fault", ["not-pulled", "busy", "crashed", "timeout"])
def test_prefill_server_maps_ollama_errors_and_keeps_serving(stub, apps, fault):
    spec, status, code, says = HTTP_FAULTS[fault]
    client = apps(prefill, app_config("prefill", stub.url, ollama_timeout=0.3)).test_client()
    assert wait_loaded(client)["loaded"]
    stub.fail(**spec)
    resp = client.post("/prefill", json={"prompt": QUESTION})
    assert resp.status_code == status and resp.get_json()["code"] == code and says in resp.get_json()["error"]
    if status == 503:
        assert int(resp.headers["Retry-After"]) >= 1
    assert client.post("/prefill", json={"prompt": QUESTION}).status_code == 200


def test_an_error_after_streaming_began_becomes_the_last_ndjson_line(stub, decode_client):
    stub.fail(**FAULTS["mid-stream"][0])
    resp = decode_client.post("/generate", json={"prompt": QUESTION, "stream": True})
    assert resp.status_code == 200
    lines = [json.loads(line) for line in resp.get_data(as_text=True).splitlines()]
    assert [line["text"] for line in lines[:-1]] == list(answer_for(rendered_question())[:2])
    assert lines[-1]["done"] is True and lines[-1]["code"] == "upstream_error"
    assert "error was encountered" in lines[-1]["error"]
    assert decode_client.post("/generate", json={"prompt": QUESTION}).status_code == 200


def test_ollama_stopping_after_load_gives_503_and_health_says_so(stub, decode_client):
    stub.close()
    resp = decode_client.post("/generate", json={"prompt": QUESTION})
    assert resp.status_code == 503 and resp.get_json()["code"] == "backend_unavailable"
    assert stub.url in resp.get_json()["error"]
    health = decode_client.get("/health")
    assert health.status_code == 503  # degraded: clients mark the server down
    body = health.get_json()
    assert body["status"] == "degraded" and body["loaded"] is False
    assert body["model_info"]["ollama_answers"] is False and body["model_info"]["ready"] is False


def test_health_describes_ollama(stub, decode_client):
    health = decode_client.get("/health").get_json()
    assert health["backend"] == "ollama" and health["handoff"] == KIND_TOKEN_IDS
    info = health["model_info"]
    assert info["ollama_host"] == stub.url and info["model_pulled"] and info["model_loaded"]


def test_a_model_that_is_not_pulled_fails_the_load_with_the_pull_hint(stub, apps):
    client = apps(prefill, app_config("prefill", stub.url, model="nope:1b")).test_client()
    health = wait_loaded(client)
    assert health["status"] == "unhealthy" and "ollama pull nope:1b" in health["error"]
    assert client.get("/health").status_code == 503
    resp = client.post("/prefill", json={"prompt": QUESTION})
    assert resp.status_code == 503 and "ollama pull nope:1b" in resp.get_json()["error"]


def test_ollama_not_running_fails_the_load_naming_the_host(refused_url, apps):
    client = apps(decode, app_config("decode", refused_url)).test_client()
    health = wait_loaded(client)
    assert health["status"] == "unhealthy" and refused_url in health["error"]
    assert client.post("/generate", json={"prompt": QUESTION}).status_code == 503


def test_a_bundle_from_another_digest_of_the_same_name_is_refused(stub, prefill_url, apps):
    """The fingerprint's model_digest is checked: the same tag pulled on another day can be other weights."""
    import requests

    pre = requests.post(f"{prefill_url}/prefill", json={"prompt": QUESTION}, timeout=10).json()
    assert pre["fingerprint"]["model_digest"] == DIGEST
    stub.models[MODEL]["digest"] = "cd" * 32  # the decode machine's Ollama lists other weights under MODEL
    client = apps(decode, app_config("decode", stub.url)).test_client()
    assert wait_loaded(client)["loaded"]
    resp = client.post("/decode", json={"kv": pre["kv"]})
    body = resp.get_json()
    assert resp.status_code == 409 and body["code"] == "fingerprint_mismatch", body
    assert "model_digest" in body["error"] and DIGEST in body["error"]
    ids = tok(rendered_question())
    same = client.post("/decode", json={"tokens": ids, "fingerprint": {**pre["fingerprint"], "model_digest": "cd" * 32}})
    assert same.status_code == 200


def test_ollama_requests_run_side_by_side_not_behind_one_thread(stub, apps):
    """Ollama batches requests itself (OLLAMA_NUM_PARALLEL): the server keeps `parallel` of them in flight."""
    from concurrent.futures import ThreadPoolExecutor

    lock, inflight, peak = threading.Lock(), [0], [0]
    original = stub.handle

    def slow_generate(handler, method):
        if handler.path != "/api/generate":
            return original(handler, method)
        with lock:
            inflight[0] += 1
            peak[0] = max(peak[0], inflight[0])
        try:
            time.sleep(0.3)
            return original(handler, method)
        finally:
            with lock:
                inflight[0] -= 1

    stub.handle = slow_generate
    app = apps(decode, app_config("decode", stub.url, parallel=3))
    assert wait_loaded(app.test_client())["loaded"]
    peak[0] = 0
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda i: app.test_client().post(
            "/generate", json={"prompt": QUESTION, "max_new_tokens": 5}), range(3)))
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert peak[0] == 3
    assert app.test_client().get("/health").get_json()["slots"]["total"] == 3
