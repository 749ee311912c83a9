"""The handoff canary: a fingerprint of the next-token distribution that proves an imported KV.

A checksum proves that the bytes arrived as they were sent; it cannot prove that they
were right (a state exported from the wrong slot, a buffer reused too early, another
engine's numerics, a state forced through under other RoPE settings). So the prefill side
also evaluates the prompt's last token and puts the top-k of the resulting next-token
distribution in the bundle's header (``meta["canary"]``); the decode side evaluates that
same token on the imported state and compares before it generates anything.

``divergence`` is the largest absolute difference of log-probabilities (natural log)
over the union of both top-k sets:

- an id in the prefill side's top-k: ``|lp_prefill(id) - lp_decode(id)|`` (the decode
  side has the whole distribution);
- an id only in the decode side's top-k: the prefill side's log-probability is unknown
  but at most its k-th ``floor``, so ``max(0, lp_decode(id) - floor)``, a lower bound of
  the true difference.

Log-probabilities rather than logits: a constant shift of every logit (which changes
nothing) leaves them alone. ``top1_match`` says whether both sides' likeliest token is
the same; a near-tie may flip under batching noise, so only ``divergence`` decides.

This module imports nothing of Flask or of any backend; numpy is imported by the
functions that need it (the backends that produce logits have it).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..errors import CanaryMismatch
from ..metrics import ServerFigures

DEFAULT_TOP_K = 8
# Max abs log-prob difference allowed when both sides run the same engine on the same kind of
# device, and otherwise (docs/benchmarks.md, "The canary", for the measurements behind them).
DEFAULT_TOLERANCE = 0.5
DEFAULT_CROSS_TOLERANCE = 1.0
# Same engine, both sides evaluated the canary's token alone in their step, and the backend says
# its restore is bit-exact for this state: anything above rounding is a wrong state.
DEFAULT_EXACT_TOLERANCE = 1e-4


def log_softmax(logits):
    """Natural-log probabilities of a logits vector (float64, numerically stable)."""
    import numpy as np

    x = np.asarray(logits, dtype=np.float64)
    shifted = x - x.max()
    return shifted - np.log(np.exp(shifted).sum())


def fingerprint(logits, k: int, engine: str, alone: bool = False, threads: int | None = None,
                deterministic: bool | str = False) -> dict:
    """The top-``k`` token ids of ``logits`` and their log-probabilities, likeliest first.

    Not rounded: JSON carries a float64 exactly, so identical logits on both sides compare as 0."""
    import numpy as np

    lp = log_softmax(logits)
    k = max(1, min(int(k), lp.shape[0]))
    top = np.argpartition(-lp, k - 1)[:k]
    top = top[np.argsort(-lp[top], kind="stable")]
    out = {"k": k, "ids": [int(i) for i in top], "logprobs": [float(lp[i]) for i in top],
           "engine": engine, "alone": bool(alone)}
    if threads:
        out["threads"] = int(threads)
    if deterministic:
        out["deterministic"] = deterministic if deterministic == "paired" else True
    return out


def _steps(deterministic) -> bool | str:
    """A canary's ``deterministic``: False, True or "paired" (``fingerprint``)."""
    return "paired" if deterministic == "paired" else bool(deterministic)


def compare(sent: dict, logits) -> tuple[bool, float]:
    """``(top1_match, divergence)`` of the decode side's ``logits`` against a prefill ``sent`` canary."""
    import numpy as np

    ids, theirs = list(sent["ids"]), [float(v) for v in sent["logprobs"]]
    if not ids or len(ids) != len(theirs):
        raise CanaryMismatch("the bundle's canary is malformed (ids and logprobs differ in length)", field="kv")
    lp = log_softmax(logits)
    if max(ids) >= lp.shape[0] or min(ids) < 0:
        raise CanaryMismatch("the bundle's canary names token ids beyond this model's vocabulary", field="kv")
    ours = lp[ids]
    divergence = float(np.max(np.abs(ours - np.asarray(theirs))))
    k = len(ids)
    mine = np.argpartition(-lp, k - 1)[:k]
    floor = min(theirs)
    extra = [lp[i] - floor for i in mine if int(i) not in set(ids)]
    if extra:
        divergence = max(divergence, float(max(0.0, max(extra))))
    top1 = int(np.argmax(lp)) == int(ids[0])
    return top1, divergence


@dataclass(frozen=True)
class CanaryPolicy:
    """How a server makes and checks canaries (the ``server`` section's ``canary_*`` keys).

    ``top_k`` 0 turns the canary off on a prefill server. The tolerance of a check is,
    in this order: an explicit ``pairs`` entry for the (prefill engine, decode engine)
    pair, e.g. ``{"prefill": "llama_cpp/gpu", "decode": "llama_cpp/cpu", "tolerance":
    1.0}``; ``exact_tolerance`` when the engines are the same, both sides evaluated the
    token alone in their step (batching moves logits), or both in batch-invariant steps, with the same number of compute
    threads (``threads``: ggml's CPU attention splits one query's cells across its threads
    past a few hundred cells, so a 2-thread prefill and a 1-thread decode of SmolLM2 differ
    by 0.05-0.37 at 300-3,500 tokens; the same count gives 0) and the backend restores this
    state bit for bit (``exact``); ``tolerance`` for the same engine otherwise;
    ``cross_tolerance`` for any other pair.
    """

    top_k: int = DEFAULT_TOP_K
    tolerance: float = DEFAULT_TOLERANCE
    cross_tolerance: float = DEFAULT_CROSS_TOLERANCE
    exact_tolerance: float = DEFAULT_EXACT_TOLERANCE
    pairs: tuple = ()

    @classmethod
    def from_settings(cls, settings) -> "CanaryPolicy":
        return cls(top_k=settings.canary_top_k, tolerance=settings.canary_tolerance,
                   cross_tolerance=settings.canary_cross_tolerance, exact_tolerance=settings.canary_exact_tolerance,
                   pairs=tuple(settings.canary_pairs))

    def tolerance_for(self, prefill_engine: str | None, decode_engine: str, exact: bool = False) -> float:
        for pair in self.pairs:
            if pair.get("prefill") == prefill_engine and pair.get("decode") == decode_engine:
                return float(pair["tolerance"])
        if prefill_engine != decode_engine:
            return self.cross_tolerance
        return self.exact_tolerance if exact else self.tolerance

    def make(self, logits, engine: str, alone: bool = False, threads: int | None = None,
             deterministic: bool | str = False) -> dict | None:
        """The canary of a prefill (None when turned off); ``alone``: its token was computed as in a step
        of its own; ``threads``: the compute threads that evaluated it, where they can change the numerics
        (CPU); ``deterministic``: its step was batch-invariant (computed as alone whatever shared it), or
        ``"paired"``: batch-invariant with paired steps (another computation of the same token)."""
        return fingerprint(logits, self.top_k, engine, alone, threads, deterministic) if self.top_k > 0 else None

    def check(self, sent: dict | None, logits, engine: str, exact: bool = False, threads: int | None = None,
              deterministic: bool | str = False) -> ServerFigures:
        """Compare; the metrics to report, or ``CanaryMismatch`` when beyond tolerance.

        ``exact``: this side evaluated the token alone and its backend restores the state bit for
        bit; it holds only if the prefill side's canary says the same of itself, with the same
        ``threads`` (a canary that names none, or another count, gets the same-engine
        tolerance); and both sides' steps batch-invariant or both not (``deterministic``: a
        batch-invariant step computes even a lone token as it does one among others, which a plain
        step does not; and both paired or both not, ``"paired"``). A bundle without a canary (an older or canary-less prefill server) is
        reported as ``canary: "absent"`` and passes: refusing it would only force a recompute.
        """
        if not sent:
            return ServerFigures(canary="absent")
        started = time.perf_counter()
        top1, divergence = compare(sent, logits)
        exact = (exact and bool(sent.get("alone")) and sent.get("threads") == threads
                 and _steps(sent.get("deterministic")) == _steps(deterministic))
        tolerance = self.tolerance_for(sent.get("engine"), engine, exact)
        figures = {"canary": "passed" if divergence <= tolerance else "failed", "canary_top1_match": top1,
                   "canary_divergence": round(divergence, 6), "canary_tolerance": tolerance,
                   "canary_engines": f"{sent.get('engine')}->{engine}",
                   "canary_check_ms": round((time.perf_counter() - started) * 1000, 3)}
        if divergence > tolerance:
            raise CanaryMismatch(
                f"the imported KV does not reproduce the prefill's next-token distribution: divergence "
                f"{divergence:.4f} > tolerance {tolerance:g} (top-1 {'agrees' if top1 else 'differs'}, "
                f"{figures['canary_engines']})", field="kv", **{k: v for k, v in figures.items() if k != "canary"})
        return ServerFigures(**figures)
