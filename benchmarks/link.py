"""Benchmark: the KV handoff over an emulated link between two machines, overlapped against whole-state.

The prefill server and the decode server run in two network namespaces of this
machine joined by a veth pair shaped with ``tc`` (a ``tbf`` at ``--rate-gbit``,
a ``netem`` delay of ``--delay-ms`` each way: 10 Gbit/s and 0.1 ms by default,
the DGX-to-Mac 10GbE link). The script makes the namespaces, the pair and the
shaping itself and removes them on every way out (an error, Ctrl-C, SIGTERM);
it needs root (``ip netns``), and without it says so and stops. Only its own
namespaces and their addresses are ever used: nothing leaves this machine. The
requests are sent from the decode server's namespace, as a client beside it
would; the KV crosses the shaped link. The same runs on loopback follow, to
show the overlapped handoff costs nothing where the link is free.

Per model and prompt size, medians over ``--rounds`` (each round: the same
prompt handed over whole, then streamed, with the prefix cache off so that
both evaluate the whole prompt):

- ``prefill_s``: the prefill server's evaluation of the prompt (whole-state run;
  ``prefill_streamed_s`` the streamed run's, which includes reading each chunk's
  rows out of the cache);
- ``whole_transfer_s``: the whole-state handoff's transfer (the decode server's
  pull of the bundle, after the prefill);
- ``exposed_transfer_s``: what the overlapped handoff's transfer leaves after the
  prefill ends (from the end of the prompt's evaluation to the last KV byte in,
  on this one machine's clock; ``stream_end_after_prefill_s`` to the stream's end,
  which follows the canary the prefill side computes from the last token);
- ``ttft_whole_s``, ``ttft_overlapped_s``: time to first token end to end, as a
  client beside the decode server sees it (the ``/prefill`` round trip plus the
  decode server's own TTFT), and each less its prefill (``ttft_after_prefill_*``);
- ``after_prefill_vs_whole_transfer``: the overlapped TTFT after the prefill ends
  over the whole-state transfer time (issue 29's target: at most 0.25 at 8k tokens
  on the 10 Gbit/s link);
- ``greedy_equal``: the overlapped handoff's greedy text equals the whole-state one's.

The link figures are ``disagg doctor``'s (``ops/doctor.py``: a 64 MiB probe pulled
by the decode server from the prefill server through the KV endpoint, and the KV
bytes per token of one small real prefill). A veth on a 2-core machine tops out
near 18 Gbit/s (``../shared/reference/link-emulation.md``): rows shaped above
15 Gbit/s are reported ``capped``, since the CPU and not the shaping sets them.

Models: ``smollm2`` (the packaged SmolLM2-135M, 23 KB of KV per token) and
``wide``: a generated tiny qwen3moe with qwen3-coder:30b's KV shape (48 layers,
4 KV heads of 128: 96 KiB per token), whose transfer is as large as production's
relative to its prompt. Its weights are random; its greedy text is still
deterministic, so ``greedy_equal`` means the same there.

    .venv/bin/python benchmarks/link.py --rate-gbit 10 --tokens 2048 8192 --json
    .venv/bin/python benchmarks/link.py --quick --json
"""
from __future__ import annotations

import argparse
import atexit
import ctypes
import json
import os
import platform
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import quick  # noqa: E402
from disaggregated_inference import config as cluster_config  # noqa: E402
from disaggregated_inference.ops.cluster import LocalCluster  # noqa: E402
from disaggregated_inference.ops.lifetime import guarded  # noqa: E402
from disaggregated_inference.ops.doctor import Doctor  # noqa: E402
from disaggregated_inference.ops.launch import server_command  # noqa: E402
from disaggregated_inference.server.settings import from_cluster  # noqa: E402

CAPPED_ABOVE_GBIT = 15.0  # a veth on this kind of machine tops out near 18 Gbit/s unshaped
PREFILL_ADDR, DECODE_ADDR, PORT = "10.213.0.1", "10.213.0.2", 8000  # inside the script's own namespaces only
CLONE_NEWNET = 0x40000000
FILLER = ("The quarterly sales report lists revenue by region, product line and month, "
          "with notes on returns, discounts and the marketing campaigns that ran. ")
NEW_TOKENS = 16  # generated per handoff: enough to compare greedy text, few enough to keep runs short
PROBE_BYTES = 64 << 20  # doctor's probe: the largest it pulls
TIMEOUT = 3600.0  # an 8k-token prefill on a loaded 2-core machine takes minutes


class LinkUnavailable(Exception):
    """The emulated link cannot be made here (the message says why)."""


# -- the link ----------------------------------------------------------------------------------------

def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise LinkUnavailable(f"`{' '.join(cmd)}` failed: {(done.stderr or done.stdout).strip()}")


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


class ShapedLink:
    """Two network namespaces joined by a veth pair shaped in both directions; removed on ``close``.

    Names carry this process's id, so two runs never meet, and namespaces a killed run left
    behind (its process gone) are removed first.
    """

    PREFIX = "dlk-"

    def __init__(self, rate_gbit: float, delay_ms: float):
        self.rate_gbit, self.delay_ms = rate_gbit, delay_ms
        pid = os.getpid()
        self.prefill_ns, self.decode_ns = f"{self.PREFIX}p{pid}", f"{self.PREFIX}d{pid}"
        self.prefill_dev, self.decode_dev = f"dlkp{pid}", f"dlkd{pid}"
        self._home: int | None = None
        self._made: list[str] = []
        self.delay_missing: str | None = None  # why the delay could not be added, if it could not

    @staticmethod
    def unavailable() -> str | None:
        """Why the link cannot be emulated here, or None."""
        if not sys.platform.startswith("linux"):
            return "the emulated link needs Linux network namespaces"
        if os.geteuid() != 0:
            return "the emulated link needs root (ip netns, tc): run it as root, or use --loopback-only"
        missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
        if missing:
            return f"the emulated link needs {' and '.join(missing)} (iproute2)"
        return None

    def open(self) -> "ShapedLink":
        self._remove_stale()
        try:
            for ns in (self.prefill_ns, self.decode_ns):
                _run("ip", "netns", "add", ns)
                self._made.append(ns)
            _run("ip", "link", "add", self.prefill_dev, "type", "veth", "peer", "name", self.decode_dev)
            for dev, ns, addr in ((self.prefill_dev, self.prefill_ns, PREFILL_ADDR),
                                  (self.decode_dev, self.decode_ns, DECODE_ADDR)):
                _run("ip", "link", "set", dev, "netns", ns)
                _run("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                self._shape(ns, dev)
        except BaseException:
            self.close()
            raise
        return self

    def _shape(self, ns: str, dev: str) -> None:
        """A token bucket at the link's rate, and under it the one-way delay."""
        rate = self.rate_gbit * 1e9
        burst = max(1 << 20, int(rate / 8 * 1e-3))  # a millisecond's worth, at least 1 MiB (as measured here)
        _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate", f"{rate:.0f}bit",
             "burst", str(burst), "latency", "10ms")
        if self.delay_ms > 0 and self.delay_missing is None:
            try:
                _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem", "delay",
                     f"{self.delay_ms}ms", "limit", "100000")
            except LinkUnavailable as exc:  # a kernel without sch_netem: the rate still holds, the delay is gone
                self.delay_missing = f"no delay emulated: {exc}"

    def _remove_stale(self) -> None:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        for name in listed:
            if not name.startswith(self.PREFIX) or not name[len(self.PREFIX) + 1:].isdigit():
                continue
            if not Path(f"/proc/{name[len(self.PREFIX) + 1:]}").exists():  # its run is gone
                subprocess.run(["ip", "netns", "del", name], capture_output=True)

    def enter(self, ns: str) -> None:
        """Move this thread (the one that sends the requests) into ``ns``."""
        if self._home is None:
            self._home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
        try:
            _setns(fd)
        finally:
            os.close(fd)

    def leave(self) -> None:
        if self._home is not None:
            _setns(self._home)
            os.close(self._home)
            self._home = None

    def close(self) -> None:
        self.leave()
        for ns in reversed(self._made):  # removing a namespace removes the veth end in it, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()

    @property
    def capped(self) -> bool:
        return self.rate_gbit > CAPPED_ABOVE_GBIT


class NamespacedServers:
    """One prefill and one decode server, each a gunicorn process in its own namespace (``ip netns exec``),
    started with the project's own launch command (``ops/launch.server_command``)."""

    def __init__(self, config: dict, link: ShapedLink, log_dir: Path):
        self.cfg = cluster_config.coerce(config)
        self.link, self.log_dir = link, log_dir
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []

    def start(self) -> "NamespacedServers":
        for entry in (*self.cfg.prefill_servers, *self.cfg.decode_servers):
            ns = self.link.prefill_ns if entry.role == "prefill" else self.link.decode_ns
            cmd, env = server_command(from_cluster(self.cfg, entry.name), f"{entry.host}:{entry.port}")
            log = self.log_dir / f"{entry.name}.log"
            with open(log, "ab") as out:
                self.procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *cmd], env=env, stdout=out,
                                                   stderr=subprocess.STDOUT, start_new_session=True))
            self.logs.append(log)
        return self

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        self.procs.clear()

    def check_alive(self) -> None:
        for proc, log in zip(self.procs, self.logs):
            if proc.poll() is not None:
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
                raise RuntimeError(f"a server exited with code {proc.returncode}:\n{tail}")


# -- what is measured --------------------------------------------------------------------------------

def model_settings(name: str, n_ctx: int, threads: int) -> dict:
    base = {"backend": "llama_cpp", "n_ctx": n_ctx, "n_threads": threads, "flash_attn": True, "parallel": 1,
            "prefix_cache": False}  # both runs of a round evaluate the whole prompt
    if name == "smollm2":
        return {**base, "model": "smollm2"}
    if name == "wide":
        from tests.tiny_models import TinyShape, tiny_gguf

        shape = TinyShape(arch="qwen3moe", n_layer=48, n_head=4, n_head_kv=4, head_dim=128,
                          context_length=max(16384, n_ctx))
        return {**base, "model": str(tiny_gguf(shape))}
    raise SystemExit(f"unknown model {name!r} (smollm2 or wide)")


def cluster_dict(model: dict, prefill: tuple[str, int], decode: tuple[str, int], token: str | None) -> dict:
    # both servers share this machine's cores, whatever their addresses say: their OpenMP threads sleep at
    # barriers (spinning, two servers of two threads on two cores ran a prefill a hundred times slower)
    server = {"lease_seconds": TIMEOUT, "queue_timeout": TIMEOUT, "kv_fetch_timeout": TIMEOUT,
              "kv_progress_timeout": 60.0, "max_lease_seconds": TIMEOUT, "openmp_wait": "sleep"}
    client = {"prefill_timeout": TIMEOUT, "decode_timeout": 2 * TIMEOUT, "health_check_interval": 0}
    if token:
        server["api_token"] = client["api_token"] = token
    return {"models": {"m": {**model, "aliases": []}},
            "prefill_servers": [{"name": "bench-prefill", "host": prefill[0], "port": prefill[1], "model": "m"}],
            "decode_servers": [{"name": "bench-decode", "host": decode[0], "port": decode[1], "model": "m"}],
            "client": client, "server": server}


def prompt_of(vocab, tokens: int, tag: str) -> tuple[str, int]:
    """A raw prompt of about ``tokens`` tokens (at most that many), starting with ``tag``; and its token count."""
    text = f"{tag}. " + FILLER * (tokens // 20 + 4)
    ids = vocab.llama.tokenize(text.encode(), add_bos=True, special=False)[:tokens]
    text = vocab.llama.detokenize(ids[1:]).decode("utf-8", "replace")
    while True:
        n = len(vocab.llama.tokenize(text.encode(), add_bos=True, special=False))
        if n <= tokens:
            return text, n
        text = text[:-8]


def handoff(http, prefill: str, decode: str, prompt: str, mode: str) -> dict:
    """One handoff (``mode``: whole or streamed) and what it measured."""
    t0 = time.perf_counter()
    resp = http.post(f"{prefill}/prefill", json={"prompt": prompt, "raw": True, "handoff_mode": mode}, timeout=TIMEOUT)
    resp.raise_for_status()
    pre = resp.json()
    t1 = time.perf_counter()
    resp = http.post(f"{decode}/decode", json={"kv": pre["kv"], "max_new_tokens": NEW_TOKENS, "temperature": 0},
                     timeout=2 * TIMEOUT)
    if resp.status_code != 200:
        raise RuntimeError(f"decode answered {resp.status_code}: {resp.text[:300]}")
    dec = resp.json()
    m = dec["metrics"]
    pm = {**pre["metrics"], **(m.get("prefill_metrics") or {})}
    ttft = (t1 - t0) + m["ttft"]
    if pre["handoff_mode"] != mode:
        raise RuntimeError(f"asked for a {mode} handoff, got {pre['handoff_mode']}: {pre.get('handoff_mode_reason')}")
    return {"mode": mode, "prompt_tokens": pre["prompt_tokens"], "kv_bytes": pre["kv"]["bytes"],
            "prefill_s": pm["prefill_time"], "transfer_s": m["kv_transfer_time"], "exposed_s": m.get("kv_exposed_time"),
            "end_s": m.get("kv_end_after_prefill_time"),
            "ttft_s": ttft, "ttft_after_prefill_s": ttft - pm["prefill_time"], "import": m.get("kv_import"),
            "kv_load_s": m.get("kv_load_time"), "canary": m.get("canary"), "text": dec["generated_text"],
            "copy_s": pm.get("kv_export_time") or pm.get("kv_read_time")}


def med(runs: list[dict], key: str):
    values = [r[key] for r in runs if r.get(key) is not None]
    return round(statistics.median(values), 6) if values else None


def measure(http, prefill: str, decode: str, vocab, sizes, rounds: int, link: str, progress) -> list[dict]:
    rows = []
    handoff(http, prefill, decode, prompt_of(vocab, 64, "warm-up")[0], "whole")  # first evaluations pay one-offs
    handoff(http, prefill, decode, prompt_of(vocab, 64, "warm-up, streamed")[0], "streamed")
    for size in sizes:
        whole, streamed = [], []
        for r in range(rounds):
            prompt, n = prompt_of(vocab, size, f"Round {r} of the {size}-token runs")
            whole.append(handoff(http, prefill, decode, prompt, "whole"))
            streamed.append(handoff(http, prefill, decode, prompt, "streamed"))
            progress(f"{link} {size} tokens round {r + 1}/{rounds}: whole TTFT {whole[-1]['ttft_s']:.3f}s "
                     f"(transfer {whole[-1]['transfer_s']:.3f}s), overlapped {streamed[-1]['ttft_s']:.3f}s "
                     f"(exposed {streamed[-1]['exposed_s']}s), prefill {whole[-1]['prefill_s']:.2f}s")
        row = {"link": link, "tokens": size, "prompt_tokens": whole[0]["prompt_tokens"], "kv_bytes": whole[0]["kv_bytes"],
               "rounds": rounds, "prefill_s": med(whole, "prefill_s"), "prefill_streamed_s": med(streamed, "prefill_s"),
               "whole_transfer_s": med(whole, "transfer_s"), "exposed_transfer_s": med(streamed, "exposed_s"),
               "stream_end_after_prefill_s": med(streamed, "end_s"),
               "streamed_receiving_s": med(streamed, "transfer_s"),
               "ttft_whole_s": med(whole, "ttft_s"), "ttft_overlapped_s": med(streamed, "ttft_s"),
               "ttft_after_prefill_whole_s": med(whole, "ttft_after_prefill_s"),
               "ttft_after_prefill_overlapped_s": med(streamed, "ttft_after_prefill_s"),
               "whole_copy_s": med(whole, "copy_s"), "streamed_read_s": med(streamed, "copy_s"),
               "whole_import_s": med(whole, "kv_load_s"), "streamed_import_s": med(streamed, "kv_load_s"),
               "greedy_equal": all(w["text"] == s["text"] for w, s in zip(whole, streamed)),
               "import": sorted({s["import"] for s in streamed if s["import"]}),
               "canary": sorted({x["canary"] for x in whole + streamed})}
        if row["whole_transfer_s"]:
            row["after_prefill_vs_whole_transfer"] = round(row["ttft_after_prefill_overlapped_s"]
                                                           / row["whole_transfer_s"], 3)
            if row["exposed_transfer_s"] is not None:
                row["exposed_vs_whole_transfer"] = round(row["exposed_transfer_s"] / row["whole_transfer_s"], 3)
        rows.append(row)
    return rows


def doctor_figures(cfg: dict) -> dict:
    report = Doctor(cluster_config.coerce(cfg), probe_bytes=PROBE_BYTES, timeout=TIMEOUT).run()
    pair = report.pairs[0] if report.pairs else {}
    keep = ("throughput_MB_s", "connect_ms", "kv_bytes_per_token", "handoff_s")
    return {**{k: pair.get(k) for k in keep}, "problems": [p.problem for p in report.problems]}


def wait_healthy(http, urls: list[str], alive=lambda: None, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    for url in urls:
        while True:
            alive()
            try:
                if http.get(f"{url}/health", timeout=5).json().get("loaded"):
                    break
            except (requests.RequestException, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} not healthy after {timeout:g}s")
            time.sleep(0.5)


def session(token: str | None) -> requests.Session:
    http = requests.Session()
    if token:
        http.headers["Authorization"] = f"Bearer {token}"
    return http


def run_model(name: str, args, link: ShapedLink | None, log_dir: Path, progress) -> dict:
    from disaggregated_inference.backends.gguf import resolve_gguf
    from disaggregated_inference.backends.gguf_vocab import GgufVocab

    n_ctx = -(-(max(args.tokens) + 256) // 256) * 256
    model = model_settings(name, n_ctx, args.threads)
    vocab = GgufVocab(resolve_gguf(model["model"]))
    out: dict = {"model": name, "n_ctx": n_ctx, "rows": []}
    try:
        if not args.no_loopback:
            cfg = cluster_dict(model, ("127.0.0.1", 8100), ("127.0.0.1", 8101), None)  # free ports are bound
            with LocalCluster(cfg, free_ports=True, log_dir=log_dir / f"{name}-loopback") as cluster:
                cluster.wait_healthy(timeout=900)
                out["loopback_doctor"] = doctor_figures(cluster.config)
                with session(None) as http:
                    out["rows"] += measure(http, cluster.process("bench-prefill").url, cluster.process("bench-decode").url,
                                           vocab, args.tokens, args.rounds, "loopback", progress)
        if link is not None:
            token = secrets.token_urlsafe(16)  # the servers listen beyond loopback (in their namespaces)
            cfg = cluster_dict(model, (PREFILL_ADDR, PORT), (DECODE_ADDR, PORT), token)
            servers = NamespacedServers(cfg, link, log_dir).start()
            try:
                link.enter(link.decode_ns)  # the requests leave from beside the decode server
                with session(token) as http:
                    prefill, decode = f"http://{PREFILL_ADDR}:{PORT}", f"http://{DECODE_ADDR}:{PORT}"
                    wait_healthy(http, [prefill, decode], servers.check_alive)
                    out["link_doctor"] = doctor_figures(cfg)
                    out["rows"] += measure(http, prefill, decode, vocab, args.tokens, args.rounds,
                                           f"emulated {args.rate_gbit:g} Gbit/s", progress)
            finally:
                link.leave()
                servers.stop()
    finally:
        vocab.close()
    out["kv_bytes_per_token"] = round(out["rows"][0]["kv_bytes"] / max(1, out["rows"][0]["prompt_tokens"] - 1)) \
        if out["rows"] else None
    return out


def machine() -> dict:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate-gbit", type=float, default=10.0, help="the emulated link's rate (1, 10, 25, 80)")
    parser.add_argument("--delay-ms", type=float, default=0.1, help="one-way delay added by netem")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192], help="prompt sizes")
    parser.add_argument("--rounds", type=int, default=3, help="handoffs per size and mode (medians reported)")
    parser.add_argument("--models", nargs="+", default=["smollm2", "wide"], help="smollm2 and/or wide")
    parser.add_argument("--threads", type=int, default=2, help="compute threads per server")
    parser.add_argument("--no-loopback", action="store_true", help="skip the loopback runs")
    parser.add_argument("--loopback-only", action="store_true", help="skip the emulated link (no root needed)")
    quick.add_argument(parser)  # one small size, one round, the wide model: a check
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = quick.apply(parser, parser.parse_args(argv), tokens=[512], rounds=1, models=["wide"])

    def progress(message: str) -> None:
        print(f"[link] {message}", file=sys.stderr, flush=True)

    problem = None if args.loopback_only else ShapedLink.unavailable()
    link = None
    if problem is None and not args.loopback_only:
        link = ShapedLink(args.rate_gbit, args.delay_ms)
        atexit.register(link.close)
        for sig in (signal.SIGTERM, signal.SIGHUP):  # the namespaces go on these too (finally blocks run)
            signal.signal(sig, guarded(lambda signum, frame: sys.exit(128 + signum)))
        try:
            link.open()
        except LinkUnavailable as exc:
            problem, link = str(exc), None
    if problem is not None:
        if args.quick and args.json:
            print(json.dumps({"skipped": problem, "machine": machine()}))
            return 0
        print(f"benchmarks/link.py: {problem}", file=sys.stderr)
        return 2
    if link is not None and link.delay_missing:
        progress(link.delay_missing)
    out = {"machine": machine(), "rate_gbit": None if link is None else args.rate_gbit,
           "delay_ms": None if link is None or link.delay_missing else args.delay_ms,
           "delay_note": link.delay_missing if link is not None else None, "capped": bool(link and link.capped),
           "tokens": args.tokens, "rounds": args.rounds, "new_tokens": NEW_TOKENS, "models": []}
    log_dir = Path(tempfile.mkdtemp(prefix="disagg-link-"))
    started = time.time()
    try:
        for name in args.models:
            progress(f"model {name}")
            out["models"].append(run_model(name, args, link, log_dir, progress))
    finally:
        if link is not None:
            link.close()
    out["machine"]["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    shutil.rmtree(log_dir, ignore_errors=True)  # the servers' logs; kept when a run fails
    out["seconds"] = round(time.time() - started, 1)
    if args.json:
        print(json.dumps(out))
        return 0
    for m in out["models"]:
        print(f"{m['model']}: {m['kv_bytes_per_token']} KV bytes/token; doctor: link {m.get('link_doctor')}, "
              f"loopback {m.get('loopback_doctor')}")
        for r in m["rows"]:
            print(f"  {r['link']:24} {r['prompt_tokens']:5d} tok  prefill {r['prefill_s']:.3f}s  whole transfer "
                  f"{r['whole_transfer_s']:.3f}s  exposed {r['exposed_transfer_s']}s  TTFT whole {r['ttft_whole_s']:.3f}s"
                  f"  overlapped {r['ttft_overlapped_s']:.3f}s  after prefill/transfer "
                  f"{r.get('after_prefill_vs_whole_transfer')}  greedy equal {r['greedy_equal']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
