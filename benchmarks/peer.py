"""Against llama.cpp's own server: the decode server and the gateway side by side with ``llama-server``.

    .venv/bin/python benchmarks/peer.py --json           # ~47 minutes on 2 cores (+ ~10 the first time: build)
    .venv/bin/python benchmarks/peer.py --quick --json   # ~10 s: tiny model; the peer only if already built

``--quick`` is CI's smoke test: the generated tiny model (tests/tiny_models.py) under both model
names, 2 requests of 8 tokens (decode-bound) and of ~150 + 4 (prompt-bound), 1 and 2 at once, one
round; it never builds llama-server (minutes), so without a cached one the peer's rows are skipped
and the JSON says why. Its figures prove the benchmark runs; they measure nothing to quote.

The peer is ``llama-server`` built from the source distribution of the llama-cpp-python the project
runs (the same llama.cpp), with the same CMake flags (``scripts/build_llama_server.sh``; built once,
cached beside install.sh's wheel). Where it cannot be built, its rows are skipped with the reason
(``peer.skipped``) and ours are still measured. ``--quick`` never builds it.

Three endpoints serve the same GGUFs with the same threads and slots (the embedded default config,
``config_current.json``: SmolLM2 as ``qwen``, Gemma 3 270M as ``gpt-oss``, ``n_threads`` 2, ``--slots``
per server, flash attention as the config has it):

- ``llama-server``: one per model (``-t``/``-tb`` threads, ``-np`` slots, ``-c`` = n_ctx x slots,
  a KV stream per slot as ours, ``--metrics`` for its step count, ``POST /completion``), started with this
  process's environment, as a user would run it;
- ``decode-server``: ``POST /generate`` on the embedded cluster's decode servers (the prompt is
  evaluated there, as llama-server does), the cluster running all four servers and the gateway;
- ``gateway``: ``POST /v1/completions`` on the gateway: prefill server, KV handoff, decode server.

Every request streams, is greedy (temperature 0) and ignores end-of-generation (exactly the tokens
asked for). Workloads: ``decode-bound``, 8 short prompts x 192 tokens; ``prompt-bound``, 16 prompts
of ~950 tokens + 48; each sent 1 at a time and 8 at once, with one model busy (SmolLM2; the other
model's servers idle) and with both busy (for the peer, two llama-servers side by side): decode-bound
gives each model the whole workload at once, prompt-bound 8 prompts each (the same 16 in all).
Each cell runs the three endpoints back to back, in an order rotated per round, so that every
ratio compares figures taken within a minute of each other; decode-bound cells run ``--rounds``
rounds with one model busy and ``--both-rounds`` with both, prompt-bound ``--prompt-rounds``.
Every prompt starts with a number unique to its round and endpoint, so no prompt cache (ours or
llama-server's) serves any of them. An endpoint that has not finished a cell after
``--max-cell-seconds`` (one that collapsed: two llama-servers side by side on two cores do) is cut
there: its streams are closed, their pieces counted, the row marked ``incomplete``.

Before the first round, after one warm-up request per endpoint and model, the run waits until every
decode server that speculates reports what a step costs it (``/health`` → ``model_info.speculation``):
until then it drafts nothing and measures again whenever it is idle, so a round begun earlier would
time one side beside that measurement and ours without drafts.

JSON: ``rows`` (``endpoint``, ``workload``, ``concurrency``, ``busy_models``, ``round``,
``gen_tok_s`` = completion tokens of the cell over ``wall_s``, requests, tokens, failures, the
endpoint's processes' CPU milliseconds per token, ``draft_tokens`` and ``accepted_tokens``: the
guesses our decode servers verified and kept during the cell, from their ``/metrics``; null for the
peer; ``step_s``, ``between_steps_s`` and ``step_share``: the seconds our decode servers' owner threads
spent in model steps and between two steps while requests went on stepping, and the steps' share of the
two; ``steps``: our decode servers' owner steps, or llama-server's ``llama_decode`` calls (its
``--metrics``), and ``ms_per_step``: the cell's wall time per step, in which llama-server's steps stand
beside ours; ``methods``: the gateway's requests by how each was served, from its ``/metrics``
(``kv_handoff``, ``decode_only`` where ``client.route`` kept one on the decode server, ...; null for the
other endpoints); and per model the mean and the slowest request's seconds),
``cells`` (medians over rounds, ``step_share``, ``steps`` and ``ms_per_step`` too, ``methods`` summed over
the rounds, and each cell's
``speed_vs_peer``: the median of the rounds' own ratios of ``gen_tok_s`` to llama-server's; ``spread``:
the lowest, highest and interquartile range over the rounds of ``gen_tok_s``, ``cpu_ms_per_token`` and
the ratio; one-model cells run 4 rounds by default, issue 44), and ``targets`` (issue 36: the decode server >= 0.9x
of llama-server in the four one-model cells; both models busy, decode-bound 8 at once, >= 109 tok/s
combined and >= 0.9x of two llama-servers); ``servers``: each of our servers' wait policy and,
from its /health at the end, its core share (``contended_holds``: how often other programs' load
held it to one thread) and its speculation (proposer, step cost, how often it measured);
``speculation_before_round_1``: the same, as the first round began.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import quick  # noqa: E402  (benchmarks/quick.py: the shared --quick; peer.py keeps the servers' own OpenMP policy)
from disaggregated_inference.backends.gguf import resolve_gguf  # noqa: E402
from disaggregated_inference.observe.scrape import by_label, parse_metrics, total  # noqa: E402
from disaggregated_inference.ops.cluster import LocalCluster  # noqa: E402
from disaggregated_inference.ops.lifetime import guarded  # noqa: E402

BUILD_SCRIPT = ROOT / "scripts" / "build_llama_server.sh"
ENDPOINTS = ("llama-server", "decode-server", "gateway")
PEER = "llama-server"
TARGET_RATIO, TARGET_BOTH_TOK_S = 0.9, 109.0  # issue 36's done-when
ISSUE_44 = {"decode-server": 1.0, "gateway": 0.95}  # each one-model cell's median ratio to llama-server
TOPICS = ("a lighthouse keeper who finds a map", "a city that forgets its name every winter",
          "two rival bakers in a mountain village", "a robot learning to paint", "a ship lost in fog",
          "a library that opens only at night", "a child who can hear plants", "a detective on a slow train")


def say(message: str) -> None:
    print(f"[peer] {message}", file=sys.stderr, flush=True)


# -- prompts ---------------------------------------------------------------------------------------


def short_prompt(nonce: int, i: int) -> str:
    """~25 tokens."""
    return f"Batch {nonce:04d}, story {i:02d}: Write a long story about {TOPICS[i % len(TOPICS)]}."


def long_prompt(nonce: int, i: int, lines: int) -> str:
    """~38 tokens a line plus ~40 (SmolLM2's and Gemma's tokenizers alike): 24 lines are ~950 tokens."""
    out = [f"Batch {nonce:04d}, report {i:02d}: the weekly figures of the regional stores follow."]
    for k in range(lines):
        s = (i * 131 + k * 17) % 997
        out.append(f"Store {s:03d} in week {k + 1:02d} sold {s * 7 % 500 + 120} units for {s * 53 % 9000 + 1000} "
                   f"dollars, with {s % 23} returns and a discount of {s % 15} percent.")
    out.append(f"Summarise report {i:02d}: which stores did best and which did worst, and why?")
    return "\n".join(out)


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: int        # per model
    max_tokens: int
    lines: int = 0      # 0: short prompts; otherwise long_prompt's lines
    split: bool = False  # with several models busy, the prompts are shared out between them

    def prompt(self, nonce: int, i: int) -> str:
        return long_prompt(nonce, i, self.lines) if self.lines else short_prompt(nonce, i)


WORKLOADS = (Workload("decode-bound", 8, 192), Workload("prompt-bound", 16, 48, lines=24, split=True))
QUICK_WORKLOADS = (Workload("decode-bound", 2, 8), Workload("prompt-bound", 2, 4, lines=3, split=True))


# -- one request per endpoint -----------------------------------------------------------------------


@dataclass
class Answer:
    completion_tokens: int
    prompt_tokens: int
    cut: bool = False  # ended at the cell's deadline: completion_tokens counts the pieces streamed till then


def _stream(session, url: str, body: dict, deadline: float, read) -> Answer:
    """POST ``body`` with streaming; ``read(line)`` gives ``None`` (nothing), ``"piece"`` or the final
    ``Answer``. Past ``deadline`` the stream is closed and the pieces so far counted (``cut``)."""
    pieces = 0
    try:
        with session.post(url, json=body, stream=True, timeout=(10, max(1.0, deadline - time.perf_counter()) + 5)) \
                as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"{resp.status_code} {resp.text[:200]}")
            for raw in resp.iter_lines():
                got = read(raw) if raw else None
                if isinstance(got, Answer):
                    return got
                pieces += got == "piece"
                if time.perf_counter() > deadline:
                    return Answer(pieces, 0, cut=True)
    except requests.RequestException:
        if time.perf_counter() > deadline:
            return Answer(pieces, 0, cut=True)
        raise
    raise RuntimeError("the stream ended without its last event")


def _sse(raw: bytes):
    if raw.startswith(b"data: ") and raw != b"data: [DONE]":
        return json.loads(raw[6:])
    return None


def ask_llama_server(session, url: str, model: str, prompt: str, n: int, deadline: float) -> Answer:
    def read(raw):
        event = _sse(raw)
        if event is None:
            return None
        if event.get("error"):
            raise RuntimeError(f"llama-server: {event['error']}")
        return Answer(event["tokens_predicted"], event["tokens_evaluated"]) if event.get("stop") else "piece"

    body = {"prompt": prompt, "n_predict": n, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "cache_prompt": True}
    return _stream(session, f"{url}/completion", body, deadline, read)


def ask_decode_server(session, url: str, model: str, prompt: str, n: int, deadline: float) -> Answer:
    def read(raw):
        event = json.loads(raw)
        if event.get("error"):
            raise RuntimeError(f"decode server: {event['error']}")
        if event["done"]:
            return Answer(event["metrics"]["completion_tokens"], event["metrics"]["prompt_tokens"])
        return "piece"

    body = {"prompt": prompt, "raw": True, "max_new_tokens": n, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    return _stream(session, f"{url}/generate", body, deadline, read)


def ask_gateway(session, url: str, model: str, prompt: str, n: int, deadline: float) -> Answer:
    def read(raw):
        event = _sse(raw)
        if event is None:
            return None
        if "error" in event:
            raise RuntimeError(f"gateway: {event['error']}")
        if event.get("usage"):
            return Answer(event["usage"]["completion_tokens"], event["usage"]["prompt_tokens"])
        return "piece" if event["choices"] and event["choices"][0]["text"] else None

    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    return _stream(session, f"{url}/v1/completions", body, deadline, read)


@dataclass
class Endpoint:
    name: str
    ask: Callable
    urls: dict  # model name -> base URL
    pids: list  # the processes that serve it (their CPU time is the endpoint's)
    counted_from: list = ()  # our decode servers' URLs: their DECODE_COUNTERS, read around each cell
    peer_from: list = ()  # llama-servers' URLs: their PEER_STEPS, read around each cell
    routed_from: list = ()  # gateways' URLs: their requests by how each was served (GATEWAY_REQUESTS)


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes ``pids`` and their children have used so far."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            for p in [proc, *proc.children(recursive=True)]:
                t = p.cpu_times()
                total += t.user + t.system
        except psutil.Error:
            pass
    return total


DECODE_COUNTERS = {"draft_tokens": "disagg_draft_tokens_total", "accepted_tokens": "disagg_accepted_tokens_total",
                   "step_s": "disagg_step_seconds_sum", "between_steps_s": "disagg_between_steps_seconds_total",
                   "steps": "disagg_step_seconds_count"}
PEER_STEPS = "llamacpp:n_decode_total"  # llama-server's ``llama_decode`` calls (its /metrics, ``--metrics``)
GATEWAY_REQUESTS = "disagg_gateway_requests_total"  # a gateway's requests, labelled by ``method`` (metrics.Method)


def scrapes(urls, prefix: str = "disagg_") -> list:
    """Each server of ``urls``'s ``/metrics`` now, parsed (the samples whose names start with ``prefix``)."""
    return [parse_metrics(requests.get(f"{url}/metrics", timeout=10).text, prefix) for url in urls]


def scraped_counters(urls, counters: dict, prefix: str = "disagg_") -> dict:
    """``{key: sample name}`` ``counters`` as servers ``urls`` have counted them so far (``/metrics``, summed over
    the servers and their labels)."""
    found = scrapes(urls, prefix)
    return {key: sum((total(scrape, name) for scrape in found), 0.0) for key, name in counters.items()}


def decode_counters(urls) -> dict:
    """What our decode servers ``urls`` have counted so far: guesses verified and kept, model steps, their seconds
    and the owner threads' seconds between two steps (``DECODE_COUNTERS``)."""
    return scraped_counters(urls, DECODE_COUNTERS)


def peer_steps(urls) -> float:
    """The ``llama_decode`` calls llama-servers ``urls`` have made so far (``PEER_STEPS``, summed over them)."""
    return scraped_counters(urls, {"steps": PEER_STEPS}, prefix="llamacpp:")["steps"]


def gateway_methods(urls) -> dict:
    """How the gateways ``urls`` have served their requests so far: ``{method: requests}`` (kv_handoff,
    decode_only, decode_only_fallback, ...), summed over them."""
    out: Counter = Counter()
    for scrape in scrapes(urls):
        out.update(by_label(scrape, GATEWAY_REQUESTS, "method"))
    return dict(out)


def _delta(after: dict, before: dict) -> dict:
    """``after`` less ``before``, key by key, the keys that changed (counts: ints)."""
    return {k: int(v - before.get(k, 0)) for k, v in sorted(after.items()) if v - before.get(k, 0)}


SPECULATION_KEYS = ("proposer", "step_cost_s", "step_cost_measures")  # of /health's, the ones a run records


def speculation_in(health: dict) -> dict:
    """A decode server's speculation in its ``/health`` body: proposer, step cost (None: not yet)."""
    return (health.get("model_info") or {}).get("speculation") or {}


def speculation_of(url: str) -> dict:
    return speculation_in(requests.get(f"{url}/health", timeout=10).json())


def wait_for_step_costs(urls, timeout: float = 600.0) -> dict:
    """Wait until every decode server that speculates reports what a step costs it. Until then it drafts
    nothing, and it measures again whenever it is idle (``BatchedBackend.calibrate``): a round that starts
    before would run one side beside our measurement and the other without drafts. ``{url: speculation}``
    as reported last; a server still without a step cost after ``timeout`` is said, not waited for."""
    deadline, said = time.monotonic() + timeout, 0.0
    while True:
        state = {url: speculation_of(url) for url in urls}
        missing = [u for u, spec in state.items() if spec.get("proposer", "off") != "off" and not spec.get("step_cost_s")]
        if not missing or time.monotonic() > deadline:
            if missing:
                say(f"no step cost after {timeout:g} s from {missing}: these servers draft nothing until they have one")
            return state
        if time.monotonic() - said > 30:
            say(f"waiting for the step cost of {len(missing)} decode server(s) (measured while idle)")
            said = time.monotonic()
        time.sleep(1.0)


# -- a cell: one workload on one endpoint, c at once, one or both models -------------------------------


def run_cell(endpoint: Endpoint, workload: Workload, concurrency: int, models: list[str], nonce: int,
             max_seconds: float = 300.0) -> dict:
    """Each busy model gets its share of the workload's prompts, ``concurrency`` at a time, all models at
    once; ``gen_tok_s`` is every completion token over the wall time from the first send to the last end.
    An endpoint that has not finished after ``max_seconds`` (one that collapsed) is cut there: streams
    are closed, their pieces counted as tokens, and the row says ``incomplete``."""
    per_model = workload.prompts // len(models) if workload.split else workload.prompts
    local = threading.local()
    results: dict[str, list] = {m: [] for m in models}
    deadline = time.perf_counter() + max_seconds
    not_sent = []

    def one(model: str, i: int):
        if time.perf_counter() > deadline:
            not_sent.append(i)
            return
        session = getattr(local, "session", None) or requests.Session()
        local.session = session
        started = time.perf_counter()
        try:
            answer = endpoint.ask(session, endpoint.urls[model], model, workload.prompt(nonce, i),
                                  workload.max_tokens, deadline)
            results[model].append((answer, time.perf_counter() - started, None))
        except Exception as exc:  # noqa: BLE001 - a failure is a measurement here
            results[model].append((Answer(0, 0), time.perf_counter() - started,
                                   f"{type(exc).__name__}: {exc}"[:300]))

    pools = {m: ThreadPoolExecutor(concurrency) for m in models}
    counted_before = decode_counters(endpoint.counted_from)
    peer_before = peer_steps(endpoint.peer_from)
    routed_before = gateway_methods(endpoint.routed_from)
    cpu_before = cpu_seconds(endpoint.pids)
    started = time.perf_counter()
    futures = [pools[m].submit(one, m, i) for i in range(per_model) for m in models]
    for f in futures:
        f.result()
    wall = time.perf_counter() - started
    cpu = cpu_seconds(endpoint.pids) - cpu_before
    counted = {k: v - counted_before[k] for k, v in decode_counters(endpoint.counted_from).items()}
    steps = (int(counted["steps"]) if endpoint.counted_from
             else int(peer_steps(endpoint.peer_from) - peer_before) if endpoint.peer_from else None)
    methods = _delta(gateway_methods(endpoint.routed_from), routed_before) if endpoint.routed_from else None
    for pool in pools.values():
        pool.shutdown()
    done = [r for rs in results.values() for r in rs]
    tokens = sum(r[0].completion_tokens for r in done)
    errors = [r[2] for r in done if r[2]]
    cut = sum(r[0].cut for r in done)
    whole = {m: [r for r in rs if not r[0].cut and not r[2]] for m, rs in results.items()}
    row = {"endpoint": endpoint.name, "workload": workload.name, "concurrency": concurrency,
           "busy_models": len(models), "gen_tok_s": round(tokens / wall, 2) if wall > 0 else None,
           "wall_s": round(wall, 3), "requests": len(done), "failed": len(errors),
           "completion_tokens": tokens, "prompt_tokens": sum(r[0].prompt_tokens for r in done),
           # the endpoint's processes' CPU time (spinning threads included) per completion token
           "server_cpu_s": round(cpu, 2), "cpu_ms_per_token": round(cpu / tokens * 1000, 3) if tokens else None,
           # speculation in our decode servers during the cell (None for the peer): guesses verified, kept
           "draft_tokens": int(counted["draft_tokens"]) if endpoint.counted_from else None,
           "accepted_tokens": int(counted["accepted_tokens"]) if endpoint.counted_from else None,
           # our decode servers' owner threads while they stepped: seconds in model steps, seconds between two
           # steps (sampling, detokenizing, speculation, hand-offs), and the steps' share of the two
           "step_s": round(counted["step_s"], 3) if endpoint.counted_from else None,
           "between_steps_s": round(counted["between_steps_s"], 3) if endpoint.counted_from else None,
           "step_share": (round(counted["step_s"] / (counted["step_s"] + counted["between_steps_s"]), 4)
                          if endpoint.counted_from and counted["step_s"] > 0 else None),
           # model steps during the cell: our decode servers' owner steps (one llama_decode each, but for
           # deterministic steps), llama-server's llama_decode calls; and the cell's wall time per step
           "steps": steps, "ms_per_step": round(wall / steps * 1000, 3) if steps else None,
           # the gateway's requests by how each was served (its /metrics): kv_handoff, decode_only (the route kept
           # it on the decode server), decode_only_fallback, ...; None for the other endpoints
           "methods": methods,
           "per_model": {m: {"requests": len(rs), "completion_tokens": sum(r[0].completion_tokens for r in rs),
                             "mean_prompt_tokens": round(statistics.mean(r[0].prompt_tokens for r in whole[m]), 1)
                             if whole[m] else None,
                             "mean_latency_s": round(statistics.mean(r[1] for r in whole[m]), 3) if whole[m] else None,
                             # the slowest request: a scheduler that lets one prompt wait behind newer ones shows here
                             "max_latency_s": round(max(r[1] for r in whole[m]), 3) if whole[m] else None}
                         for m, rs in results.items()}}
    if errors:
        row["errors"] = errors[:3]
    if cut or not_sent:
        row["incomplete"] = (f"cut at {max_seconds:g} s: {cut} streams closed (their pieces counted), "
                             f"{len(not_sent)} requests not sent")
    return row


# -- the peer: llama-server, built from the project's llama.cpp source -----------------------------------


def peer_binary(path: str | None, build: bool) -> tuple[str | None, str | None]:
    """(llama-server's path, None) or (None, why there is none). Builds it (minutes) only with ``build``."""
    if path:
        return (path, None) if os.access(path, os.X_OK) else (None, f"{path} is not an executable")
    if not BUILD_SCRIPT.is_file():
        return None, f"{BUILD_SCRIPT} is missing"
    check = subprocess.run(["bash", str(BUILD_SCRIPT), "--check"], capture_output=True, text=True)
    if check.returncode == 0:
        return check.stdout.strip().splitlines()[-1], None
    if not build:
        return None, ("llama-server is not built (scripts/build_llama_server.sh builds it once, ~10 minutes on 2 "
                      "cores; --quick never builds it)")
    say("building llama-server from the llama-cpp-python source distribution (once; progress below)")
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True, env=env)
    if done.returncode != 0:
        return None, f"scripts/build_llama_server.sh failed (exit {done.returncode}; its output above)"
    return done.stdout.strip().splitlines()[-1], None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PeerServer:
    """One llama-server process for one model, on a free loopback port."""

    def __init__(self, binary: str, gguf: str, threads: int, slots: int, n_ctx: int, flash_attn: bool,
                 log_dir: Path, name: str, env: dict | None = None, extra: tuple = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"llama-server-{name}.log"
        self.command = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(self.port),
                        "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(n_ctx * slots),
                        "--no-kv-unified", "-b", "512", "-ub", "512", "-fa", "on" if flash_attn else "off",
                        "--no-webui", "--metrics", *extra]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, **(env or {})})

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace").splitlines()[-15:]
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}:\n" + "\n".join(tail))
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"llama-server not ready after {timeout:g}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


# -- the run ---------------------------------------------------------------------------------------


def cluster_config(slots: int, threads: int, tiny: str | None) -> dict:
    data = json.loads((ROOT / "config_current.json").read_text())
    for model in data["models"].values():
        model.update(parallel=slots, n_threads=threads)
        if tiny:
            model["model"] = tiny
    data["client"].update(health_check_interval=0, prefill_timeout=1800, decode_timeout=1800)
    data["server"].update(queue_timeout=1800, max_queue=256)
    return data


def autogroup(pid, nice: int | None) -> None:
    """Linux splits CPU time between sessions (autogroups) before ``nice`` counts, and every server here
    starts its own session: ``--autogroup-nice`` sets the niceness of this run's and of every server's."""
    if nice is not None:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))


def _median(values):
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def _spread(values) -> dict | None:
    """The rounds' spread of one figure: lowest, highest and interquartile range (None with no value)."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {"min": round(values[0], 3), "max": round(values[-1], 3), "iqr": round(q[2] - q[0], 3)}


def _summed(counts) -> dict | None:
    """Count dicts added up key by key over the rounds (None where no round has one)."""
    counts = [c for c in counts if c is not None]
    if not counts:
        return None
    out: Counter = Counter()
    for c in counts:
        out.update(c)
    return dict(sorted(out.items()))


def _whole(row: dict) -> bool:
    """Every request of the row sent and answered."""
    return not row["failed"] and "incomplete" not in row


def summarise(rows: list[dict]) -> list[dict]:
    """Per cell and endpoint: medians over rounds, and the median of the rounds' own ratios to the peer; with
    ``spread``, each figure's lowest, highest and interquartile range over the rounds."""
    cells = []
    keys = sorted({(r["workload"], r["concurrency"], r["busy_models"]) for r in rows})
    for workload, c, busy in keys:
        mine = [r for r in rows if (r["workload"], r["concurrency"], r["busy_models"]) == (workload, c, busy)]
        peer = {r["round"]: r["gen_tok_s"] for r in mine if r["endpoint"] == PEER and _whole(r)}
        for endpoint in ENDPOINTS:
            runs = [r for r in mine if r["endpoint"] == endpoint]
            if not runs:
                continue
            ratios = [r["gen_tok_s"] / peer[r["round"]] for r in runs
                      if r["round"] in peer and peer[r["round"]] and r["gen_tok_s"] and _whole(r)]
            cells.append({"workload": workload, "concurrency": c, "busy_models": busy, "endpoint": endpoint,
                          "rounds": len(runs), "failed": sum(r["failed"] for r in runs),
                          "incomplete": sum("incomplete" in r for r in runs),
                          "gen_tok_s": _median(r["gen_tok_s"] for r in runs),
                          "wall_s": _median(r["wall_s"] for r in runs),
                          "cpu_ms_per_token": _median(r["cpu_ms_per_token"] for r in runs),
                          "draft_tokens": _median(r.get("draft_tokens") for r in runs),
                          "accepted_tokens": _median(r.get("accepted_tokens") for r in runs),
                          "step_share": _median(r.get("step_share") for r in runs),
                          "steps": _median(r.get("steps") for r in runs),
                          "ms_per_step": _median(r.get("ms_per_step") for r in runs),
                          "methods": _summed(r.get("methods") for r in runs),
                          "speed_vs_peer": _median(ratios) if endpoint != PEER else None,
                          "spread": {"gen_tok_s": _spread(r["gen_tok_s"] for r in runs),
                                     "cpu_ms_per_token": _spread(r["cpu_ms_per_token"] for r in runs),
                                     "speed_vs_peer": _spread(ratios) if endpoint != PEER else None}})
    return cells


def targets(cells: list[dict], decode_c: int) -> dict:
    def cell(endpoint, workload, c, busy):
        return next((x for x in cells if (x["endpoint"], x["workload"], x["concurrency"], x["busy_models"])
                     == (endpoint, workload, c, busy)), None)

    def one_model_ratios(endpoint):
        return {f"{workload}/{c}": (x := cell(endpoint, workload, c, 1)) and x["speed_vs_peer"]
                for workload in ("decode-bound", "prompt-bound") for c in (1, decode_c)}

    def all_at_least(ratios, bar):
        return bool(ratios) and all(v is not None and v >= bar for v in ratios.values())

    ratios = {endpoint: one_model_ratios(endpoint) for endpoint in ISSUE_44}
    one_model = ratios["decode-server"]
    issue_44 = {endpoint: {"bar": bar, "one_model": ratios[endpoint], "met": all_at_least(ratios[endpoint], bar)}
                for endpoint, bar in ISSUE_44.items()}
    both = cell("decode-server", "decode-bound", decode_c, 2)
    return {"decode_server_vs_peer_one_model": one_model,
            "one_model_met": all_at_least(one_model, TARGET_RATIO),
            "both_models_tok_s": both and both["gen_tok_s"],
            "both_models_vs_peer": both and both["speed_vs_peer"],
            "both_models_met": bool(both and both["gen_tok_s"] and both["speed_vs_peer"] is not None
                                    and both["gen_tok_s"] >= TARGET_BOTH_TOK_S
                                    and both["speed_vs_peer"] >= TARGET_RATIO),
            "targets": {"ratio": TARGET_RATIO, "both_models_tok_s": TARGET_BOTH_TOK_S},
            # issue 44: the decode server >= 1.0x of llama-server in all four one-model cells, the gateway >= 0.95x
            "issue_44": issue_44}


def json_options(options: list[str]) -> dict:
    """``KEY=JSON`` arguments (``--server-option``, ``--model-option``, ``--client-option``) as a dict of their
    parsed values."""
    return {key: json.loads(value) for key, _, value in (option.partition("=") for option in options)}


def tiny_model() -> str:
    """The generated tiny GGUF --quick serves under both model names (tests/tiny_models.py)."""
    from tests.tiny_models import SHAPES, tiny_gguf

    return str(tiny_gguf("llama" if "llama" in SHAPES else "qwen3moe"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the whole result as JSON (default: cells and targets)")
    quick.add_argument(parser)  # the tiny model under both names, a few short requests; llama-server only if built
    parser.add_argument("--rounds", type=int, default=4, help="rounds of the decode-bound cells with one model busy")
    parser.add_argument("--both-rounds", type=int, default=1, help="rounds of the decode-bound cells with both busy")
    parser.add_argument("--prompt-rounds", type=int, default=4, help="rounds of the prompt-bound cells")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--slots", type=int, default=4, help="parallel requests per server (llama-server -np)")
    parser.add_argument("--workloads", nargs="*", default=["decode-bound", "prompt-bound"])
    parser.add_argument("--endpoints", nargs="*", default=list(ENDPOINTS), choices=ENDPOINTS)
    parser.add_argument("--busy", type=int, nargs="*", default=[1, 2], help="models busy at once: 1, 2 or both")
    parser.add_argument("--llama-server", help="a llama-server binary (default: the one build_llama_server.sh caches)")
    parser.add_argument("--no-build", action="store_true", help="skip the peer instead of building it")
    parser.add_argument("--server-option", action="append", default=[], metavar="KEY=JSON",
                        help="a key of the config's server section for this run (A/B of policies), e.g. "
                             "share_cores=false or openmp_wait='\"sleep\"'")
    parser.add_argument("--client-option", action="append", default=[], metavar="KEY=JSON",
                        help="a setting of the cluster's client section, which the gateway routes by, repeatable "
                             "(e.g. route=\"auto\", handoff_mode=\"whole\"): an A/B variant of the gateway's rows")
    parser.add_argument("--model-option", action="append", default=[], metavar="KEY=JSON",
                        help="a setting of every model of our cluster for this run (A/B of engine settings), e.g. "
                             "speculation='\"off\"'")
    parser.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for our servers only, e.g. GOMP_SPINCOUNT=300000")
    parser.add_argument("--peer-env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for llama-server only (default: this process's environment, "
                             "as a user runs it), e.g. GOMP_SPINCOUNT=1000 for the spin count ours uses")
    parser.add_argument("--peer-arg", action="append", default=[], metavar="ARG",
                        help="an extra llama-server argument, repeatable (e.g. --peer-arg=--spec-type "
                             "--peer-arg=ngram-simple: its own n-gram speculation, in a run beside the default's)")
    parser.add_argument("--max-cell-seconds", type=float, default=90.0,
                        help="cut a cell after this long (an endpoint that collapsed): its row is marked incomplete")
    parser.add_argument("--autogroup-nice", type=int, help="Linux: niceness of this run's sessions (root for < 0)")
    args = parser.parse_args(argv)
    # a run ended by SIGTERM (a CI timeout) still stops every server it started, through the with and finally
    signal.signal(signal.SIGTERM, guarded(lambda signum, frame: sys.exit(128 + signum)))
    started_run = time.perf_counter()
    autogroup("self", args.autogroup_nice)

    if args.quick:
        workloads = list(QUICK_WORKLOADS)
        levels, rounds, both_rounds, prompt_rounds, tiny = (1, 2), 1, 1, 1, tiny_model()
    else:
        workloads = list(WORKLOADS)
        levels, rounds, both_rounds, prompt_rounds, tiny = (1, 8), args.rounds, args.both_rounds, args.prompt_rounds, None
    workloads = [w for w in workloads if w.name in args.workloads]
    binary, skipped = (peer_binary(args.llama_server, build=not (args.quick or args.no_build)) if PEER in args.endpoints
                       else (None, "not asked for (--endpoints)"))
    if skipped:
        say(f"peer skipped: {skipped}")

    data = cluster_config(args.slots, args.threads, tiny)
    data["server"].update(json_options(args.server_option))
    data["client"].update(json_options(args.client_option))
    for model in data["models"].values():
        model.update(json_options(args.model_option))
    server_env = dict(item.partition("=")[::2] for item in args.server_env)
    peer_env = dict(item.partition("=")[::2] for item in args.peer_env)
    model_names = list(data["models"])  # qwen (SmolLM2) first: the one busy model
    log_dir = Path(tempfile.mkdtemp(prefix="peer-logs-"))
    peers: list[PeerServer] = []
    rows: list[dict] = []
    policy: dict = {}
    before_rounds: dict = {}
    say(f"starting the embedded cluster (4 servers and the gateway; logs in {log_dir})")
    with LocalCluster(data, free_ports=True, gateway=True, log_dir=log_dir, env=server_env) as cluster:
        try:
            for proc in [*cluster.processes, cluster.gateway]:
                autogroup(proc.proc.pid, args.autogroup_nice)
            if binary:
                for name in model_names:
                    model = data["models"][name]
                    peers.append(PeerServer(binary, str(resolve_gguf(model["model"])), args.threads, args.slots,
                                            model.get("n_ctx", 4096), bool(model.get("flash_attn")), log_dir, name,
                                            peer_env, tuple(args.peer_arg)))
                    autogroup(peers[-1].proc.pid, args.autogroup_nice)
            cluster.wait_healthy(timeout=900)
            for peer in peers:
                peer.wait_ready()
            decoders = [p for p in cluster.processes if p.entry.role == "decode"]
            decode = {p.entry.model: p.url for p in decoders}
            decode_pids = [p.proc.pid for p in decoders]
            everything = [cluster.gateway.proc.pid, *(p.proc.pid for p in cluster.processes)]
            endpoints = [Endpoint("decode-server", ask_decode_server, decode, decode_pids, list(decode.values())),
                         Endpoint("gateway", ask_gateway, {m: cluster.gateway.url for m in model_names}, everything,
                                  list(decode.values()), routed_from=[cluster.gateway.url])]
            if peers:
                endpoints.insert(0, Endpoint(PEER, ask_llama_server, {m: p.url for m, p in zip(model_names, peers)},
                                             [p.proc.pid for p in peers], peer_from=[p.url for p in peers]))
            endpoints = [e for e in endpoints if e.name in args.endpoints]
            policy = {p.entry.name: {"openmp_wait": p.settings.openmp_wait, "shares_cores": bool(p.settings.core_group)}
                      for p in cluster.processes}
            say(f"ready; our servers: {policy}")
            warm = Workload("warm-up", len(model_names), 4)
            for endpoint in endpoints:
                run_cell(endpoint, warm, 1, model_names, nonce=9999)
            speculation = wait_for_step_costs(decode.values(), timeout=60 if args.quick else 600)
            before_rounds = {p.entry.name: {k: speculation[p.url].get(k) for k in SPECULATION_KEYS} for p in decoders}
            nonce = 0
            for workload in workloads:
                for r in range(max(rounds, both_rounds) if workload.name == "decode-bound" else prompt_rounds):
                    for c in levels:
                        for busy in [b for b in args.busy if b <= len(model_names)]:
                            if workload.name == "decode-bound" and r >= (rounds if busy == 1 else both_rounds):
                                continue
                            order = endpoints[r % len(endpoints):] + endpoints[:r % len(endpoints)]
                            for endpoint in order:
                                nonce += 1
                                row = run_cell(endpoint, workload, c, model_names[:busy], nonce,
                                               args.max_cell_seconds)
                                row["round"] = r + 1
                                rows.append(row)
                                say(f"{workload.name} round {r + 1} c={c} busy={busy} {endpoint.name}: "
                                    f"{row['gen_tok_s']} tok/s, {row['wall_s']} s"
                                    + (f", {row['failed']} FAILED: {row['errors'][0]}" if row["failed"] else ""))
            for p in cluster.processes:  # whether any server computed with one thread for other programs' load
                health = requests.get(f"{p.url}/health", timeout=10).json()
                policy[p.entry.name]["core_share"] = health.get("core_share")
                if p.entry.role == "decode":  # speculation: the step cost it drafted by, at the end
                    spec = speculation_in(health)
                    policy[p.entry.name]["speculation"] = {k: spec.get(k) for k in SPECULATION_KEYS}
        finally:
            for peer in peers:
                peer.stop()
    cells = summarise(rows)
    result = {
        "quick": args.quick,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "threads": args.threads,
                    "slots": args.slots, "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
                    "autogroup_nice": args.autogroup_nice, "server_options": args.server_option,
                    "model_options": args.model_option, "client_options": args.client_option,
                    "server_env": server_env, "peer_env": peer_env,
                    "omp_environment": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_"))}},
        "models": {m: Path(data["models"][m]["model"]).name for m in model_names},
        "peer": {"binary": binary, "skipped": skipped, "command": peers[0].command[1:] if peers else None},
        "servers": policy,
        "speculation_before_round_1": before_rounds,  # each decode server's, once it reported a step cost
        "workloads": [w.__dict__ for w in workloads],
        "rows": rows,
        "cells": cells,
        "targets": targets(cells, max(levels)) if not args.quick else None,
        "elapsed_s": round(time.perf_counter() - started_run, 1),
    }
    print(json.dumps(result if args.json else {"cells": cells, "targets": result["targets"]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
