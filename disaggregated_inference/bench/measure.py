"""Serving metrics as ``vllm bench serve`` defines them, so that our figures sit beside vLLM's or SGLang's.

Every time is taken on the client's clock, per streamed request (``time_stream``):

- **TTFT** (time to first token): from sending the request to the arrival of its first streamed piece;
- **ITL** (inter-token latency): the gaps between successive streamed pieces of one request; the
  statistics run over every gap of every request (one piece may carry several tokens, as in vLLM);
- **E2EL** (end-to-end latency): from sending the request to the arrival of its last line (our
  final line carries the usage, as vLLM's last chunk does);
- **TPOT** (time per output token, first token excluded): ``(E2EL - TTFT) / (output tokens - 1)``
  for a request of more than one output token; output tokens are the server's own count
  (``completion_tokens``, as vLLM takes ``usage.completion_tokens``);
- **goodput**: completed requests per second of the run's duration whose every given SLO holds
  (``ttft``, ``tpot``, ``e2el`` in milliseconds, each ``metric <= SLO``; a request of one output
  token counts as TPOT 0, as vLLM counts it), as ``vllm bench serve --goodput`` reports it.

``summarize`` names its figures as vLLM's result JSON does (``mean_ttft_ms``, ``median_ttft_ms``,
``p99_ttft_ms``, ``std_ttft_ms``, ..., ``request_throughput``, ``request_goodput``), with numpy's
(linear) percentile. Where vLLM reports 0 for a statistic with no sample (TPOT of one-token
answers, no streamed gap), this reports null.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

SLO_NAMES = ("ttft", "tpot", "e2el")
METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestTiming:
    """One request's clock readings (``time.perf_counter`` seconds) and the server's token counts."""

    started: float
    pieces: list[float] = field(default_factory=list)  # arrival of each streamed piece
    ended: float | None = None  # arrival of the last line
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None
    metrics: dict = field(default_factory=dict)  # what the client reported for the request

    @property
    def ok(self) -> bool:
        return self.error is None and self.ended is not None and bool(self.pieces)

    @property
    def ttft(self) -> float:
        return self.pieces[0] - self.started

    @property
    def e2el(self) -> float:
        return self.ended - self.started

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.pieces, self.pieces[1:])]

    @property
    def tpot(self) -> float | None:
        """(E2EL - TTFT) / (output tokens - 1); None for a request of one output token or none."""
        if self.output_tokens <= 1:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    def as_dict(self) -> dict:
        """The request's figures in milliseconds (``--detailed`` output)."""
        ms = lambda s: None if s is None else round(s * 1000, 3)  # noqa: E731
        if not self.ok:
            return {"ok": False, "error": self.error}
        return {"ok": True, "ttft_ms": ms(self.ttft), "tpot_ms": ms(self.tpot), "e2el_ms": ms(self.e2el),
                "itl_ms": [ms(g) for g in self.itl], "output_tokens": self.output_tokens,
                "prompt_tokens": self.prompt_tokens}


def time_stream(events, started: float | None = None, cut=None) -> RequestTiming:
    """Time one streamed request: ``events`` yields text pieces (str) and ends with the metrics dict,
    as ``DisaggregatedClient.stream`` does. An exception is recorded in the timing, never lost.
    ``cut()``, if given, is asked after each piece: a reason (str) ends the stream there, as failed."""
    timing = RequestTiming(started=time.perf_counter() if started is None else started)
    try:
        for event in events:
            now = time.perf_counter()
            reason = cut() if cut is not None else None
            if reason:
                timing.error = reason
                getattr(events, "close", lambda: None)()
                break
            if isinstance(event, dict):
                timing.ended, timing.metrics = now, event
                timing.output_tokens = int(event.get("completion_tokens") or 0)
                timing.prompt_tokens = int(event.get("prompt_tokens") or 0)
            else:
                timing.pieces.append(now)
    except Exception as exc:  # noqa: BLE001 - counted as a failed request, as vLLM does
        timing.error = f"{type(exc).__name__}: {exc}"
    if timing.error is None and timing.ended is None:
        timing.error = "the stream ended without its final line"
    elif timing.error is None and not timing.pieces:
        timing.error = "no piece streamed before the final line"
    return timing


def handoff_parts(metrics: dict) -> dict:
    """A request's handoff, from the metrics the client returned: ``method``, and the seconds of its parts:
    ``prefill_s`` (on the prefill server), ``kv_transfer_s`` (the pull; streamed, the part left after the
    prefill: ``kv_exposed_time``) and ``decode_s`` (on the decode server). None where the endpoint does not say."""
    transfer = metrics.get("kv_exposed_time") if metrics.get("handoff_mode") == "streamed" else None
    if transfer is None:
        transfer = metrics.get("kv_transfer_time")
    return {"method": metrics.get("method"), "prefill_s": metrics.get("prefill_time"),
            "kv_transfer_s": transfer, "decode_s": metrics.get("decode_time"),
            "handoff_mode": metrics.get("handoff_mode")}


def parse_slo(text: str) -> tuple[str, float]:
    """``ttft:2000`` or ``ttft=2000`` (milliseconds) -> ("ttft", 2000.0); argparse ``type``."""
    for sep in (":", "="):
        if sep in text:
            name, _, value = text.partition(sep)
            break
    else:
        raise argparse.ArgumentTypeError(f"an SLO is NAME:MILLISECONDS (NAME one of {', '.join(SLO_NAMES)}), "
                                         f"not {text!r}")
    name = name.strip().lower()
    if name not in SLO_NAMES:
        raise argparse.ArgumentTypeError(f"unknown SLO {name!r}: one of {', '.join(SLO_NAMES)}")
    try:
        ms = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"SLO {name}: {value!r} is not a number of milliseconds") from None
    if not ms >= 0:
        raise argparse.ArgumentTypeError(f"SLO {name}: {ms:g} ms, must be non-negative")
    return name, ms


def add_slo_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--slo", action="append", type=parse_slo, default=[], metavar="NAME:MS",
                        help="a service-level objective for goodput, repeatable: ttft, tpot or e2el in "
                             "milliseconds (e.g. --slo ttft:2000 --slo tpot:100; vllm bench serve's --goodput)")


def meets(timing: RequestTiming, slos: dict[str, float]) -> bool:
    """Whether a completed request meets every SLO (milliseconds); TPOT of a one-token answer is 0."""
    values = {"ttft": timing.ttft, "tpot": timing.tpot or 0.0, "e2el": timing.e2el}
    return all(values[name] * 1000 <= limit for name, limit in slos.items())


def _stats(name: str, seconds: list[float], percentiles) -> dict:
    import numpy as np

    if not seconds:
        return {f"{s}_{name}_ms": None for s in ("mean", "median", "std")} | {
            f"p{p:g}_{name}_ms": None for p in percentiles}
    ms = np.asarray(seconds, dtype=float) * 1000
    out = {f"mean_{name}_ms": float(np.mean(ms)), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(np.std(ms))}
    out.update({f"p{p:g}_{name}_ms": float(np.percentile(ms, p)) for p in percentiles})
    return out


def summarize(timings: list[RequestTiming], duration_s: float, slos: dict[str, float] | None = None,
              percentiles=(99,)) -> dict:
    """The run's figures under vLLM's names: counts, throughputs over ``duration_s`` (the run's wall
    time), goodput at ``slos`` (null without SLOs), and mean/median/std/percentiles of each metric."""
    done = [t for t in timings if t.ok]
    tokens_out = sum(t.output_tokens for t in done)
    tokens_in = sum(t.prompt_tokens for t in done)
    slos = dict(slos or {})
    good = sum(1 for t in done if meets(t, slos)) if slos else None
    out = {
        "completed": len(done), "failed": len(timings) - len(done), "duration": duration_s,
        "total_input_tokens": tokens_in, "total_output_tokens": tokens_out,
        "request_throughput": len(done) / duration_s,
        "output_throughput": tokens_out / duration_s,
        "total_token_throughput": (tokens_in + tokens_out) / duration_s,
        "slo_ms": slos or None, "good_requests": good,
        "request_goodput": None if good is None else good / duration_s,
    }
    samples = {"ttft": [t.ttft for t in done], "tpot": [t.tpot for t in done if t.tpot is not None],
               "itl": [g for t in done for g in t.itl], "e2el": [t.e2el for t in done]}
    for name in METRICS:
        out.update(_stats(name, samples[name], percentiles))
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}
