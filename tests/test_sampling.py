"""Sampling under a JSON schema's grammar (``llama_loop.TokenSampler``), in process on the generated tiny llama.

Greedy sampling asks the grammar about the unconstrained choice only, and matches the whole vocabulary against
it only when it refuses, as llama.cpp's own server does. The answer must be the grammar-first chain's, token
for token: the tiny llama's random weights keep choosing tokens the grammar refuses, so both ways are taken.
"""
from __future__ import annotations

import pytest

from disaggregated_inference.backends import ModelSettings, create
from disaggregated_inference.backends.base import Prompt, Sampling

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
    """The answer's text, its tokens, and the samplers the request made (one more where a schema comes due)."""
    made, make = [], b._sampler

    def sampler(*args, **kwargs):
        s = make(*args, **kwargs)
        if grammar_first and s.unconstrained is not None:  # as before TokenSampler: the grammar over everything
            s.unconstrained.close()
            s.unconstrained, s._grammar = None, None
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


def test_sampling_at_a_temperature_keeps_the_grammar_first():
    """A seeded draw must draw what it drew before: only greedy sampling gets the unconstrained chain."""
    b = create(ModelSettings(**{**tiny_model_settings(), "n_ctx": 256, "parallel": 1, "speculation": "off"}))
    b.load()
    try:
        output = b._output(Sampling(json_schema=SCHEMA), None, (), [1, 2, 3])
        warm = b._sampler(Sampling(temperature=0.4, seed=1, json_schema=SCHEMA), output, SCHEMA)
        greedy = b._sampler(Sampling(temperature=0.0, json_schema=SCHEMA), output, SCHEMA)
        plain = b._sampler(Sampling(temperature=0.0), output, None)
        assert warm.unconstrained is None and plain.unconstrained is None and greedy.unconstrained is not None
        for s in (warm, greedy, plain):
            s.close()
    finally:
        b.close()
