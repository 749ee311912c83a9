"""Speculative decoding: guess the next tokens cheaply, check the guesses in one model step, keep what
the model would have chosen anyway.

A decode step evaluates one token per sequence. With speculation, a sequence's step evaluates its
last token and a **draft** of guessed tokens after it, with logits on every row. The token loop then
samples row by row exactly as it would have sampled step by step, and goes on to the next row while
the token it sampled is the guess that was evaluated after it; the first token that differs ends the
run (it is evaluated in the next step, with a new draft), and the KV cells of the guesses after it
are removed, so the sequence's KV holds exactly the tokens of the answer.

**Exact.** Sampling row *i* with the request's own sampler (grammar, top-k/top-p/temperature,
seeded distribution, or greedy) and keeping guess *x* only when the sampled token is *x* is the
standard speculative-sampling rule for a draft that puts all its probability on *x* (q = one-hot):
*x* is accepted with probability p(x), and on rejection the token sampled instead has probability
p(y) / (1 - p(x)) for y != x, which is the residual distribution norm(max(0, p - q)). So the answer
follows the model's distribution after top-k/top-p/temperature, and every emitted token costs the
same draws of the sampler's random streams, in order, as without speculation (under a grammar, one of
the unconstrained chain's, and one of the grammar chain's when the grammar refuses that draw:
``llama_loop.TokenSampler``): with a seed and the same logits, the same text. The grammar of a JSON
schema advances token by token through the sampler chain and sees only the tokens that were emitted (a row is sampled only once the guess before it
was accepted), so a guess is kept only where the grammar-constrained choice equals it. Stop strings,
end-of-generation tokens, ``max_tokens`` and cancellation are checked per emitted token by the loop,
as without speculation. Greedy text equals the text without speculation as far as the verify step's
logits equal those of one-token steps (docs/benchmarks.md, "Speculative decoding", says how often
they do on this machine's CPU kernels).

**When to draft.** A verify step is not free where the model is compute-bound (2 CPU cores: four
tokens cost 2.2 times one token for SmolLM2), so a guess must be likely to pay. ``PromptLookup``
drafts the tokens that followed the latest earlier occurrence of the longest n-gram ending the
answer so far (prompt and answer), and estimates the chance that each guess is accepted from this
sequence's own record at that match length (a Beta posterior whose prior was measured on the
grader's answers). ``cut_drafts`` then cuts every draft of a step to what maximises the step's
expected tokens per unit of time under ``StepCost`` (measured on the model at load): a batch of
other sequences makes a draft's cost fall on all of them, and llama.cpp evaluates a step whose
sequences carry different token counts as several ubatches, each of which reads the weights again.
So in a step of several sequences, one guess each (one ubatch) can pay where one sequence's draft
(a ubatch of its own) does not: a sequence with no match long enough to draft offers a one-token
guess from a shorter one (a **filler**), and the cut weighs equal lengths for every draft first.
Beside others, what it keeps may not slow any answer of the step (an answer ahead of the others, when none
waits for a slot, by its share only). A sequence whose drafts keep failing stops drafting.

A draft model could implement ``Proposer`` too (out of scope: on this machine's CPU it cannot pay).
"""
from __future__ import annotations

import abc
import statistics
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..errors import BadRequest
from ..metrics import ServerFigures
from .base import Eval

PROPOSERS = ("off", "ngram")


def requested_proposer(name: str | None) -> str | None:
    """A request's ``speculation`` field (``None``: the model's setting), or a ``BadRequest`` naming it."""
    if name is not None and name not in PROPOSERS:
        raise BadRequest(f"'speculation' must be one of {', '.join(PROPOSERS)}, got {name!r}", field="speculation")
    return name

# Chance that a prompt-lookup guess is accepted, given the guess before it was, by the length of the
# match it came from (1, 2, 3, 4, 5 or more tokens): measured with SmolLM2 on the grader's greedy,
# schema-constrained code-analysis answers for the example notebooks (docs/benchmarks.md,
# "Speculative decoding"). Each sequence's own record takes over after a few drafts (PRIOR_WEIGHT).
MATCH_PRIORS = (0.35, 0.65, 0.9, 0.94, 0.94)
PRIOR_WEIGHT = 4.0
GIVE_UP_AFTER = 8  # drafts in a row with no guess accepted: the sequence stops drafting
LAST_TOKEN_ODDS = 0.05  # a free row's guess that nothing matched: the last token again (runs of spaces, digits)
RECORD_WEIGHT = 8.0  # DraftRecord: MATCH_PRIORS count as this many drafts per match length
RECORD_FADE = 0.97  # DraftRecord: each draft of a match length weighs the record before it by this


class DraftRecord:
    """How often a server's recent drafts had their guesses kept, per match length: the odds each new
    sequence's ``PromptLookup`` starts from (``MATCH_PRIORS`` until drafts say otherwise; older drafts fade
    by ``RECORD_FADE`` a draft). A sequence's own record takes over after a few drafts, but a 48-token
    answer has few: with the code-analysis priors, every summary of a report of figures (whose n-grams
    recur with other numbers after them) drafted 25-50 guesses and kept 7-19, and its answer came 10-25%
    slower than without speculation. One server's requests tend to be alike; where they are not, the odds
    sit between, and each sequence's own record still decides after its first drafts."""

    def __init__(self, priors: Sequence[float] = MATCH_PRIORS, weight: float = RECORD_WEIGHT,
                 fade: float = RECORD_FADE):
        self.fade = fade
        self._kept = [weight * p for p in priors]
        self._missed = [weight * (1 - p) for p in priors]

    def odds(self) -> list[float]:
        """The chance that a guess is kept, by match length (1, 2, ...), as ``MATCH_PRIORS``."""
        return [self.odds_at(b) for b in range(len(self._kept))]

    def odds_at(self, bucket: int) -> float:
        """The chance that a guess from a match of ``bucket + 1`` tokens is kept."""
        b = min(bucket, len(self._kept) - 1)
        return self._kept[b] / (self._kept[b] + self._missed[b])

    def add(self, bucket: int, accepted: int, missed: bool) -> None:
        """A draft from a match of ``bucket + 1`` tokens kept ``accepted`` guesses, and ended in a rejected one
        (``missed``) or not."""
        b = min(bucket, len(self._kept) - 1)
        self._kept[b] = self._kept[b] * self.fade + accepted
        self._missed[b] = self._missed[b] * self.fade + missed


@dataclass
class Draft:
    """Guessed tokens, and the chance that each is accepted given that the one before it was."""

    tokens: list
    acceptance: float


class Proposer(abc.ABC):
    """What drafts guesses for one sequence (one instance per request)."""

    speculation = True  # the request asked for speculation: its answer reports the draft figures

    @abc.abstractmethod
    def propose(self, history: Sequence[int]) -> Draft | None:
        """Guesses of the tokens after ``history`` (the prompt and the answer so far; it only grows
        between calls), or None."""

    def feedback(self, accepted: int, drafted: int) -> None:
        """Of the last draft, ``drafted`` guesses were verified and the first ``accepted`` of them kept."""


class PromptLookup(Proposer):
    """Prompt lookup (n-gram) drafts: the tokens after the latest earlier occurrence of the longest
    n-gram (up to ``max_ngram``, at least ``min_match``) that ends the history.

    N-grams are indexed as the history grows (each token once), so a proposal costs a few dictionary
    lookups. The acceptance estimate is per match length and per sequence."""

    def __init__(self, max_draft: int = 8, min_match: int = 1, max_ngram: int = len(MATCH_PRIORS),
                 priors: Sequence[float] = MATCH_PRIORS, weight: float = PRIOR_WEIGHT, free_row: bool = False,
                 record: DraftRecord | None = None, filler: bool = False):
        self.max_draft, self.min_match, self.max_ngram = max_draft, min_match, max(max_ngram, min_match)
        self.record = record  # the server's: its odds are this sequence's priors, and its drafts go in it
        if record is not None:
            priors = record.odds()
        self.free_row = free_row  # a guess of one token whenever nothing else is drafted (see ``propose``)
        self.filler = filler  # a guess of one token from a match under ``min_match`` (see ``propose``)
        self._free = False  # the last proposal was such a guess
        self._after: list[dict] = [{} for _ in range(self.max_ngram)]  # n - 1 -> {n-gram: index after it}
        self._indexed = 0  # n-grams ending before this index are in ``_after``
        priors = list(priors) + [priors[-1]] * (self.max_ngram - len(priors))
        self._own = DraftRecord(priors, weight, fade=1.0)  # this sequence's drafts, on top of the priors
        self._bucket: int | None = None
        self._failures = 0
        self.stopped = False

    def acceptance(self, match: int) -> float:
        return self._own.odds_at(min(match, self.max_ngram) - 1)

    def _index(self, history: Sequence[int]) -> None:
        after, top = self._after, self.max_ngram
        for end in range(self._indexed, len(history) - 1):  # the n-grams ending at ``end``, followed by end + 1
            for n in range(1, min(top, end + 1) + 1):
                after[n - 1][tuple(history[end - n + 1:end + 1])] = end + 1
        self._indexed = max(self._indexed, len(history) - 1)

    def propose(self, history: Sequence[int]) -> Draft | None:
        """Where no match of ``min_match`` tokens drafts, one guess all the same: the token after the latest
        occurrence of the longest shorter match (``filler``, while the sequence drafts, or ``free_row``),
        else the last token again (``free_row``). Such a guess neither stops nor resumes the drafting.

        ``free_row`` is meant for a row the step evaluates anyway: a lone sequence's padding row under
        batch-invariant steps (``cut_drafts``' ``rows``). ``filler`` is meant for a step of several
        sequences: llama.cpp evaluates a step whose sequences carry the same number of tokens as one
        ubatch, and one whose drafts differ as several (``split``), so one guess in every sequence can
        pay where one sequence's draft alone would not (``cut_drafts`` weighs it)."""
        self._index(history)
        size = len(history)
        self._free = False
        if not self.stopped:
            for n in range(min(self.max_ngram, size - 1), self.min_match - 1, -1):
                start = self._after[n - 1].get(tuple(history[size - n:]))
                if start is not None:
                    self._bucket = n - 1
                    return Draft(list(history[start:start + self.max_draft]), self.acceptance(n))
        if not (self.free_row or (self.filler and not self.stopped)) or not size:
            return None
        self._free = True
        for n in range(min(self.min_match - 1, self.max_ngram, size - 1), 0, -1):
            start = self._after[n - 1].get(tuple(history[size - n:]))
            if start is not None:
                self._bucket = n - 1
                return Draft([history[start]], self.acceptance(n))
        if not self.free_row:
            return None
        self._bucket = None
        return Draft([history[-1]], LAST_TOKEN_ODDS)

    def feedback(self, accepted: int, drafted: int) -> None:
        if self._bucket is None or drafted <= 0:
            return
        self._own.add(self._bucket, accepted, accepted < drafted)
        if self.record is not None:
            self.record.add(self._bucket, accepted, accepted < drafted)
        if self._free:  # a guess in a row the step had anyway: it neither stops nor resumes the drafting
            return
        self._failures = 0 if accepted else self._failures + 1
        self.stopped = self._failures >= GIVE_UP_AFTER


class FreeRowGuess(PromptLookup):
    """With speculation off, a one-token guess in a lone sequence's padding row only (``proposer``)."""

    speculation = False

    def __init__(self):
        super().__init__(max_draft=1, min_match=1, free_row=True)


def proposer(kind: str, max_draft: int = 8, min_match: int = 3, free_row: bool = False,
             record: DraftRecord | None = None) -> Proposer | None:
    """The proposer named ``kind`` (one of ``PROPOSERS``); None for ``off``. With ``free_row`` (a step that
    evaluates a lone sequence's token with a padding row: batch-invariant steps), a proposer of one-token
    guesses for ``off`` too, and ``ngram`` guesses a token whenever it has no draft: a guess in that row
    costs nothing, and when it is right the step gives two tokens."""
    if kind == "off":
        return FreeRowGuess() if free_row else None
    if kind == "ngram":
        return PromptLookup(max_draft=max_draft, min_match=min_match, free_row=free_row, record=record, filler=True)
    raise ValueError(f"unknown proposer {kind!r} (known: {', '.join(PROPOSERS)})")


# -- what a step costs ---------------------------------------------------------------------------------


COSTS_KEPT = 1 << 16  # step layouts whose cost a StepCost remembers (a few MB at most)


@dataclass(frozen=True)
class StepCost:
    """Time of one model step: for each ubatch of ``n`` tokens llama.cpp splits it into, ``single`` where
    ``n`` is 1, else ``per_ubatch + per_token * n`` (seconds, or any unit: only ratios are used).
    ``per_ubatch`` is mostly reading the weights, ``per_token`` the arithmetic. A one-row ubatch is apart
    because ggml computes it with matrix-vector products, not the matrix-matrix kernels of two rows or
    more: a line through every size put SmolLM2's one-token step at 1.6 times what it costs on 2 CPU
    cores, so a two-row verify step looked a quarter dearer than a one-token step where it costs twice
    as much, and drafts that lost time looked as if they paid. The default is SmolLM2 with flash
    attention on 2 cores after 64 tokens (one-token step 6.1 ms, 2 rows 11.7, 9 rows 26.1: a k-row step
    costs 1.4 + 0.33 k one-token steps); ``fit`` makes one from timings."""

    per_ubatch: float = 1.4
    per_token: float = 0.33
    single: float | None = 1.0  # None: the line, as for any other size
    # counts -> cost: ``cut_drafts`` weighs some fifty layouts a step, most of them seen at earlier steps (the
    # same slots, drafts of up to ``draft_max``); working each out again took 200-250 us a step on SmolLM2 at
    # 8 at once on 2 cores, 1% of the step
    _costs: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def fit(cls, timings: dict[int, list[float]]) -> "StepCost":
        """Least squares through the median time of each step size of two tokens or more
        (``{tokens: [seconds, ...]}``), and the one-token step's own median; through every size where
        fewer than two sizes have two tokens or more."""
        points = [(n, statistics.median(ts)) for n, ts in sorted(timings.items()) if ts]
        if len(points) < 2:
            raise ValueError("a step cost needs timings of two step sizes or more")
        single = next((t for n, t in points if n == 1), None)
        rows = [(n, t) for n, t in points if n > 1]
        if len(rows) < 2:
            rows, single = points, None
        mx = statistics.fmean(n for n, _ in rows)
        my = statistics.fmean(t for _, t in rows)
        sxx = sum((n - mx) ** 2 for n, _ in rows)
        slope = sum((n - mx) * (t - my) for n, t in rows) / sxx
        one = points[0][1] / points[0][0]  # a floor: no step is cheaper per token than a tiny share of the first
        slope = max(slope, 0.02 * one)
        return cls(per_ubatch=max(my - slope * mx, 0.0), per_token=slope, single=single)

    def of(self, counts: Sequence[tuple[int, int]], n_ubatch: int = 512, padded: bool = False) -> float:
        """Cost of a step that evaluates ``counts``: (sequence id, tokens) in ascending id order. ``padded``:
        batch-invariant steps, where no ubatch is computed with one row (``Slots._pads``)."""
        key = (tuple(counts), n_ubatch, padded)
        cost = self._costs.get(key)
        if cost is None:
            if len(self._costs) >= COSTS_KEPT:
                self._costs.clear()
            cost = self._costs[key] = sum(self.single if n == 1 and self.single is not None and not padded
                                          else self.per_ubatch + self.per_token * max(n, 2 if padded else 1)
                                          for n in ubatches(counts, n_ubatch))
        return cost

    def as_dict(self) -> dict:
        return {"per_ubatch": self.per_ubatch, "per_token": self.per_token, "single": self.single}

    def __str__(self) -> str:
        one = f"{self.single * 1000:.2f} ms for one token, " if self.single is not None else ""
        return f"{one}{self.per_ubatch * 1000:.2f} ms per ubatch + {self.per_token * 1000:.2f} ms per token"


def ubatches(counts: Sequence[tuple[int, int]], n_ubatch: int = 512) -> list[int]:
    """Tokens in each ubatch llama.cpp makes of a step with a KV stream per sequence (``split``)."""
    return [sum(n for _, n in ubatch) for ubatch in split(counts, n_ubatch)]


def split(counts: Sequence[tuple[int, int]], n_ubatch: int = 512) -> list[list[tuple[int, int]]]:
    """The ubatches llama.cpp makes of a step that evaluates ``counts`` ((sequence id, tokens), ascending ids)
    with a KV stream per sequence, each as (sequence id, tokens) (``llama_batch_allocr::split_equal(n_ubatch,
    sequential=true)``): each ubatch takes sequences of consecutive ids, the same number of tokens from each,
    as many as all of them still have."""
    left = [[seq, n] for seq, n in counts if n > 0]
    out = []
    while left:
        group = [left[0]]
        for item in left[1:]:
            if item[0] != group[-1][0] + 1 or len(group) >= n_ubatch:
                break
            group.append(item)
        take = max(1, min(min(n for _, n in group), n_ubatch // len(group)))
        for item in group:
            item[1] -= take
        out.append([(seq, take) for seq, _ in group])
        left = [item for item in left if item[1] > 0]
    return out


def expected_tokens(acceptance: float, guesses: int) -> float:
    """Tokens a step emits for a sequence that verifies ``guesses``: its own, and each guess while every
    guess before it was accepted (1 + a + a^2 + ... + a^k)."""
    total, term = 1.0, 1.0
    for _ in range(guesses):
        term *= acceptance
        total += term
    return total


def cut_drafts(evals: list, cost: StepCost, n_ubatch: int = 512, rows: int = 1, padded: bool = False,
               drain: bool = False) -> None:
    """Cut the drafts of one step (``Eval``\\ s whose ``draft_acceptance`` is set: ``tokens[1:]`` are
    guesses) to the lengths that maximise the step's expected emitted tokens per unit of time (``worth``),
    one sequence at a time while that gains. ``tokens`` and ``draft_acceptance`` are changed in place (a
    draft cut to nothing becomes a plain one-token step). ``rows``: the fewest rows a sequence's step
    evaluates (2: a lone sequence's padding row under batch-invariant steps, which a guess may take);
    ``padded``: batch-invariant steps (``StepCost.of``); ``drain``: no request waits for a slot.

    **No answer slower.** Beside other sequences, the drafts the search keeps must not slow any answer of the step:
    each must expect at least as many tokens per unit of time as in the step without guesses (drained, its share of
    them: an answer ahead of the others may slow down to keep in step with them). Else every draft is cut to one
    length, the longest that slows none, or to nothing. A draft the search keeps pays in its own step, but an answer
    whose text does not repeat drafts little and pays the time of every verify step it shares (SmolLM2, 2 cores, 4
    slots: four single tokens 24 ms, one of them with 8 guesses 62 ms). It ends late, and a wave of answers ends with
    it, in steps of fewer sequences: in benchmarks/draft_steps.py (peer.py's decode-bound 8 at once, 4 rounds)
    179-258 such steps at 7.2-8.4 ms a token against 6.2-6.7 for every step without speculation, and the steps'
    shape changed 498-566 times against 39-42 (llama.cpp builds its compute graph again for a new shape), so that
    the drafts' steps took 0.5% less to 1.8% more time than speculation off. With this rule: 16 short steps, 109
    changes of shape, and 2.6% less time in steps than speculation off. The grader's code requests at 8 at once
    kept their gain (benchmarks/speculative.py: 1.74x of speculation off, 1.72x without the rule)."""
    drafted = [ev for ev in evals if ev.draft_acceptance is not None]
    if not drafted:
        return
    worth = shares(evals) if drain else {}
    singles = [ev for ev in evals if ev.draft_acceptance is None and ev.logits and len(ev.tokens) - ev.done == 1]
    emitting = sum(worth.get(id(ev), 1.0) for ev in singles)
    # the step's (sequence, tokens) in id order, a drafted sequence's tokens left to the choice; and what each
    # draft length of a drafted sequence is worth: computed once, as the search weighs hundreds of choices
    order = sorted(evals, key=lambda ev: ev.seq)
    gains = {id(ev): [worth.get(id(ev), 1.0) * expected_tokens(ev.draft_acceptance, k) for k in range(len(ev.tokens))]
             for ev in drafted}

    def step_cost(choice: dict) -> float:
        counts = [(ev.seq, max(rows, 1 + choice[id(ev)]) if id(ev) in gains else len(ev.tokens) - ev.done)
                  for ev in order]
        return cost.of(counts, n_ubatch, padded)

    def value(choice: dict) -> float:
        return (emitting + sum(gains[key][k] for key, k in choice.items())) / step_cost(choice)

    def slows_no_answer(choice: dict, plain: float) -> bool:
        # each answer expects, per unit of time, at least its share of the tokens it gets in the step without guesses
        # (``plain``: that step's cost)
        ratio = step_cost(choice) / plain
        return (all(worth.get(id(ev), 1.0) * ratio <= 1.0 for ev in singles)
                and all(worth.get(id(ev), 1.0) * ratio <= expected_tokens(ev.draft_acceptance, choice[id(ev)])
                        for ev in drafted))

    # start from the best of no guesses and every draft cut to the same length: sequences that carry the same
    # number of tokens are one ubatch, so one guess each can pay where one more guess in any one of them,
    # which costs a ubatch of its own, does not (SmolLM2, 2 cores: 4 sequences with a guess each 23.6 ms,
    # without 16.8, one with 8 guesses and 3 without 40.1)
    keep, best = {id(ev): 0 for ev in drafted}, 0.0
    for k in range(max(len(ev.tokens) for ev in drafted)):
        trial = {id(ev): min(k, len(ev.tokens) - 1) for ev in drafted}
        v = value(trial)
        if v > best * (1 + 1e-9):
            keep, best = trial, v
    while True:
        found = None
        for ev in drafted:
            for k in range(len(ev.tokens)):  # 0 .. guesses
                if k == keep[id(ev)]:
                    continue
                trial = {**keep, id(ev): k}
                v = value(trial)
                if v > best * (1 + 1e-9):
                    best, found = v, trial
        if found is None:
            break
        keep = found
    longest = max(keep.values())
    if len(evals) > 1 and longest:  # beside others, and some guess kept (without one, the step is the plain one)
        plain = step_cost(dict.fromkeys(keep, 0))
        if not slows_no_answer(keep, plain):  # the same length for every draft, as long as one slows none
            keep = next((trial for k in range(longest - 1, 0, -1)
                         if slows_no_answer(trial := {key: min(k, n) for key, n in keep.items()}, plain)),
                        dict.fromkeys(keep, 0))
    for ev in drafted:
        k = keep[id(ev)]
        del ev.tokens[1 + k:]
        if k == 0:
            ev.draft_acceptance = None


def shares(evals: list) -> dict:
    """What a token of each answer in a step is worth when no request waits for a slot (``id(ev)``: its share,
    ``Eval.left`` over the most any answer of the step has left; answers without ``left`` are worth 1).

    Then the step's answers are all the work there is, and the one with most left decides when it ends:
    every step evaluates it, and a token gained by an answer ahead of it only makes that answer wait
    beside it. Counting every token alike, the answers whose text repeats drafted on and finished early,
    and the rest ran on alone in steps of one or two tokens each, which cost almost what a step of all
    eight did (benchmarks/speculative.py, plain steps, 8 slots, decode-bound 8 at once: 189 steps
    against 194 without drafts, 6% more rows, 0.93x the speed). Worth in proportion to what is left,
    an answer that gets ahead drafts less until the others catch up, and drafts the same length as
    theirs (one ubatch, ``split``) pay while they keep in step."""
    most = max((ev.left for ev in evals if ev.left), default=0)
    return {id(ev): ev.left / most for ev in evals if ev.left} if most else {}


# -- one sequence in the token loop --------------------------------------------------------------------


class Lookahead:
    """One request's steps in the token loop, with or without speculation: what the next step
    evaluates (``step``) and which row the loop samples next (``row``).

    The loop samples ``row`` and tells ``sampled`` the token: True when it was the guess evaluated
    after the previous row (its KV is in place, and the next ``row`` is ready without a step);
    otherwise the guesses after it are dropped and the loop asks ``step`` for the next step.
    ``drop_cells(seq, pos)`` removes the sequence's KV from position ``pos`` on. ``history`` is what
    the sequence's KV holds, prompt and answer, in order (what the proposer drafts from)."""

    def __init__(self, seq: int, history: Sequence[int], proposer: Proposer | None,
                 drop_cells: Callable[[int, int], None]):
        self.seq, self.proposer, self.drop_cells = seq, proposer, drop_cells
        self.history = list(history[:-1])
        self.ev = None
        self._at = 0  # the row of ``ev`` the loop samples next
        self._settled = True
        self.drafted = self.accepted = 0
        self._last = history[-1]

    def first(self, evaluated=None):
        """The first step: the prompt's last token (never with a draft: the handoff's canary reads its row), or
        ``evaluated``, that step already taken."""
        if evaluated is not None:
            self.history.append(self._last)
            self.ev, self._at, self._settled = evaluated, 0, True
            return evaluated
        return self.step([self._last], None, draft=False)

    @property
    def pos(self) -> int:
        """Where the next evaluated token goes: the answer's KV ends before it."""
        return len(self.history)

    @property
    def row(self) -> int:
        """The batch row whose logits give the next token."""
        return self.ev.row_of(len(self.ev.tokens) - 1 - self._guesses_left())

    def _guesses_left(self) -> int:
        if self.ev is None or self.ev.draft_acceptance is None:
            return 0
        return len(self.ev.tokens) - 1 - self._at

    def sampled(self, token: int) -> bool:
        """The loop sampled ``token`` from ``row``; True when it was the next guess (its KV stays, the next row
        is ready). Otherwise the guesses still unread are dropped, and the token waits for ``step``."""
        left = self._guesses_left()
        if left and self.ev.tokens[1 + self._at] == token:
            self._at += 1
            self.accepted += 1
            self.history.append(token)
            return True
        self._drop_unread()
        return False

    def unkeep(self) -> None:
        """The token ``sampled`` just kept is not part of the answer after all (the chat format replaced it
        with text): its cell, and the guesses after it, go."""
        self._at -= 1
        self.accepted -= 1
        self.history.pop()
        self.drop_cells(self.seq, self.pos)
        self._settle()

    def _drop_unread(self) -> None:
        if self._guesses_left():
            self.drop_cells(self.seq, self.pos)  # the guesses after the last kept token: not the answer
        self._settle()

    def _settle(self) -> None:
        if not self._settled:
            self._settled = True
            guesses = len(self.ev.tokens) - 1
            self.drafted += guesses
            if self.proposer is not None:
                self.proposer.feedback(self._at, guesses)
        self._at = 0
        if self.ev is not None:
            self.ev.draft_acceptance = None  # read no further rows of it as guesses

    def step(self, tokens: list, room: int | None, draft: bool = True):
        """The next step: ``tokens`` (the sampled token, text the format feeds, or both; none where only the
        logits of the last row are wanted), and with ``draft`` a draft of at most ``room - 1`` guesses after
        them (``room``: the tokens the answer may still have, the step's ``Eval.left``; None: the prompt's
        last token, before the answer's budget is reckoned)."""
        self._drop_unread()
        tokens, acceptance = list(tokens), None
        pos = self.pos
        self.history.extend(tokens)
        if draft and tokens and self.proposer is not None and room is not None and room > 1:
            proposal = self.proposer.propose(self.history)
            if proposal is not None and proposal.tokens:
                tokens += proposal.tokens[:room - 1]
                acceptance = proposal.acceptance
        self.ev = Eval(self.seq, tokens, pos, draft_acceptance=acceptance, left=room)
        self._at, self._settled = 0, acceptance is None
        return self.ev

    def finish(self) -> ServerFigures:
        """The request's speculation figures (a draft in flight counted as verified)."""
        if self.ev is not None and self.ev.complete:
            self._settle()
        return ServerFigures(draft_tokens=self.drafted, accepted_tokens=self.accepted)
