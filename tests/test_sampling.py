"""Sampling under a JSON schema's grammar (``llama_loop.TokenSampler``), in process on the generated tiny llama.

Sampling, greedy or at a temperature, asks the grammar about the unconstrained choice only, and matches the whole
vocabulary against it only when it refuses, as llama.cpp's own server does. A greedy answer must be the
grammar-first chain's, token for token; a drawn one must be tokens the grammar allows, and the same again for
the same seed. The tiny llama's random weights keep choosing tokens the grammar refuses, so both ways are taken.
"""
from __future__ import annotations

import pytest

from disaggregated_inference.backends import ModelSettings, create
from disaggregated_inference.backends.base import Prompt, Sampling
from disaggregated_inference.backends.llama_loop import grammar_allows

from .conftest import tiny_model_settings

SCHEMA = {"type": "object", "properties": {"summary": {"type": "string"}, "score": {"type": "integer"},
                                           "strengths": {"type": "array", "items": {"type": "string"}}},
          "required": ["summary", "score", "strengths"]}


@pytest.fixture(scope="module")
def backend():
    b = create(ModelSettings(**{**tiny_model_settings(), "n_ctx": 1024, "parallel": 1, "deterministic": False,
                                "speculation": "off", "prefix_cache": False}))
    b.load()
    yield b
    b.close()


def answer(b, text: str, sampling: Sampling, grammar_first: bool) -> tuple[str, int, list]:
    """The answer's text, its tokens, and the samplers the request made (one more where a schema comes due),
    each with ``drawn``: the tokens it sampled."""
    made, make = [], b._sampler

    def sampler(*args, **kwargs):
        s = make(*args, **kwargs)
        if grammar_first and s.unconstrained is not None:  # as before TokenSampler: the grammar over everything
            s.unconstrained.close()
            s.unconstrained, s._grammar = None, None
        s.drawn, sample = [], s.sample

        def recorded(ctx, row):
            s.drawn.append(sample(ctx, row))
            return s.drawn[-1]
        s.sample = recorded
        made.append(s)
        return s

    b._sampler = sampler
    try:
        events, _ = b.run(b.generate(Prompt(text=text), sampling, lambda: False))
    finally:
        del b._sampler  # the class's method again
    return "".join(e.piece for e in events if e.piece), events[-1].metrics.completion_tokens, made


@pytest.mark.parametrize("ignore_eos", [False, True])  # True: the grammar is the chain's second sampler
def test_greedy_under_a_grammar_answers_what_the_grammar_first_chain_answers(backend, ignore_eos):
    refused = fast = 0
    for i in range(3):
        sampling = Sampling(max_new_tokens=48, temperature=0.0, json_schema=SCHEMA, ignore_eos=ignore_eos)
        text = f"Report {i}: describe the quarterly margins as JSON."
        before, _, _ = answer(backend, text, sampling, grammar_first=True)
        after, tokens, made = answer(backend, text, sampling, grammar_first=False)
        assert after == before
        assert after.startswith("{")
        (sampler,) = made
        refused += sampler.refused
        fast += tokens - sampler.refused
    assert refused > 0 and fast > 0  # both ways were taken: the grammar refused some choices and let others be


def allowed(b, schema: dict, tokens: list[int]) -> bool:
    """Whether a fresh grammar of ``schema`` lets every token of ``tokens`` through, one after the other."""
    import llama_cpp
    from llama_cpp import _internals

    chain = _internals.LlamaSampler()
    chain.add_grammar(b.model, b._grammar(schema))
    grammar = llama_cpp.llama_sampler_chain_get(chain.sampler, 0)
    try:
        for token in tokens:
            if not grammar_allows(grammar, token):
                return False
            llama_cpp.llama_sampler_accept(chain.sampler, token)
        return True
    finally:
        chain.close()


def test_sampling_at_a_temperature_asks_the_grammar_about_the_draw_and_a_seed_draws_the_same_again(backend):
    """At a temperature too the grammar is asked about the unconstrained draw only, and samples over the whole
    vocabulary only when it refuses (as llama.cpp's ``common_sampler_sample`` does): every token of the answer is
    one the grammar allows, and the same seed draws the same answer again."""
    refused = fast = 0
    for i in range(3):
        sampling = Sampling(max_new_tokens=48, temperature=0.4, seed=7 + i, json_schema=SCHEMA)
        text = f"Report {i}: describe the quarterly margins as JSON."
        first, _, (s,) = answer(backend, text, sampling, grammar_first=False)
        again, _, (t,) = answer(backend, text, sampling, grammar_first=False)
        assert again == first and t.drawn == s.drawn and first.startswith("{")
        assert s.unconstrained is not None
        assert allowed(backend, SCHEMA, s.drawn), (first, s.drawn)
        refused += s.refused
        fast += len(s.drawn) - s.refused
    assert refused > 0 and fast > 0  # both ways were taken


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_greedy_without_a_grammar_reads_the_argmax_and_takes_the_chains_token(backend, ignore_eos):
    """Greedy without a schema reads the argmax off the row's logits instead of running the chain (the end
    tokens' bias, then greedy), which copies the whole vocabulary first: every token is the chain's own."""
    import llama_cpp

    for i in range(3):
        sampling = Sampling(max_new_tokens=24, temperature=0.0, ignore_eos=ignore_eos)
        _, _, (s,) = answer(backend, f"Note {i}: the quarterly margins were", sampling, grammar_first=False)
        assert s._greedy is not None
        assert bool(s._greedy[1]) == ignore_eos  # the end tokens are barred only under ignore_eos
    seen = []
    make = backend._sampler

    def checking(*args, **kwargs):
        s = make(*args, **kwargs)
        fast = s.sample

        def both(ctx, row):
            token = fast(ctx, row)
            seen.append((token, llama_cpp.llama_sampler_sample(s.chain.sampler, ctx, row)))
            return token
        s.sample = both
        return s
    backend._sampler = checking
    try:
        for i in range(3):
            backend.run(backend.generate(Prompt(text=f"Note {i}: the quarterly margins were"),
                                         Sampling(max_new_tokens=24, temperature=0.0, ignore_eos=ignore_eos),
                                         lambda: False))
    finally:
        del backend._sampler
    assert len(seen) >= 3 and all(fast == chain for fast, chain in seen), seen


def test_greedy_argmax_keeps_barred_tokens_out_and_leaves_a_nan_row_to_the_chain(monkeypatch):
    """The argmax's two edges, on made-up rows: an end token ``ignore_eos`` bars is never the answer (the next
    highest is), and a row whose argmax is NaN goes to the chain, which never picks a NaN."""
    import llama_cpp
    import numpy as np

    from disaggregated_inference.backends.llama_loop import TokenSampler

    class Chain:
        sampler = object()
    monkeypatch.setattr(llama_cpp, "llama_sampler_sample", lambda sampler, ctx, row: -1)  # the chain: -1 here
    rows = {0: np.array([0.5, 3.0, 2.0, 3.0], dtype=np.float32),  # 1 and 3 tie: the first
            1: np.array([0.5, 1.0, 9.0, 2.0], dtype=np.float32),  # 2 is barred: 3 is next
            2: np.array([0.5, np.nan, 2.0, 1.0], dtype=np.float32)}
    s = TokenSampler(Chain(), greedy=(rows.__getitem__, frozenset({2})))
    assert [s.sample(None, row) for row in (0, 1, 2)] == [1, 3, -1]
    assert rows[1][2] == 9.0  # the row itself is left as it was
