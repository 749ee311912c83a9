"""Benchmark: a soak under faults: steady load on both models, through the client and the gateway, with
a schedule of faults, for ``--duration``; what was lost, duplicated or failed, in and out of the faults.

On a local cluster of its own (two prefill and two decode servers per model, and the gateway, on
ports of its own; a server that dies is restarted as under ``disagg up``):

- **load**: ``--rate`` requests a second, alternating the models and four paths: the client's
  ``generate`` and ``stream``, the gateway's OpenAI chat (whole) and Ollama generate (NDJSON stream);
- **faults**, in turn, one at a time, each followed by a quiet spell: SIGKILL of a prefill and of a
  decode server, SIGSTOP of each for ``--fault-seconds``, a prefill server's lease store filled by
  prefills that are never decoded, the gateway restarted under load. Then the link faults, on a pair
  of their own (``link_faults``): a prefill and a decode server in two network namespaces joined by a
  shaped veth, as ``benchmarks/link.py`` builds them, the link cut (mid-transfer, for requests under
  way) and restored, then slowed to 100 Mbit/s; they need root, ``ip`` and ``tc``, else are skipped
  with the reason (``--no-link`` skips them);
- **records**: each request's outcome (answered, or failed with which error, by which path), and every
  ``--sample-every`` seconds each server's RSS, open files, threads and (prefill) leases.

Figures (JSON): requests sent, answered, failed; **lost** (sent, never answered nor failed) and
**duplicated** (a request that got more than one final answer); the error rate outside the fault
windows (a fault's window: from its start to ``--settle`` seconds after it ended) and inside them;
per kind of fault, the time from its start to the first answer of a request sent after it (p50, max);
leases held at the end and after their TTL; the growth of RSS, open files and threads per 1,000
requests after the warm-up (per server, over the stretch its process lived). ``--plot PNG`` draws the
resources over time with the faults marked.

    .venv/bin/python benchmarks/soak.py --duration 1800 --json > soak.json
    .venv/bin/python benchmarks/soak.py --quick --json      # seconds: tiny models, one fault of each kind
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import psutil
import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import quick  # noqa: E402
from disaggregated_inference.client import DisaggregatedClient  # noqa: E402
from disaggregated_inference.ops.cluster import LocalCluster  # noqa: E402
from disaggregated_inference.ops.lifetime import stop_on_signals  # noqa: E402
from disaggregated_inference.ops.supervise import Supervisor  # noqa: E402
from tests.faults import freeze, thaw  # noqa: E402

PATHS = ("client.generate", "client.stream", "gateway.openai", "gateway.ollama_stream")
FAULTS = ("kill_prefill", "kill_decode", "stop_prefill", "stop_decode", "fill_leases", "restart_gateway")


def cluster_config(tiny: bool, progress_timeout: float, lease_seconds: float, max_lease_bytes: int) -> dict:
    data = json.loads((ROOT / "config_current.json").read_text())
    path = quick.tiny_model() if tiny else None
    for entry in data["models"].values():
        entry.update(n_threads=1, deterministic=True)
        if path:
            entry.update(model=path, backend="llama_cpp", n_ctx=2048)
    for role in ("prefill", "decode"):
        data[f"{role}_servers"] = [{"name": f"{role[0]}-{model}-{k}", "host": "127.0.0.1", "port": 1, "model": model}
                                   for model in data["models"] for k in (1, 2)]
    data["client"].update(health_check_interval=0.5, failures_before_down=1, connect_timeout=1,
                          progress_timeout=progress_timeout, prefill_timeout=60, decode_timeout=120)
    data["server"].update(share_cores=False, lease_seconds=lease_seconds, kv_fetch_timeout=30,
                          max_lease_bytes=max_lease_bytes)
    return data


class Load:
    """``rate`` requests a second from a pool of threads, each recorded: path, model, when sent and done,
    outcome, error, how many final answers it got."""

    def __init__(self, client, gateway_url: str, models: list, rate: float, max_tokens: int, workers: int = 16):
        self.client, self.gateway_url, self.models = client, gateway_url, models
        self.rate, self.max_tokens = rate, max_tokens
        self.pool = ThreadPoolExecutor(max_workers=workers)
        self.rows: list[dict] = []
        self.futures = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="soak-load", daemon=True)

    def _run(self) -> None:
        started = time.monotonic()
        for n in itertools.count():
            due = started + n / self.rate
            if self.stop.wait(max(0.0, due - time.monotonic())):
                return
            row = {"id": n, "path": PATHS[n % len(PATHS)], "model": self.models[(n // len(PATHS)) % len(self.models)],
                   "sent": time.monotonic(), "done": None, "outcome": None, "finals": 0}
            self.rows.append(row)
            self.futures.append(self.pool.submit(self._one, row))

    def _one(self, row: dict) -> None:
        prompt = f"Request {row['id']}: summarise the sales of region {row['id'] % 7}."
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                row["finals"], row["moved"] = getattr(self, "_" + row["path"].replace(".", "_"))(row["model"], prompt)
            row["outcome"] = "answered"
        except Exception as exc:  # noqa: BLE001 - every failure is an outcome, counted by kind
            row["outcome"], row["error"] = "failed", f"{getattr(exc, 'code', type(exc).__name__)}: {exc}"[:300]
        row["done"] = time.monotonic()

    def _client_generate(self, model, prompt):
        _, metrics = self.client.generate(model=model, prompt=prompt, max_tokens=self.max_tokens, seed=0)
        return 1, bool(metrics.get("resumed"))

    def _client_stream(self, model, prompt):
        finals = [item for item in self.client.stream(model=model, prompt=prompt, max_tokens=self.max_tokens, seed=0)
                  if isinstance(item, dict)]
        return len(finals), any(m.get("resumed") for m in finals)

    def _gateway_openai(self, model, prompt):
        resp = requests.post(self.gateway_url + "/v1/chat/completions", timeout=180, json={
            "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": self.max_tokens,
            "temperature": 0, "seed": 0})
        resp.raise_for_status()
        return len(resp.json()["choices"]), False

    def _gateway_ollama_stream(self, model, prompt):
        finals = 0
        with requests.post(self.gateway_url + "/api/generate", stream=True, timeout=180, json={
                "model": model, "prompt": prompt, "options": {"num_predict": self.max_tokens, "temperature": 0,
                                                              "seed": 0}}) as resp:
            resp.raise_for_status()
            for raw in resp.iter_lines():
                if raw:
                    line = json.loads(raw)
                    if "error" in line:
                        raise RuntimeError(line["error"])
                    finals += bool(line.get("done"))
        if not finals:
            raise RuntimeError("the stream ended without its last line")
        return finals, False

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def drain(self, grace: float) -> None:
        wait(list(self.futures), timeout=grace)
        self.pool.shutdown(wait=False, cancel_futures=True)


class Sampler:
    """Every ``every`` seconds: each server's (and the gateway's) RSS, open files and threads, the master and
    its worker together, and each prefill server's leases held."""

    def __init__(self, cluster, load: Load, every: float):
        self.cluster, self.load, self.every = cluster, load, every
        self.samples: list[dict] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(self.every):
            done = sum(1 for r in self.load.rows if r["done"] is not None)
            for proc in [*self.cluster.processes, self.cluster.gateway]:
                sample = {"t": time.monotonic(), "server": proc.entry.name, "requests_done": done,
                          **_resources(proc.proc.pid if proc.proc else None)}
                if proc.entry.role == "prefill":
                    sample["leases"] = _leases(proc.url)
                self.samples.append(sample)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def _resources(pid) -> dict:
    try:
        master = psutil.Process(pid)
        procs = [master, *master.children(recursive=True)]
        return {"pid": pid, "rss_mb": round(sum(p.memory_info().rss for p in procs) / 2**20, 2),
                "open_files": sum(p.num_fds() for p in procs), "threads": sum(p.num_threads() for p in procs)}
    except (psutil.Error, TypeError, ValueError):
        return {"pid": pid, "rss_mb": None, "open_files": None, "threads": None}


def _leases(url: str):
    try:
        return requests.get(url + "/health", timeout=2).json().get("leases", {}).get("held")
    except (requests.RequestException, ValueError):
        return None


def _healthy(proc, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(proc.url + "/health", timeout=1).json().get("loaded"):
                return True
        except (requests.RequestException, ValueError):
            pass
        time.sleep(0.2)
    return False


def inject(kind: str, cluster, turn: int, seconds: float) -> dict:
    """Run one fault; returns its record (start, end: when it was over: the server back, the process thawed)."""
    role = "prefill" if "prefill" in kind or kind == "fill_leases" else "decode"
    servers = [p for p in cluster.processes if p.entry.role == role]
    target = cluster.gateway if kind == "restart_gateway" else servers[turn % len(servers)]
    record = {"kind": kind, "server": target.entry.name, "start": time.monotonic()}
    if kind.startswith("kill_"):
        target.kill()  # the supervisor starts it again
        time.sleep(0.5)
        record["back"] = _healthy(target, 120)
    elif kind.startswith("stop_"):
        freeze(target)
        time.sleep(seconds)
        thaw(target)
    elif kind == "fill_leases":
        held, refused = 0, 0
        ends = time.monotonic() + seconds
        while time.monotonic() < ends and refused < 3:
            try:
                resp = requests.post(target.url + "/prefill", timeout=30, json={
                    "prompt": "Held and never decoded. " * 40, "lease_seconds": seconds * 2})
                held += resp.status_code == 200
                refused += resp.status_code == 503
            except requests.RequestException:
                refused += 1
        record.update(prefills_held=held, refused=refused)
    elif kind == "restart_gateway":
        target.stop()  # SIGTERM: gunicorn's graceful stop, under load; the supervisor starts it again
        record["back"] = _healthy(target, 60)
    record["end"] = time.monotonic()
    return record


# -- faults of the link (network namespaces, as benchmarks/link.py builds them) ----------------------------

def link_faults(args) -> dict:
    """A prefill and a decode server in two network namespaces joined by a shaped veth (benchmarks/link.py),
    under load sent from beside the decode server: the link cut (both ends down) for ``--fault-seconds`` and
    restored, then slowed to 100 Mbit/s for as long and restored. Each request's outcome, how it was served
    (a handoff, or decode-only while no prefill server could be reached), and per fault the time from its
    start to the first answer of a request sent after it. Needs root, ip and tc: without, skipped, saying so."""
    import secrets

    import link as emulated

    problem = emulated.ShapedLink.unavailable()
    if problem is not None:
        return {"skipped": problem}
    shaped = emulated.ShapedLink(args.link_gbit, 0.1)
    try:
        shaped.open()
    except emulated.LinkUnavailable as exc:
        shaped.close()
        return {"skipped": str(exc)}
    model = quick.tiny_model() if args.quick else "smollm2"
    token = secrets.token_urlsafe(16)  # the servers listen beyond loopback (in their namespaces)
    cfg = emulated.cluster_dict({"backend": "llama_cpp", "model": model, "n_ctx": 2048, "n_threads": 1,
                                 "deterministic": True}, (emulated.PREFILL_ADDR, emulated.PORT),
                                (emulated.DECODE_ADDR, emulated.PORT), token)
    cfg["server"].update(lease_seconds=args.lease_seconds, kv_fetch_timeout=30, kv_progress_timeout=2.0,
                         queue_timeout=60)
    cfg["client"].update(prefill_timeout=60, decode_timeout=120, connect_timeout=1, failures_before_down=1,
                         progress_timeout=args.progress_timeout, health_check_interval=0.5)
    log_dir = Path(tempfile.mkdtemp(prefix="disagg-soak-link-"))
    servers = emulated.NamespacedServers(cfg, shaped, log_dir).start()
    rows: list[dict] = []
    faults: list[dict] = []
    stop = threading.Event()

    def beside_the_decode_server(k: int) -> None:
        fd = os.open(f"/run/netns/{shaped.decode_ns}", os.O_RDONLY)
        emulated._setns(fd)  # this thread only; it ends with the load
        with DisaggregatedClient(cfg, health_check=False) as client:
            for n in itertools.count():
                if stop.is_set():
                    return
                row = {"id": f"{k}-{n}", "sent": time.monotonic(), "done": None, "outcome": None}
                rows.append(row)
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        _, m = client.generate(model="m", prompt=f"Link request {k}-{n}: " + "sales " * 200,
                                               max_tokens=args.max_tokens, raw=True)
                    row.update(outcome="answered", method=m["method"])
                except Exception as exc:  # noqa: BLE001 - an outcome
                    row.update(outcome="failed", error=f"{getattr(exc, 'code', type(exc).__name__)}: {exc}"[:300])
                    stop.wait(0.2)
                row["done"] = time.monotonic()

    def set_link(command: str) -> None:
        for ns, dev in ((shaped.prefill_ns, shaped.prefill_dev), (shaped.decode_ns, shaped.decode_dev)):
            if command in ("up", "down"):
                emulated._run("ip", "-n", ns, "link", "set", dev, command)
            else:
                burst = max(1 << 16, int(float(command) / 8 * 1e-3))
                emulated._run("tc", "-n", ns, "qdisc", "change", "dev", dev, "root", "handle", "1:", "tbf",
                              "rate", f"{float(command):.0f}bit", "burst", str(burst), "latency", "50ms")

    try:
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        fd = os.open(f"/run/netns/{shaped.decode_ns}", os.O_RDONLY)
        emulated._setns(fd)
        try:
            emulated.wait_healthy(emulated.session(token), [f"http://{emulated.PREFILL_ADDR}:{emulated.PORT}",
                                                           f"http://{emulated.DECODE_ADDR}:{emulated.PORT}"],
                                  servers.check_alive, timeout=600)
        finally:
            emulated._setns(home)
        threads = [threading.Thread(target=beside_the_decode_server, args=(k,), daemon=True) for k in range(2)]
        for t in threads:
            t.start()
        time.sleep(args.fault_seconds)
        for kind, fault, restore in (("link_cut", "down", "up"),
                                     ("link_slow_100mbit", str(100e6), str(args.link_gbit * 1e9))):
            quick.say(f"fault: {kind}")
            record = {"kind": kind, "start": time.monotonic()}
            set_link(fault)
            time.sleep(args.fault_seconds)
            set_link(restore)
            record["end"] = time.monotonic()
            faults.append(record)
            time.sleep(args.fault_seconds + args.progress_timeout)
        stop.set()
        for t in threads:
            t.join(180)
    finally:
        stop.set()
        servers.stop()
        shaped.close()
    began = min((r["sent"] for r in rows), default=0.0)
    out = {"model": "tiny" if args.quick else "smollm2", "link_gbit": args.link_gbit,
           "sent": len(rows), "answered": sum(r["outcome"] == "answered" for r in rows),
           "failed": sum(r["outcome"] == "failed" for r in rows), "lost": sum(r["outcome"] is None for r in rows),
           "methods": {m: sum(r.get("method") == m for r in rows) for m in {r.get("method") for r in rows} if m},
           "errors": sorted({r["error"].split(":", 1)[0] for r in rows if r.get("error")}), "faults": []}
    for f in faults:
        first = min((r["done"] for r in rows if r["outcome"] == "answered" and r["sent"] >= f["start"]), default=None)
        inside = [r for r in rows if r["done"] and r["sent"] < f["end"] + args.settle and r["done"] > f["start"]]
        out["faults"].append({"kind": f["kind"], "start": round(f["start"] - began, 3), "end": round(f["end"] - began, 3),
                              "time_to_first_answer_s": None if first is None else round(first - f["start"], 3),
                              "requests": len(inside), "failed": sum(r["outcome"] == "failed" for r in inside),
                              "decode_only": sum(r.get("method", "").startswith("decode_only") for r in inside)})
    return out


def _p50_max(values: list) -> dict:
    return {"p50": round(statistics.median(values), 3) if values else None,
            "max": round(max(values), 3) if values else None, "n": len(values)}


def figures(rows: list, faults: list, samples: list, settle: float, warmup: float, started: float) -> dict:
    windows = [(f["start"], f["end"] + settle) for f in faults]

    def in_window(row) -> bool:
        end = row["done"] if row["done"] is not None else float("inf")
        return any(row["sent"] < b and end > a for a, b in windows)

    answered = [r for r in rows if r["outcome"] == "answered"]
    failed = [r for r in rows if r["outcome"] == "failed"]
    inside = [r for r in rows if r["outcome"] and in_window(r)]
    outside = [r for r in rows if r["outcome"] and not in_window(r)]
    rate = (lambda rs: round(sum(r["outcome"] == "failed" for r in rs) / len(rs), 5) if rs else None)
    by_kind: dict = {}
    for f in faults:
        gateway_only = f["kind"] == "restart_gateway"
        first = min((r["done"] for r in answered if r["sent"] >= f["start"]
                     and (not gateway_only or r["path"].startswith("gateway"))), default=None)
        by_kind.setdefault(f["kind"], []).append(None if first is None else first - f["start"])
    errors: dict = {}
    for r in failed:
        key = f"{r['path']}: {r['error'].split(':', 1)[0]}"
        errors[key] = errors.get(key, 0) + 1
    return {
        "sent": len(rows), "answered": len(answered), "failed": len(failed),
        "lost": sum(1 for r in rows if r["outcome"] is None),
        "duplicated": sum(1 for r in answered if r.get("finals", 1) > 1),
        "moved_to_another_decode_server": sum(1 for r in answered if r.get("moved")),
        "error_rate_outside_faults": rate(outside), "requests_outside_faults": len(outside),
        "error_rate_inside_faults": rate(inside), "requests_inside_faults": len(inside),
        "errors_by_path_and_code": errors,
        "time_to_first_answer_after_fault_s": {k: _p50_max([v for v in vs if v is not None]) | {
            "never": sum(v is None for v in vs)} for k, vs in by_kind.items()},
        "growth_per_1000_requests": growth(samples, started + warmup),
    }


def growth(samples: list, after: float) -> dict:
    """Per server: the least-squares slope of RSS (MB), open files and threads against requests done, per
    1,000 requests, over the samples after the warm-up while its process lived (its longest stretch)."""
    out = {}
    warmup = after - min((s["t"] for s in samples), default=after)
    for name in sorted({s["server"] for s in samples}):
        mine = [s for s in samples if s["server"] == name and s["rss_mb"] is not None]
        stretches: dict = {}
        for s in mine:
            stretches.setdefault(s["pid"], []).append(s)
        for pid, stretch in stretches.items():  # a process started again warms up again (its model loads)
            begun = after if pid == mine[0]["pid"] else stretch[0]["t"] + warmup
            stretches[pid] = [s for s in stretch if s["t"] >= begun]
        longest = max(stretches.values(), key=len, default=[])
        if len(longest) < 3 or longest[-1]["requests_done"] == longest[0]["requests_done"]:
            continue
        out[name] = {key: _slope([s["requests_done"] for s in longest], [s[key] for s in longest])
                     for key in ("rss_mb", "open_files", "threads")}
        out[name]["samples"] = len(longest)
    return out


def _slope(x: list, y: list) -> float | None:
    mx, my = statistics.fmean(x), statistics.fmean(y)
    den = sum((a - mx) ** 2 for a in x)
    return round(1000 * sum((a - mx) * (b - my) for a, b in zip(x, y)) / den, 3) if den else None


def plot(path: str, samples: list, faults: list, started: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    for ax, key, label in zip(axes, ("rss_mb", "open_files", "threads"), ("RSS (MB)", "open files", "threads")):
        for name in sorted({s["server"] for s in samples}):
            mine = [s for s in samples if s["server"] == name and s[key] is not None]
            ax.plot([s["t"] - started for s in mine], [s[key] for s in mine], label=name, linewidth=1)
        for f in faults:
            ax.axvspan(f["start"] - started, f["end"] - started, color="red", alpha=0.15)
        ax.set_ylabel(label)
    axes[0].legend(fontsize=6, ncol=3)
    axes[-1].set_xlabel("seconds (faults shaded)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


@stop_on_signals()  # SIGTERM, SIGHUP, Ctrl-C: the servers stopped and the namespaces removed on the way out
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of load")
    parser.add_argument("--rate", type=float, default=4.0, help="requests a second, all paths together")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    parser.add_argument("--fault-seconds", type=float, default=10.0, help="how long a SIGSTOP or a lease fill lasts")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds after a fault still counted in its window")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds before faults and growth figures")
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between resource samples")
    parser.add_argument("--progress-timeout", type=float, default=5.0, help="the client's (silence taken as hung)")
    parser.add_argument("--lease-seconds", type=float, default=30.0, help="the servers' KV lease TTL")
    parser.add_argument("--max-lease-mb", type=float, default=256.0,
                        help="each prefill server's lease store (server.max_lease_bytes): what the fill fault fills")
    parser.add_argument("--link-gbit", type=float, default=10.0, help="the emulated link's rate for the link faults")
    parser.add_argument("--no-link", action="store_true", help="skip the link faults (they need root, ip and tc)")
    parser.add_argument("--plot", metavar="PNG", help="draw the resources over time, the faults marked")
    parser.add_argument("--json", action="store_true")
    quick.add_argument(parser)
    args = quick.apply(parser, parser.parse_args(argv), duration=24.0, rate=3.0, max_tokens=8, fault_seconds=1.5,
                       settle=3.0, warmup=2.0, sample_every=1.0, progress_timeout=2.0, lease_seconds=4.0,
                       max_lease_mb=2.0)
    config = cluster_config(args.quick, args.progress_timeout, args.lease_seconds, int(args.max_lease_mb * 2**20))
    out = {"quick": args.quick, "duration_s": args.duration, "rate": args.rate, "max_tokens": args.max_tokens,
           "servers": len(config["prefill_servers"]) + len(config["decode_servers"])}
    with LocalCluster(config, free_ports=True, gateway=True) as cluster:
        cluster.wait_healthy(timeout=600)
        supervising = threading.Event()
        supervisor = threading.Thread(target=Supervisor(cluster, quick.say, first_delay=0.5, stable_after=5).run,
                                      args=(supervising, 0.2), daemon=True)
        supervisor.start()
        quick.say(f"{args.duration:g} s of load at {args.rate:g} requests/s on {out['servers']} servers and the gateway")
        faults: list = []
        with DisaggregatedClient(cluster.config) as client:
            load = Load(client, cluster.gateway.url, list(config["models"]), args.rate, args.max_tokens)
            started = time.monotonic()
            with load, Sampler(cluster, load, args.sample_every) as sampler:
                time.sleep(args.warmup)
                span = (args.duration - args.warmup) / len(FAULTS)
                for turn in itertools.count():
                    kind = FAULTS[turn % len(FAULTS)]
                    due = started + args.warmup + turn * span
                    if due + span > started + args.duration + 1e-6:
                        break
                    time.sleep(max(0.0, due - time.monotonic()))
                    quick.say(f"fault: {kind}")
                    faults.append(inject(kind, cluster, turn // len(FAULTS), args.fault_seconds))
                time.sleep(max(0.0, started + args.duration - time.monotonic()))
            load.drain(grace=60)
            out["leases_at_end"] = sum(_leases(p.url) or 0 for p in cluster.processes if p.entry.role == "prefill")
            time.sleep(max(args.lease_seconds, 2 * args.fault_seconds) + 1.5)  # the TTLs (the fill asks for 2x its length)
            out["leases_after_ttl"] = sum(_leases(p.url) or 0 for p in cluster.processes if p.entry.role == "prefill")
        supervising.set()
        supervisor.join(5)
    out.update(figures(load.rows, faults, sampler.samples, args.settle, args.warmup, started))
    out["faults"] = [{**f, "start": round(f["start"] - started, 3), "end": round(f["end"] - started, 3)}
                     for f in faults]
    out["link_faults"] = {"skipped": "--no-link"} if args.no_link else link_faults(args)
    if args.plot:
        plot(args.plot, sampler.samples, faults, started)
        out["plot"] = args.plot
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
