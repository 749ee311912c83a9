"""Speculative decoding (backends/speculate.py) in the llama.cpp token loop, in process on the tiny llama.

The proposer's and the step-cost model's arithmetic first; then the token loop itself, driven by an
``Oracle`` proposer that drafts the answer the model gives without speculation (from a first run),
with wrong guesses where a test wants rejections: every path of the loop (accepted runs, rejected
guesses whose cells are removed, an end-of-generation token, a stop string and ``max_tokens``
inside an accepted run, cancellation mid-verification, a batch of sequences verifying together)
is taken on purpose, not left to what prompt lookup happens to find. The step cost is set so that
every draft is verified whole (``cut_drafts`` is tested on its own; beside an answer that does not draft, where
it would cut them, a test turns it off). Through real servers:
tests/test_speculation_e2e.py.
"""
from __future__ import annotations

import pytest

from disaggregated_inference.backends import ModelSettings, create, llama_slots
from disaggregated_inference.backends.base import Eval, Prompt, Sampling
from disaggregated_inference.backends.speculate import (GIVE_UP_AFTER, MATCH_PRIORS, Draft, DraftRecord, Proposer,
                                                        PromptLookup, StepCost, cut_drafts, expected_tokens, shares, split,
                                                        ubatches)

from .conftest import tiny_model_settings

PROMPT = Prompt(text="one two three four five six seven eight nine ten " * 6)
OTHER = Prompt(text="Revenue by region rose four percent in the north; returns fell. " * 4 + "Summarise.")
SCHEMA = {"type": "object", "properties": {"region": {"type": "string", "maxLength": 12},
                                           "score": {"type": "integer"}}, "required": ["region", "score"]}
FREE = StepCost(per_ubatch=1.0, per_token=0.001)  # drafts are nearly free: every draft is verified whole


# -- the proposer and the cost model --------------------------------------------------------------------


def test_prompt_lookup_drafts_what_followed_the_longest_match():
    p = PromptLookup(max_draft=4, min_match=1)
    history = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    draft = p.propose(history)
    # "1 2 3" occurred once, followed by 4 5 9 2 ("2 3" last occurred followed by 7: the longer match wins)
    assert draft.tokens == [4, 5, 9, 2]
    assert 0 < draft.acceptance < 1
    assert p.propose([5, 6]) is None or p.propose([5, 6]).tokens != []  # a new history is only appended to


def test_prompt_lookup_learns_from_feedback_and_gives_up():
    p = PromptLookup(max_draft=4, min_match=1)
    history = [1, 2, 3, 1, 2]
    first = p.propose(history).acceptance
    p.feedback(4, 4)
    assert p.propose(history + [3]).acceptance > first  # accepted guesses raise the estimate
    for _ in range(GIVE_UP_AFTER):
        assert p.propose(history) is not None
        p.feedback(0, 3)
    assert p.stopped and p.propose(history) is None


def test_prompt_lookup_respects_the_minimum_match():
    assert PromptLookup(min_match=3).propose([1, 2, 9, 1, 2]) is None  # only a 2-token match
    assert PromptLookup(min_match=2).propose([1, 2, 9, 1, 2]).tokens == [9, 1, 2]


def test_a_free_row_gets_a_guess_where_no_draft_matches():
    """``free_row``: a lone sequence's padding row (deterministic steps) takes a one-token guess whenever the
    n-gram drafts have none: the successor of a shorter match, else the last token again. Its misses
    never stop the real drafts."""
    p = PromptLookup(max_draft=4, min_match=3, free_row=True)
    assert p.propose([1, 2, 9, 1, 2]).tokens == [9]  # a 2-token match, under min_match: one guess of it
    assert p.propose([1, 2, 9, 1, 2, 5]).tokens == [5]  # nothing matches: the last token again
    for _ in range(2 * GIVE_UP_AFTER):
        p.propose([1, 2, 9, 1, 2, 5, 7])
        p.feedback(0, 1)
    assert not p.stopped and p.propose([1, 2, 9, 1, 2, 5, 7, 1, 2, 9]).tokens == [1, 2, 5, 7]
    assert PromptLookup(min_match=3).propose([1, 2, 9, 1, 2, 5]) is None  # without it: no draft


def test_a_filler_guesses_from_a_shorter_match_while_the_sequence_drafts():
    """``filler`` (``ngram``'s proposer): where no match of ``min_match`` tokens drafts, one guess from the
    longest shorter match, for ``cut_drafts`` to weigh in a step of several sequences. No match at all: no
    guess (the last token again is for a free row only). Its misses never stop the real drafts, and a
    sequence that stopped drafting offers none."""
    p = PromptLookup(max_draft=4, min_match=3, filler=True)
    draft = p.propose([1, 2, 9, 1, 2])
    assert draft.tokens == [9] and draft.acceptance == pytest.approx(MATCH_PRIORS[1])  # a 2-token match's odds
    assert p.propose([1, 2, 9, 1, 2, 5]) is None  # nothing matches
    for _ in range(2 * GIVE_UP_AFTER):
        p.propose([1, 2, 9, 1, 2, 5, 7, 2])
        p.feedback(0, 1)
    assert not p.stopped and p.propose([1, 2, 9, 1, 2, 5, 7, 2, 1, 2, 9]).tokens == [1, 2, 5, 7]
    for _ in range(GIVE_UP_AFTER):
        p.propose([1, 2, 9, 1, 2, 5, 7, 2, 1, 2, 9])
        p.feedback(0, 4)
    assert p.stopped and p.propose([1, 2, 9, 1, 2, 5, 7, 2, 1, 2, 9, 1]) is None
    assert PromptLookup(min_match=3).propose([1, 2, 9, 1, 2]) is None  # without it: no draft


def test_cut_drafts_gives_every_sequence_of_a_step_a_guess_where_one_ubatch_of_them_pays():
    """Sequences that carry the same number of tokens are one ubatch; a draft longer than the others makes
    a ubatch of its own. So one guess in each of four sequences pays at odds where one more guess in any
    one of them alone does not: a search that adds guesses one sequence at a time never finds it."""
    cost = StepCost.fit({1: [6.28], 2: [11.6], 4: [17.0], 9: [26.96]})  # SmolLM2, 2 cores (ms)
    four = [Eval(s, [7, 1, 2, 3], 10, draft_acceptance=0.6) for s in range(4)]
    cut_drafts(four, cost)
    assert [len(ev.tokens) for ev in four] == [2, 2, 2, 2]  # 4 x 1.6 tokens for 25.0 ms against 4 for 16.4
    one = [Eval(0, [7, 1, 2, 3], 10, draft_acceptance=0.6)] + [Eval(s, [5], 10) for s in range(1, 4)]
    cut_drafts(one, cost)
    assert [len(ev.tokens) for ev in one] == [1, 1, 1, 1]  # its guesses would be a second ubatch
    weak = [Eval(s, [7, 1, 2, 3], 10, draft_acceptance=0.3) for s in range(4)]
    cut_drafts(weak, cost)
    assert all(ev.tokens == [7] and ev.draft_acceptance is None for ev in weak)
    mixed = [Eval(s, [7, 1, 2, 3], 10, draft_acceptance=0.95) for s in range(3)] + [Eval(3, [5], 10)]
    cut_drafts(mixed, cost)
    # three guesses in each of three would pay for the step, but the fourth answer's token would take 2.6 times as
    # long: no answer is slowed (next test), so none drafts
    assert [len(ev.tokens) for ev in mixed] == [1, 1, 1, 1]


def test_cut_drafts_slows_no_answer_of_the_step():
    """Beside others, a step's drafts may not slow any answer: each expects at least the tokens per unit of time it
    gets without guesses (draining, its share of them). Else every draft is cut to the longest single length that
    slows none, or to nothing. An answer whose text does not repeat drafts little; slowed by the others' verify
    steps it would end late, and a wave of answers ends with it (benchmarks/draft_steps.py)."""
    cost = StepCost.fit({1: [6.28], 2: [11.6], 4: [17.0], 9: [26.96]})  # SmolLM2, 2 cores (ms)
    plain = cost.of([(s, 1) for s in range(4)])
    evals = [Eval(s, [7, 1, 2, 3, 4], 10, draft_acceptance=0.95) for s in range(3)]
    evals.append(Eval(3, [7, 1, 2, 3, 4], 10, draft_acceptance=0.7))
    cut_drafts(evals, cost)
    assert [len(ev.tokens) for ev in evals] == [3, 3, 3, 3]  # two guesses each: the weakest draft still keeps up
    assert expected_tokens(0.7, 2) >= cost.of([(s, 3) for s in range(4)]) / plain
    assert expected_tokens(0.7, 3) < cost.of([(s, 4) for s in range(4)]) / plain  # three would slow it

    def laggard(drain: bool) -> int:
        behind = Eval(0, [7, 1, 2, 3], 10, draft_acceptance=0.9, left=192)
        ahead = Eval(1, [5], 10, left=40)
        cut_drafts([behind, ahead], cost, drain=drain)
        return len(behind.tokens) - 1

    assert laggard(drain=False) == 0  # a request waits: the answer ahead ends as soon as it can, for its slot
    assert laggard(drain=True) == 3  # draining: it is ahead by 152 tokens, and may slow down to keep in step


def test_with_no_request_waiting_an_answer_ahead_of_the_others_drafts_less():
    """Draining (no request waits for a slot), the answer with most left decides when the step's answers
    are all done: a token of one far ahead is worth its share of what is left (``shares``), and its draft,
    which pays where every token counts alike, no longer does. Ids 0 and 2: a ubatch each (``split``)."""
    cost = StepCost.fit({1: [6.28], 2: [11.6], 4: [17.0], 9: [26.96]})  # SmolLM2, 2 cores (ms)

    def step(drain: bool) -> list[int]:
        behind = Eval(0, [7, 1, 2, 3], 10, draft_acceptance=0.9, left=192)
        ahead = Eval(2, [7, 1, 2, 3], 10, draft_acceptance=0.9, left=20)
        cut_drafts([behind, ahead], cost, drain=drain)
        return [len(behind.tokens), len(ahead.tokens)]

    assert step(drain=False) == [4, 4]
    assert step(drain=True) == [4, 1]
    evals = [Eval(0, [7], 10, left=40), Eval(1, [7], 10, left=160), Eval(3, list(range(20)), 0, logits=False)]
    assert [round(w, 2) for w in shares(evals).values()] == [0.25, 1.0]  # a prompt's chunk has no share


def test_cut_drafts_keeps_a_guess_in_a_row_the_step_pays_for_anyway():
    cost = StepCost(per_ubatch=0.6, per_token=0.4)
    padded = Eval(0, [7, 1], 10, draft_acceptance=0.1)
    cut_drafts([padded], cost, rows=2)
    assert padded.tokens == [7, 1] and padded.draft_acceptance == 0.1
    unpadded = Eval(0, [7, 1], 10, draft_acceptance=0.1)
    cut_drafts([unpadded], cost)
    assert unpadded.tokens == [7] and unpadded.draft_acceptance is None


def test_a_lone_paired_step_counts_a_guess_in_a_throwaway_row_without_logits_as_a_row_with_logits():
    """Paired steps whose throwaway rows skip the output matrix (``_lone_exact``): a lone single's step is the
    step cost's one-token step (measured paired at load), and a guess makes it two rows with logits. A guess the
    sequence is unlikely to keep is cut; one it is likely to keep still pays. Beside others, and where the
    throwaway row has logits, a guess takes a row the step pays for anyway."""
    from types import SimpleNamespace

    from disaggregated_inference.backends.llama_slots import Slots

    def layout(evals, paired=True, lone_exact=True, free_row=True):
        slots = SimpleNamespace(settings=SimpleNamespace(deterministic=True), _paired=paired,
                                _lone_exact=lone_exact, _free_row=free_row)
        return Slots._draft_layout(slots, evals)

    cost = StepCost(per_ubatch=1.4, per_token=0.33, single=1.25)  # a row and a throwaway row: 1.25 one-row steps
    for acceptance, kept in ((0.3, [7]), (0.9, [7, 1])):
        ev = Eval(0, [7, 1], 10, draft_acceptance=acceptance)
        rows, padded = layout([ev])
        assert (rows, padded) == (1, False)
        cut_drafts([ev], cost, rows=rows, padded=padded)
        assert ev.tokens == kept
    assert layout([Eval(0, [7], 10), Eval(1, [7], 10)]) == (2, True)  # beside others: two rows a stream
    assert layout([Eval(0, [7], 10)], lone_exact=False) == (2, True)  # the throwaway row has logits
    assert layout([Eval(0, [7], 10)], paired=False) == (2, True)  # unpaired: the padding row
    assert layout([Eval(0, [7], 10)], paired=False, free_row=False) == (1, True)


def test_ubatches_follow_llama_cpp_split_equal():
    assert ubatches([(0, 1), (1, 1), (2, 1)]) == [3]  # consecutive singles: one ubatch
    assert ubatches([(0, 1), (2, 1)]) == [1, 1]  # a gap splits
    assert ubatches([(0, 5), (1, 1)]) == [2, 4]  # one token from each, then the rest of the first
    assert split([(0, 1), (1, 3), (3, 2)]) == [[(0, 1), (1, 1)], [(1, 2)], [(3, 2)]]
    assert split([(0, 2), (1, 3)]) == [[(0, 2), (1, 2)], [(1, 1)]]  # a verify step's last row left alone


def test_cut_drafts_keeps_a_likely_draft_and_drops_an_unlikely_one():
    cost = StepCost(per_ubatch=0.6, per_token=0.4)  # the probe's SmolLM2 on 2 cores
    likely = Eval(0, [7, 1, 2, 3, 4], 10, draft_acceptance=0.95)
    cut_drafts([likely], cost)
    assert likely.draft_acceptance == 0.95 and len(likely.tokens) > 1
    unlikely = Eval(0, [7, 1, 2, 3, 4], 10, draft_acceptance=0.2)
    cut_drafts([unlikely], cost)
    assert unlikely.tokens == [7] and unlikely.draft_acceptance is None


def test_cut_drafts_weighs_the_draft_against_the_whole_step():
    cost = StepCost(per_ubatch=0.6, per_token=0.4)
    alone = Eval(0, [7, 1, 2], 10, draft_acceptance=0.6)
    cut_drafts([alone], cost)
    crowd = [Eval(0, [7, 1, 2], 10, draft_acceptance=0.6)] + [Eval(s, [5], 10) for s in range(1, 8)]
    cut_drafts(crowd, cost)
    # alone the draft pays (1 + .6 + .36 tokens for 1.8 units against 1 for 1); beside seven others, each
    # guess adds its cost to a step that already emits seven tokens, and it pays no longer
    assert len(alone.tokens) > 1
    assert crowd[0].tokens == [7] and crowd[0].draft_acceptance is None
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_step_cost_fit_recovers_a_line():
    cost = StepCost.fit({1: [1.0, 1.0], 2: [1.4], 4: [2.2], 8: [3.8]})
    assert cost.per_token == pytest.approx(0.4) and cost.per_ubatch == pytest.approx(0.6)
    assert cost.of([(0, 4)]) == pytest.approx(2.2)
    assert StepCost.fit({1: [1.0], 3: [1.8]}).single is None  # one size of two rows or more: the line alone


def test_a_one_token_step_costs_what_it_measured_not_what_the_line_through_longer_steps_says():
    # SmolLM2 with flash attention on this machine's 2 cores, after 64 tokens (ms): ggml computes one row with
    # matrix-vector products, two or more with matrix-matrix kernels
    cost = StepCost.fit({1: [6.05], 2: [11.65], 4: [17.0], 9: [26.05]})
    assert cost.single == pytest.approx(6.05)
    assert cost.of([(0, 1)]) == pytest.approx(6.05)
    assert cost.of([(0, 2)]) == pytest.approx(11.65, rel=0.05)
    assert cost.of([(0, 1), (1, 1)]) == cost.of([(0, 2)])  # two sequences' tokens: one ubatch of two rows
    assert cost.of([(0, 1)], padded=True) == cost.of([(0, 2)])  # batch-invariant steps pad a lone row
    # a draft whose guesses are kept 7 times in 10 pays against the line's one-token step (~10 ms), not
    # against the one-token step it really competes with
    line_only = StepCost(per_ubatch=cost.per_ubatch, per_token=cost.per_token, single=None)
    kept = Eval(0, [7, 1, 2, 3, 4, 5, 6, 7, 8], 10, draft_acceptance=0.7)
    cut_drafts([kept], line_only)
    assert len(kept.tokens) > 1
    dropped = Eval(0, [7, 1, 2, 3, 4, 5, 6, 7, 8], 10, draft_acceptance=0.7)
    cut_drafts([dropped], cost)
    assert dropped.tokens == [7] and dropped.draft_acceptance is None
    likely = Eval(0, [7, 1, 2, 3, 4, 5, 6, 7, 8], 10, draft_acceptance=0.95)
    cut_drafts([likely], cost)
    assert len(likely.tokens) > 4  # a draft that is mostly right still pays


# -- the token loop -----------------------------------------------------------------------------------


class Recorder(Proposer):
    """Never drafts; remembers the longest history it was shown (the prompt and the answer so far)."""

    def __init__(self):
        self.seen: list[int] = []

    def propose(self, history):
        if len(history) > len(self.seen):
            self.seen = list(history)
        return None


class Oracle(Proposer):
    """Drafts the reference answer's next tokens, with ``wrong`` answer positions guessed wrong."""

    def __init__(self, prompt_len: int, answer: list[int], size: int = 4, wrong: set = frozenset()):
        self.prompt_len, self.answer, self.size, self.wrong = prompt_len, answer, size, set(wrong)
        self.verified: list[tuple[int, int]] = []

    def propose(self, history):
        at = len(history) - self.prompt_len
        tokens = [t + 1 if at + i in self.wrong else t for i, t in enumerate(self.answer[at:at + self.size])]
        return Draft(tokens, 0.99) if tokens else None

    def feedback(self, accepted, drafted):
        self.verified.append((accepted, drafted))


def loaded(**settings):
    """The tiny model with speculation off unless a request (or ``settings``) asks for it: the tests compare
    a request's proposer against none."""
    b = create(ModelSettings.from_dict({**tiny_model_settings(), "parallel": 4, "n_ctx": 1024, "speculation": "off",
                                        **settings}))
    b.load()
    b._step_cost = FREE
    return b


@pytest.fixture(scope="module")
def tiny():
    """The default settings: deterministic (batch-invariant) steps, where a sequence verifies guesses alone."""
    b = loaded()
    yield b
    b.close()


@pytest.fixture(scope="module")
def shared_steps():
    """``deterministic: false``: sequences verify their guesses in one shared step."""
    b = loaded(deterministic=False)
    yield b
    b.close()


def run(b, prompt, sampling, drafts=None):
    """One request in process with ``drafts`` as its proposer: (text, metrics)."""
    original = b._proposer
    b._proposer = lambda s: drafts
    try:
        events, _ = b.run(b.generate(prompt, sampling, lambda: False))
    finally:
        b._proposer = original
    return "".join(e.piece or "" for e in events if e.piece), events[-1].metrics


def reference(b, prompt, sampling) -> tuple[int, list[int], str, dict]:
    """The prompt's length, the answer's tokens (an end-of-generation token last where it ended so), text
    and metrics, without speculation."""
    text, metrics = run(b, prompt, sampling)
    rec = Recorder()
    longer = Sampling(**{**sampling.__dict__, "max_new_tokens": sampling.max_new_tokens + 2})
    run(b, prompt, longer, rec)
    n_prompt = metrics["prompt_tokens"]
    answer = rec.seen[n_prompt:n_prompt + metrics["completion_tokens"]]
    assert len(answer) == metrics["completion_tokens"]
    if metrics["finish_reason"] == "stop":
        answer.append(b.model.token_eos())
    return n_prompt, answer, text, metrics


def kv_end(b, seq: int) -> int:
    import llama_cpp

    return llama_cpp.llama_memory_seq_pos_max(llama_cpp.llama_get_memory(b.ctx.ctx), seq)


def test_accepted_and_rejected_guesses_give_the_same_greedy_answer(tiny):
    greedy = Sampling(max_new_tokens=40, temperature=0, ignore_eos=True)
    n_prompt, answer, text, metrics = reference(tiny, PROMPT, greedy)
    oracle = Oracle(n_prompt, answer, size=5, wrong={3, 11, 12, 30})
    got, m = run(tiny, PROMPT, greedy, oracle)
    assert got == text and m["completion_tokens"] == metrics["completion_tokens"]
    assert m["draft_tokens"] == sum(d for _, d in oracle.verified)
    assert m["accepted_tokens"] == sum(a for a, _ in oracle.verified)
    assert 0 < m["accepted_tokens"] < m["draft_tokens"]  # both paths were taken
    assert any(a == d for a, d in oracle.verified) and any(a < d for a, d in oracle.verified)
    # a step per emitted token less every accepted guess
    assert m["accepted_tokens"] >= m["completion_tokens"] // 2


def test_the_sequence_holds_exactly_the_accepted_tokens_after_each_step(tiny):
    greedy = Sampling(max_new_tokens=24, temperature=0, ignore_eos=True)
    n_prompt, answer, text, _ = reference(tiny, PROMPT, greedy)
    oracle = Oracle(n_prompt, answer, size=6, wrong={2, 9})
    tiny._proposer = lambda s: oracle
    gen = tiny.generate(PROMPT, greedy, lambda: False)
    try:
        item, checked = next(gen), 0
        while True:
            if isinstance(item, Eval):
                if item.draft_acceptance is not None:
                    # a verify step starts where the answer's KV ends: the rejected guesses' cells are gone
                    assert kv_end(tiny, item.seq) == item.pos - 1
                    checked += 1
                while not item.complete:
                    tiny.evaluate([item])
            item = next(gen)
    except StopIteration:
        pass
    finally:
        del tiny._proposer
    assert checked >= 3


def test_end_of_generation_inside_an_accepted_draft_ends_the_answer_there(tiny):
    schema = Sampling(max_new_tokens=200, temperature=0, json_schema=SCHEMA)
    n_prompt, answer, text, metrics = reference(tiny, OTHER, schema)
    assert metrics["finish_reason"] == "stop" and answer[-1] == tiny.model.token_eos()
    # the last draft runs past the answer's end: its end-of-generation guess is accepted mid-draft
    oracle = Oracle(n_prompt, answer + answer[:3], size=6, wrong={5})
    got, m = run(tiny, OTHER, schema, oracle)
    assert got == text and m["finish_reason"] == "stop"
    assert m["completion_tokens"] == metrics["completion_tokens"]
    assert any(a >= 1 for a, _ in oracle.verified[-1:])


def test_the_grammar_keeps_only_guesses_it_would_have_chosen(tiny):
    schema = Sampling(max_new_tokens=200, temperature=0, json_schema=SCHEMA)
    n_prompt, answer, text, _ = reference(tiny, OTHER, schema)
    # guesses the grammar forbids (every fourth one off by one) are rejected, the answer is the same
    oracle = Oracle(n_prompt, answer, size=6, wrong=set(range(0, len(answer), 4)))
    got, m = run(tiny, OTHER, schema, oracle)
    assert got == text and m["accepted_tokens"] < m["draft_tokens"]


def test_a_stop_string_inside_an_accepted_run_cuts_the_answer_where_it_would(tiny):
    greedy = Sampling(max_new_tokens=40, temperature=0, ignore_eos=True)
    n_prompt, answer, text, _ = reference(tiny, PROMPT, greedy)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    stopped = Sampling(max_new_tokens=40, temperature=0, ignore_eos=True, stop=(stop,))
    want, want_m = run(tiny, PROMPT, stopped)
    oracle = Oracle(n_prompt, answer, size=8)
    got, m = run(tiny, PROMPT, stopped, oracle)
    assert got == want == text[:text.index(stop)]
    assert m["finish_reason"] == want_m["finish_reason"] == "stop"
    assert m["completion_tokens"] == want_m["completion_tokens"]
    assert oracle.verified[-1][0] < oracle.verified[-1][1] or m["accepted_tokens"] > 0


@pytest.mark.parametrize("max_new", [1, 2, 5, 9])
def test_max_tokens_is_never_exceeded_and_no_guess_runs_past_it(tiny, max_new):
    greedy = Sampling(max_new_tokens=max_new, temperature=0, ignore_eos=True)
    n_prompt, answer, text, _ = reference(tiny, PROMPT, Sampling(max_new_tokens=20, temperature=0, ignore_eos=True))
    oracle = Oracle(n_prompt, answer, size=8)
    got, m = run(tiny, PROMPT, greedy, oracle)
    want, _ = run(tiny, PROMPT, greedy)
    assert got == want and m["completion_tokens"] == max_new and m["finish_reason"] == "length"
    assert m["draft_tokens"] <= max(0, max_new - 1)  # guesses fill the budget, never more


def test_seeded_sampling_draws_the_same_answer_with_speculation(tiny):
    seeded = Sampling(max_new_tokens=30, temperature=0.9, top_k=40, seed=7, ignore_eos=True)
    n_prompt, answer, text, _ = reference(tiny, PROMPT, seeded)
    oracle = Oracle(n_prompt, answer, size=4, wrong={6})
    got, m = run(tiny, PROMPT, seeded, oracle)
    assert got == text and m["accepted_tokens"] > 0


def test_a_request_cancelled_mid_verification_frees_its_slot_and_the_next_is_unaffected(tiny):
    greedy = Sampling(max_new_tokens=30, temperature=0, ignore_eos=True)
    n_prompt, answer, text, _ = reference(tiny, PROMPT, greedy)
    free_before = sorted(tiny._free)
    tiny._proposer = lambda s: Oracle(n_prompt, answer, size=6, wrong={4, 5, 6, 7})
    gen = tiny.generate(PROMPT, greedy, lambda: False)
    try:
        item = next(gen)
        while not (isinstance(item, Eval) and item.draft_acceptance is not None and item.pos > n_prompt + 4):
            if isinstance(item, Eval):
                while not item.complete:
                    tiny.evaluate([item])
            item = next(gen)
        seq = item.seq
        tiny.evaluate([item])  # verified, never sampled: the owner closes the generator now
        gen.close()
    finally:
        del tiny._proposer
    assert sorted(tiny._free) == free_before and kv_end(tiny, seq) == -1
    # every slot, whatever it held, gives the answer the model gives
    for _ in range(4):
        assert run(tiny, PROMPT, greedy)[0] == text


@pytest.mark.parametrize("deterministic", [False, True])
def test_sequences_verifying_in_one_step_each_get_their_own_answer(tiny, shared_steps, deterministic, monkeypatch):
    tiny = tiny if deterministic else shared_steps
    # the drafts as given: beside the third answer, which does not draft, cut_drafts would cut them (no answer slower)
    monkeypatch.setattr(llama_slots, "cut_drafts", lambda *a, **k: None)
    greedy = Sampling(max_new_tokens=30, temperature=0, ignore_eos=True)
    refs = [reference(tiny, p, greedy) for p in (PROMPT, OTHER)]
    oracles = [Oracle(n, a, size=5, wrong={7}) for n, a, _, _ in refs] + [None]
    gens, pending = [], {}
    for i, (prompt, drafts) in enumerate(zip((PROMPT, OTHER, PROMPT), oracles)):
        tiny._proposer = lambda s, d=drafts: d
        gens.append(tiny.generate(prompt, greedy, lambda: False))
        pending[i] = next(gens[i])  # the generator takes its proposer when it starts
    del tiny._proposer
    texts, metrics = ["", "", ""], [None] * 3
    live = set(range(3))
    shared_steps = 0
    while live:
        for i in sorted(live):  # each generator runs until it asks for a step
            if i in pending:
                continue
            try:
                while True:
                    item = next(gens[i])
                    if isinstance(item, Eval):
                        pending[i] = item
                        break
                    if item.piece:
                        texts[i] += item.piece
                    if item.metrics:
                        metrics[i] = item.metrics
            except StopIteration:
                live.discard(i)
        if not pending:
            break
        evs = list(pending.values())
        tiny.evaluate(evs)
        shared_steps += sum(1 for ev in evs if ev.draft_acceptance is not None) > 0 and len(evs) > 1
        pending = {i: ev for i, ev in pending.items() if not ev.complete}
    assert texts == [refs[0][2], refs[1][2], refs[0][2]]
    assert "draft_tokens" not in metrics[2]
    # deterministic steps too: the verify steps go in the singles' llama_decode (test_determinism.py checks their rows)
    assert shared_steps > 0 and metrics[0]["accepted_tokens"] > 0 and metrics[1]["accepted_tokens"] > 0


def test_a_lone_deterministic_sequence_guesses_in_its_padding_row_and_answers_the_same(tiny):
    """With deterministic steps a lone sequence's token carries a throwaway padding row; with speculation off
    the loop puts a one-token guess there instead, verified in a step of the sequence alone (its rows
    compute as one-token steps do). The greedy answer is the padded one's, bit for bit, and every
    right guess saves a step. The answer reports no draft figures: speculation is off."""
    greedy = Sampling(max_new_tokens=48, temperature=0, ignore_eos=True)
    prompt = Prompt(text="a b a b a b a b a b a b a b " * 4)
    assert tiny._free_row and tiny.settings.speculation == "off"
    before = tiny._batches
    padded, _ = run(tiny, prompt, greedy)  # no proposer at all: every step padded
    padded_steps, before = tiny._batches - before, tiny._batches
    events, _ = tiny.run(tiny.generate(prompt, greedy, lambda: False))
    guessed_steps = tiny._batches - before
    assert "".join(e.piece or "" for e in events if e.piece) == padded
    assert "draft_tokens" not in events[-1].metrics
    assert guessed_steps < padded_steps


# -- text the chat format feeds (gpt-oss's harmony: a spent reasoning budget) ------------------------------


class Fixed(Proposer):
    def __init__(self, tokens):
        self.tokens = tokens

    def propose(self, history):
        return Draft(list(self.tokens), 0.9)


def evaluated(ev: Eval) -> Eval:
    """``ev`` as a step leaves it (rows 0..n-1 of its own batch)."""
    ev.done, ev.row = len(ev.tokens), len(ev.tokens) - 1
    return ev


def test_fed_text_after_a_kept_guess_drops_the_unread_guesses_and_goes_after_it():
    from disaggregated_inference.backends.speculate import Lookahead

    dropped = []
    look = Lookahead(0, [1, 2, 3, 4, 5], Fixed([7, 8, 9]), lambda seq, pos: dropped.append(pos))
    evaluated(look.first())
    assert look.sampled(6) is False and dropped == []  # no draft in flight: nothing to drop
    ev = evaluated(look.step([6], room=10))
    assert ev.tokens == [6, 7, 8, 9] and ev.pos == 5 and look.row == 0
    assert look.sampled(7) is True and look.row == 1  # kept: its KV (position 6) stays
    fed = look.step([300, 301], room=10, draft=False)  # the format feeds text after it
    assert dropped == [7]  # the guesses 8 and 9, from position 7 on
    assert fed.tokens == [300, 301] and fed.pos == 7 and fed.draft_acceptance is None
    assert look.history == [1, 2, 3, 4, 5, 6, 7, 300, 301]
    assert look.finish().as_dict() == {"draft_tokens": 3, "accepted_tokens": 1}


def test_a_kept_guess_the_format_replaces_loses_its_cell():
    from disaggregated_inference.backends.speculate import Lookahead

    dropped = []
    look = Lookahead(0, [1, 2, 3], Fixed([7, 8]), lambda seq, pos: dropped.append(pos))
    evaluated(look.first())
    look.sampled(6)
    evaluated(look.step([6], room=10))
    assert look.sampled(7) is True
    look.unkeep()  # an end token the format turns into text: not part of the sequence
    assert dropped == [4] and look.pos == 4 and look.history == [1, 2, 3, 6]
    fed = look.step([400], room=10, draft=False)
    assert fed.pos == 4 and dropped == [4]  # nothing more to drop
    assert look.finish().as_dict() == {"draft_tokens": 2, "accepted_tokens": 0}


def test_drafts_never_crowd_a_prompt_chunk_out_of_the_step(shared_steps):
    tiny = shared_steps
    import llama_cpp

    seqs = [tiny._acquire()[0] for _ in range(4)]
    try:
        drafted = [Eval(s, list(range(100, 109)), 0, draft_acceptance=0.99) for s in seqs[:3]]
        prompt = Eval(seqs[3], list(range(200, 200 + 600)), 0)
        tiny.evaluate(drafted + [prompt])
        assert all(ev.complete and len(ev.tokens) == 9 for ev in drafted)  # every guess verified
        assert prompt.done == tiny.settings.n_batch  # and the prompt's whole first chunk beside them
    finally:
        mem = llama_cpp.llama_get_memory(tiny.ctx.ctx)
        for s in seqs:
            llama_cpp.llama_memory_seq_rm(mem, s, -1, -1)
            tiny._release(s)


class _Clock:
    """``time`` for ``llama_slots``: the real wall clock, and a thread CPU clock that runs at ``share`` of it."""

    def __init__(self, share: float):
        import time

        self.perf_counter, self.monotonic, self._real, self.share = time.perf_counter, time.monotonic, time, share

    def thread_time(self) -> float:
        return self._real.perf_counter() * self.share


def test_steps_the_thread_spent_off_a_cpu_never_make_the_step_cost_and_no_request_drafts_without_one(monkeypatch):
    """Four servers loading together made every measured step half a second whatever its size, so every draft
    looked free: a step whose thread was on a CPU less than ``STEP_ON_CPU`` of its time is not counted, and
    without a step cost a request that asks for speculation gets none (its drafts would go unweighed)."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)  # a library imported by earlier tests may set it
    b = loaded(deterministic=False, speculation="ngram")
    try:
        assert b._steps_on_cpu  # a CPU build, its threads spinning at barriers
        b._step_cost, b._step_medians = None, {}
        monkeypatch.setattr(llama_slots, "time", _Clock(share=0.3))  # descheduled 70% of every step
        assert b._measure_step_cost() is None and b._step_medians == {}
        asks = Sampling(max_new_tokens=8, temperature=0, speculation="ngram")
        assert b._proposer(asks) is None
        assert b.calibrate() is True  # still wanted: the owner asks again when idle
        monkeypatch.setattr(llama_slots, "time", _Clock(share=1.0))  # the cores free
        cost = b._measure_step_cost()
        assert cost is not None and set(b._step_medians) == {1, 2, 4, 9}
        assert cost.single == pytest.approx(b._step_medians[1])
        b._step_cost, b._step_cost_retry_at = cost, 0.0
        assert b._proposer(asks) is not None
        assert b.calibrate() is False  # measured on free cores: nothing to measure again
        monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # partners that sleep: a step's time may include waits
        b._step_measures, measures = 1, []  # as if measured once, at load
        while b.calibrate():  # measured again, keeping the lowest medians, up to MEASURES_OFF_CPU in all
            measures.append(b._step_measures)
            assert len(measures) < llama_slots.MEASURES_OFF_CPU
        assert measures == list(range(2, llama_slots.MEASURES_OFF_CPU))
        assert b._step_measures == llama_slots.MEASURES_OFF_CPU and b._step_cost is not None
        assert b.calibrate() is False
        monkeypatch.delenv("OMP_WAIT_POLICY")
        taken = [b._acquire()[0] for _ in range(len(b._free))]  # every slot busy: no slot to measure in
        try:
            assert b._measure_step_cost() is None
        finally:
            for seq in taken:
                b._release(seq)
    finally:
        b.close()


def test_a_server_whose_drafts_keep_failing_starts_new_sequences_without_drafting_and_recovers():
    """The server's ``DraftRecord`` gives each new sequence its odds: after drafts of 3-token matches that
    kept nothing, a new sequence's first draft of such a match no longer pays (``cut_drafts``), where the
    code-analysis priors alone would draft it whole; drafts that hold bring the odds back."""
    cost = StepCost.fit({1: [6.05], 2: [11.65], 4: [17.0], 9: [26.05]})  # SmolLM2, 2 cores (ms)
    history = [5, 6, 7, 1, 2, 3, 4, 8, 5, 6, 7]  # ends in a 3-token match of what came first

    def first_draft(record):
        p = PromptLookup(max_draft=8, min_match=3, record=record)
        draft = p.propose(history)
        ev = Eval(0, [history[-1], *draft.tokens], 10, draft_acceptance=draft.acceptance)
        cut_drafts([ev], cost)
        return p, ev

    record = DraftRecord()
    assert len(first_draft(record)[1].tokens) > 1  # the priors: a 3-token match's guesses are kept 9 times in 10
    for _ in range(6):  # six sequences, each with one failed draft of a 3-token match
        p, _ = first_draft(record)
        p.feedback(0, 8)
    p, ev = first_draft(record)
    assert ev.tokens == [history[-1]] and ev.draft_acceptance is None
    assert record.odds()[2] < 0.5 and record.odds()[4] == pytest.approx(MATCH_PRIORS[4])  # other lengths untouched
    for _ in range(40):  # drafts that hold
        p, _ = first_draft(record)
        p.feedback(8, 8)
    assert len(first_draft(record)[1].tokens) > 1
    assert len(first_draft(None)[1].tokens) > 1  # no record: the priors, as before
