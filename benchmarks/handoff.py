"""Benchmark: time to first token on the decode server with the KV handed over vs recomputed.

For prompts of about 256, 1024 and 2048 tokens on SmolLM2 it measures, on real
gunicorn servers on loopback:

- ``handoff_ttft_s``: the decode server's time from request to first token when
  it receives the KV (pull + import + one prompt token + one sampled token);
- ``reprefill_cold_ttft_s``: the same when it receives only the token ids and must
  recompute the whole prompt (what Ollama's ``context`` forces), on a decode server of its own
  with the prefix cache off (``prefix_cache: false``), so that nothing it holds can serve the
  prompt (``reprefill_cold_recomputed``: the prompt tokens it evaluated, all of them);
  ``speedup_vs_cold`` divides it by ``handoff_ttft_s``;
- ``reprefill_warm_ttft_s``: a warm recompute: the same token ids sent to the handoff's decode
  server (prefix cache on, the default) right after its handoffs of that prompt, so a free slot
  holds the prompt's KV and the server evaluates only what the cache's chunk alignment leaves
  (``reprefill_warm_cached`` + ``reprefill_warm_recomputed`` = the prompt's tokens); what a
  decode-only request whose prompt start is cached costs; ``speedup_vs_warm`` divides it by
  ``handoff_ttft_s``;
- ``handoff_gbps``: KV bits over export (+checksum) + transfer + import time
  (the decode server's ``kv_load_time``, which includes any wait for the
  receive-side checksum that runs alongside the import);
- ``loopback_gbps``: raw loopback TCP throughput measured in the same run
  (one Python socket pair, 256 MiB per measurement; median of three at the
  start and of one just before and one just after every handoff's transfer,
  since a shared machine's speed drifts during a run); each result also gives
  ``loopback_gbps`` measured around its own handoffs and ``handoff_fraction``,
  the median over its runs of handoff_gbps / the mean of the two loopback
  figures taken around that handoff;
- ``loopback_bulk_gbps``: loopback TCP moving 64 MiB from one buffer into
  another, both larger than the CPU caches, as a KV transfer has to (the
  figure above resends one cache-hot 1 MiB chunk, as iperf does);
- ``memory_copy_gbps``: one thread copying 64 MiB from one buffer into another
  (``memmove``), the speed limit of the export and the import, which are copies;
- ``memory``: peak Python-traced memory of each side of the handoff, in KV
  copies, measured in this process with the servers' own code paths
  (tracemalloc for Python allocations plus the mapped buffers of buffers.py);
- ``machine.non_temporal_copy_bytes``: the copy threshold the prefill server
  runs with (its ``/health``; launch.py), null for glibc's own.

    .venv/bin/python benchmarks/handoff.py --json
    .venv/bin/python benchmarks/handoff.py --quick --json   # seconds: tiny model, two small prompts
"""
from __future__ import annotations

import argparse
import ctypes
import json
import socket
import statistics
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import quick  # noqa: E402
from disaggregated_inference.kv import buffers  # noqa: E402
from disaggregated_inference.kv import bundle  # noqa: E402
from disaggregated_inference.kv import send as sender  # noqa: E402
from disaggregated_inference.testing.bundles import read_bundle  # noqa: E402

FILLER = ("The quarterly sales report lists revenue by region, product line and month, "
          "with notes on returns, discounts and the marketing campaigns that ran. ")
QUESTION = "\nSummarise the report above in one sentence."


def _loopback(pieces, total_bytes: int, into) -> float:
    """Send ``pieces`` over one loopback TCP connection while a thread receives them with
    ``recv_into(into(bytes received so far))``; the throughput in Gb/s."""
    server = socket.create_server(("127.0.0.1", 0))
    received = [0]

    def sink():
        conn, _ = server.accept()
        while received[0] < total_bytes:
            n = conn.recv_into(into(received[0]))
            if not n:
                break
            received[0] += n
        conn.close()

    thread = threading.Thread(target=sink)
    thread.start()
    client = socket.create_connection(server.getsockname())
    started = time.perf_counter()
    for piece in pieces:
        client.sendall(piece)
    client.close()
    thread.join()
    elapsed = time.perf_counter() - started
    server.close()
    return received[0] * 8 / elapsed / 1e9


def loopback_gbps(total_bytes: int = 1 << 30, chunk: int = 1 << 20) -> float:
    """Raw TCP throughput over 127.0.0.1 with one Python socket pair, resending one chunk (as iperf does)."""
    data, view = b"\0" * chunk, memoryview(bytearray(chunk))
    return _loopback([data] * (total_bytes // chunk), total_bytes // chunk * chunk, lambda received: view)


def _faulted_pair(total_bytes: int) -> tuple[memoryview, memoryview]:
    """Two buffers of ``total_bytes``, every page already faulted in, as the handoff's buffers are."""
    source, sink = memoryview(buffers.allocate(total_bytes)), memoryview(buffers.allocate(total_bytes))
    source[:] = sink[:] = b"\1" * total_bytes
    return source, sink


def loopback_bulk_gbps(total_bytes: int = 64 << 20, chunk: int = 1 << 20) -> float:
    """Loopback TCP moving ``total_bytes`` from one buffer into another, both far larger than the
    CPU caches, as a KV transfer must (``loopback_gbps`` resends one cache-hot chunk)."""
    source, sink = _faulted_pair(total_bytes)
    pieces = (source[start:start + chunk] for start in range(0, total_bytes, chunk))
    return _loopback(pieces, total_bytes, lambda received: sink[received:received + chunk])


def memory_copy_gbps(total_bytes: int = 64 << 20) -> float:
    """One thread copying ``total_bytes`` between two buffers larger than the CPU caches, in Gb/s."""
    source, sink = _faulted_pair(total_bytes)
    src = ctypes.addressof((ctypes.c_char * total_bytes).from_buffer(source))
    dst = ctypes.addressof((ctypes.c_char * total_bytes).from_buffer(sink))
    started = time.perf_counter()
    ctypes.memmove(dst, src, total_bytes)
    return total_bytes * 8 / (time.perf_counter() - started) / 1e9


def prompt_for(tokens_wanted: int, tokens_per_repeat: float) -> str:
    return FILLER * max(0, round((tokens_wanted - 30) / tokens_per_repeat)) + QUESTION


def handoff_run(http, prefill_url, decode_url, prompt, loopback=None, loopback_bytes=256 << 20) -> dict:
    """Prefill, then decode one token from the handed-over KV.

    With ``loopback`` (a list), raw loopback throughput is measured right before
    and right after the decode call, while the KV waits under its lease, and both
    figures are appended: this machine's speed drifts within seconds, and the
    prompt's evaluation takes longer than that.
    """
    pre = http.post(f"{prefill_url}/prefill", json={"prompt": prompt}).json()
    kv = pre["kv"]
    if loopback is not None:
        loopback.append(loopback_gbps(loopback_bytes))
    hand = http.post(f"{decode_url}/decode", json={"kv": kv, "max_new_tokens": 1}).json()["metrics"]
    if loopback is not None:
        loopback.append(loopback_gbps(loopback_bytes))
    if hand["prompt_tokens_recomputed"] != 1 or hand["method"] != "kv_handoff":
        raise RuntimeError(f"the handoff recomputed {hand['prompt_tokens_recomputed']} prompt tokens, not 1: {hand}")
    export = pre["metrics"]["kv_export_time"] + pre["metrics"]["kv_checksum_time"]
    moved = export + hand["kv_transfer_time"] + hand["kv_load_time"]
    return {
        "prompt_tokens": pre["prompt_tokens"],
        "handoff_ttft_s": hand["ttft"],
        "handoff_recomputed": hand["prompt_tokens_recomputed"],
        "kv_bytes": kv["bytes"],
        "handoff_gbps": kv["bytes"] * 8 / moved / 1e9,
        "export_s": export,
        "transfer_s": hand["kv_transfer_time"],
        "import_s": hand["kv_load_time"],
        "prefill_time_s": pre["metrics"]["prefill_time"],
        "fingerprint": pre["fingerprint"],
        "tokens": pre["context"],  # the prompt's ids, for the recompute baselines
    }


def recompute_run(http, decode_url, tokens, fingerprint) -> dict:
    """Decode one token from the token ids alone (what Ollama's ``context`` sends): the decode server
    recomputes the prompt, all of it or, where its prefix cache holds the prompt's start, the rest."""
    m = http.post(f"{decode_url}/decode", json={"tokens": tokens, "fingerprint": fingerprint,
                                                "max_new_tokens": 1}).json()["metrics"]
    cached = m.get("prompt_tokens_cached", 0)
    if m["method"] != "token_ids_recompute" or m["prompt_tokens_recomputed"] + cached != len(tokens):
        raise RuntimeError(f"{len(tokens)} prompt tokens, but {m['prompt_tokens_recomputed']} recomputed and "
                           f"{cached} cached: {m}")
    return {"ttft_s": m["ttft"], "recomputed": m["prompt_tokens_recomputed"], "cached": cached}


def measure_memory(tokens_wanted: int, tokens_per_repeat: float, threads: int, model: str = "smollm2") -> dict:
    """Peak traced Python memory on each side of one handoff, as multiples of the KV size."""
    from disaggregated_inference.backends import ModelSettings, Prompt, Received, create

    settings = ModelSettings(model=model, n_threads=threads)
    exporter, importer = create(settings), create(settings)
    exporter.load()
    importer.load()
    prompt = Prompt(text=prompt_for(tokens_wanted, tokens_per_repeat))

    tracemalloc.start()
    buffers.usage.reset_peak()
    _, prefilled = exporter.run(exporter.prefill(prompt))
    header = bundle.BundleHeader(prefilled.kind, len(prefilled.tokens), len(prefilled.payload),
                                 bundle.payload_checksum(prefilled.payload), prefilled.fingerprint, prefilled.meta)
    framed = sender.frame_in_place(header, prefilled.tokens, prefilled.payload)
    a, b = socket.socketpair()

    def send():  # what the prefill server's /kv endpoint does: sendfile from the payload's file, else frames
        if framed is not None:
            with sender.RangeFile(framed, lambda: None) as source:
                a.sendfile(source, framed.start, framed.length)
        else:
            for piece in sender.body(header, prefilled.tokens, prefilled.payload, None, {}, lambda: None):
                a.sendall(piece)
        a.close()

    prefill_peak = tracemalloc.get_traced_memory()[1] + buffers.usage.peak
    # the decode side, measured above what the sender already holds
    baseline = tracemalloc.get_traced_memory()[0] + buffers.usage.live
    tracemalloc.reset_peak()
    buffers.usage.reset_peak()
    thread = threading.Thread(target=send)  # a second thread stands in for the network peer
    thread.start()
    # as a decode server receives: with the few bytes of room its slots' stream conversion needs
    got_header, tokens, payload = read_bundle(
        b.makefile("rb"), allocate=buffers.with_room(buffers.allocate, *importer.receive_room()))
    thread.join()
    received = Received(got_header.kind, tokens, payload, got_header.fingerprint, got_header.meta)
    del payload
    with importer.sequence() as seq:
        importer.import_state(seq, received)
    decode_peak = tracemalloc.get_traced_memory()[1] + buffers.usage.peak - baseline
    tracemalloc.stop()
    kv = len(prefilled.payload)
    exporter.close()
    importer.close()
    return {"kv_bytes": kv, "prefill_peak_copies": round(prefill_peak / kv, 3),
            "decode_peak_copies": round(decode_peak / kv, 3)}


def start_cluster(model: str, threads: int):
    """The prefill server, the decode server (prefix cache on, as deployed) and a second decode
    server with the prefix cache off, for the cold recompute."""
    from disaggregated_inference.ops.cluster import LocalCluster

    data = json.loads((ROOT / "config_current.json").read_text())
    data["models"]["qwen"].update(n_threads=threads, model=model)
    decode = next(s for s in data["decode_servers"] if s["name"] == "local-decode-qwen")
    data["decode_servers"].append(dict(decode, name="local-decode-qwen-cold", prefix_cache=False))
    names = ["local-prefill-qwen", "local-decode-qwen", "local-decode-qwen-cold"]
    cluster = LocalCluster(data, names=names, free_ports=True).start()
    try:
        cluster.wait_healthy(timeout=600)
    except BaseException:
        cluster.stop()
        raise
    return cluster, [cluster.process(name).url for name in names]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    quick.add_argument(parser)
    parser.add_argument("--sizes", type=int, nargs="*", default=[256, 1024, 2048])
    parser.add_argument("--repeat", type=int, default=5, help="handoffs per size (median reported)")
    parser.add_argument("--reprefill-repeat", type=int, default=1,
                        help="runs of each recompute baseline, cold and warm, per size (median)")
    parser.add_argument("--prefill", help="URL of a running SmolLM2 prefill server (default: start one)")
    parser.add_argument("--decode", help="URL of a running SmolLM2 decode server, prefix cache on (default: start one)")
    parser.add_argument("--decode-cold", help="URL of a running SmolLM2 decode server with prefix_cache false, "
                                              "for the cold recompute (default: start one)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="smollm2", help="the model all servers load (started servers only)")
    parser.add_argument("--loopback-mib", type=int, default=256, help="MiB per loopback measurement")
    parser.add_argument("--bulk-mib", type=int, default=64, help="MiB per bulk loopback and memory copy")
    args = parser.parse_args(argv)
    quick.apply(parser, args, sizes=[200, 400], repeat=2, loopback_mib=16, bulk_mib=8)
    if args.quick and args.model == parser.get_default("model"):
        args.model = quick.tiny_model()
    loopback_bytes, bulk_bytes = args.loopback_mib << 20, args.bulk_mib << 20

    cluster = None
    if not (args.prefill and args.decode and args.decode_cold):
        if args.prefill or args.decode or args.decode_cold:
            parser.error("give --prefill, --decode and --decode-cold together, or none to start the servers")
        quick.say(f"starting a prefill server and two decode servers of {Path(args.model).name} ...")
        cluster, (args.prefill, args.decode, args.decode_cold) = start_cluster(args.model, args.threads)
    try:
        http = requests.Session()
        copy_threshold = http.get(f"{args.prefill}/health").json().get("non_temporal_copy_bytes")
        caches = {url: http.get(f"{url}/health").json().get("model_info", {}).get("prefix_cache")
                  for url in (args.decode, args.decode_cold)}
        if caches[args.decode_cold] is not False:
            raise SystemExit(f"{args.decode_cold} must run with prefix_cache false "
                             f"(its /health: {caches[args.decode_cold]})")
        calib = http.post(f"{args.prefill}/prefill", json={"prompt": FILLER * 20 + QUESTION}).json()
        http.delete(calib["kv"]["url"])
        per_repeat = (calib["prompt_tokens"] - 30) / 20
        loopback = [loopback_gbps(loopback_bytes) for _ in range(3)]
        bulk = statistics.median(loopback_bulk_gbps(bulk_bytes) for _ in range(3))
        memory_copy = statistics.median(memory_copy_gbps(bulk_bytes) for _ in range(5))
        warm_up = handoff_run(http, args.prefill, args.decode, prompt_for(64, per_repeat))  # both decode servers
        recompute_run(http, args.decode_cold, warm_up["tokens"], warm_up["fingerprint"])
        results = []
        for size in args.sizes:
            prompt = prompt_for(size, per_repeat)
            quick.say(f"~{size} tokens: {args.repeat} handoffs, then the warm and the cold recompute ...")
            # back to back, as a busy cluster runs them; the first one is reported apart (cold buffers)
            runs = []
            for _ in range(args.repeat):
                runs.append(handoff_run(http, args.prefill, args.decode, prompt, loopback, loopback_bytes))
                runs[-1]["loopback_gbps"] = statistics.mean(loopback[-2:])  # around this handoff
                runs[-1]["handoff_fraction"] = runs[-1]["handoff_gbps"] / runs[-1]["loopback_gbps"]
            tokens, fingerprint = runs[0]["tokens"], runs[0]["fingerprint"]
            # the handoffs left the prompt's KV in a free slot of the decode server: warm
            warm = [recompute_run(http, args.decode, tokens, fingerprint) for _ in range(args.reprefill_repeat)]
            cold = [recompute_run(http, args.decode_cold, tokens, fingerprint) for _ in range(args.reprefill_repeat)]
            if any(r["cached"] or r["recomputed"] != len(tokens) for r in cold):
                raise RuntimeError(f"the cold recompute reused cached KV: {cold}")
            apart = ("fingerprint", "prompt_tokens", "kv_bytes", "tokens", "handoff_recomputed")
            row = {key: statistics.median(r[key] for r in runs) for key in runs[0] if key not in apart}
            row = {"prompt_tokens": runs[0]["prompt_tokens"], "kv_bytes": runs[0]["kv_bytes"], **row,
                   "handoff_recomputed": max(r["handoff_recomputed"] for r in runs),
                   "handoff_gbps_first_run": runs[0]["handoff_gbps"],
                   "reprefill_cold_ttft_s": statistics.median(r["ttft_s"] for r in cold),
                   "reprefill_cold_recomputed": min(r["recomputed"] for r in cold),
                   "reprefill_warm_ttft_s": statistics.median(r["ttft_s"] for r in warm),
                   "reprefill_warm_cached": min(r["cached"] for r in warm),
                   "reprefill_warm_recomputed": max(r["recomputed"] for r in warm),
                   "runs": len(runs), "reprefill_runs": len(cold)}
            row["speedup_vs_cold"] = row["reprefill_cold_ttft_s"] / row["handoff_ttft_s"]
            row["speedup_vs_warm"] = row["reprefill_warm_ttft_s"] / row["handoff_ttft_s"]
            results.append({k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()})
            quick.say(json.dumps(results[-1]))
        memory = measure_memory(max(args.sizes), per_repeat, args.threads, args.model)
    finally:
        if cluster:
            cluster.stop()
    out = {"loopback_gbps": round(statistics.median(loopback), 3), "loopback_bulk_gbps": round(bulk, 3),
           "memory_copy_gbps": round(memory_copy, 3), "results": results, "memory": memory,
           "quick": args.quick, "model": Path(args.model).name if cluster else None,
           "decode_prefix_cache": caches[args.decode],
           "machine": {"cpus": __import__("os").cpu_count(), "threads_per_server": args.threads,
                       "non_temporal_copy_bytes": copy_threshold}}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"loopback: {out['loopback_gbps']} Gb/s (one cache-hot chunk resent), "
              f"{out['loopback_bulk_gbps']} Gb/s (memory to memory); "
              f"memory copy: {out['memory_copy_gbps']} Gb/s")
        for r in results:
            print(f"{r['prompt_tokens']:5d} tokens: handoff TTFT {r['handoff_ttft_s'] * 1000:7.1f} ms; "
                  f"cold recompute {r['reprefill_cold_ttft_s'] * 1000:8.1f} ms ({r['speedup_vs_cold']:6.1f}x), "
                  f"warm recompute {r['reprefill_warm_ttft_s'] * 1000:8.1f} ms ({r['speedup_vs_warm']:5.1f}x; "
                  f"{r['reprefill_warm_cached']} of {r['prompt_tokens']} tokens cached); "
                  f"KV {r['kv_bytes'] / 1e6:6.1f} MB at {r['handoff_gbps']:.2f} Gb/s "
                  f"({r['handoff_fraction']:.0%} of loopback)")
        print(f"memory: {memory}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
