"""The chat formats inside the engines, in process: what llama.cpp makes of a gpt-oss vocabulary, and the neutral
engines' token loop (MLX, transformers) reading harmony on a real vocabulary with a scripted sampler."""
from __future__ import annotations

import pytest

from disaggregated_inference import chat
from disaggregated_inference.backends.base import ModelSettings, Sampling
from disaggregated_inference.backends.gguf_vocab import GgufVocab
from disaggregated_inference.backends.neutral_engine import stream_text
from disaggregated_inference.errors import BadRequest

from .tiny_models import GPT_OSS_HARMONY, HARMONY_TOKENS, LLAMA, LLAMA_HARMONY, tiny_gguf


@pytest.fixture(scope="module")
def harmony_vocab():
    vocab = GgufVocab(tiny_gguf(LLAMA_HARMONY))  # vocab_only: the tokenizer, no weights
    yield vocab
    vocab.close()


def test_llama_cpp_reads_the_vocabulary_as_it_reads_a_gpt_oss_gguf():
    vocab = GgufVocab(tiny_gguf(GPT_OSS_HARMONY))
    try:
        ids = {}
        for text in HARMONY_TOKENS:
            (ids[text],) = vocab.special_tokens(text)  # one token each
        # llama.cpp's own rule for harmony vocabularies: <|end|> ends a message, not the generation
        eog = set(vocab.eog_tokens())
        assert ids["<|return|>"] in eog and ids["<|call|>"] in eog and ids["<|end|>"] not in eog
        # and it renders the channel markers even without special tokens: a loop that detokenized that way and
        # stopped at its end tokens would hand the markers and the chain of thought to the user
        assert vocab.piece(ids["<|channel|>"], special=False) == b"<|channel|>"
        assert vocab.piece(ids["<|return|>"], special=False) == b""
        assert vocab.chat.name == "harmony"  # by its architecture
        ends = vocab.ends(vocab.chat)
        assert {ids["<|return|>"], ids["<|call|>"]} <= ends and ids["<|end|>"] not in ends
    finally:
        vocab.close()


def test_a_llama_with_harmony_in_its_template_speaks_harmony(harmony_vocab):
    assert harmony_vocab.chat.name == "harmony"  # by its template's markers
    plain = GgufVocab(tiny_gguf(LLAMA))
    try:
        assert plain.chat.name == "template"
    finally:
        plain.close()


def run_loop(vocab, script, *, budget=100, reasoning_budget=None, after_cap=""):
    """``stream_text`` with a sampler that follows ``script`` (then ``after_cap`` once the loop fed the answer's
    opening); returns (answer, reasoning, finish, what each step evaluated, the output)."""
    output = chat.Output(vocab.chat, budget=budget, reasoning_budget=reasoning_budget)
    first, then = iter(vocab.special_tokens(script)), iter(vocab.special_tokens(after_cap))

    def sample(logits):
        return next(then if output.capped else first)

    steps = []

    def advance(step):
        steps.append(list(step))

    loop = stream_text(vocab, None, sample, advance, output, budget=budget, cancelled=lambda: False)
    events = []
    try:
        while True:
            events.append(next(loop))
    except StopIteration as stop:
        generated, finish, _ = stop.value
    answer = "".join(e.piece for e in events if e.piece)
    reasoning = "".join(e.reasoning for e in events if e.reasoning)
    return answer, reasoning, finish, steps, output


def test_the_neutral_loop_goes_on_past_end_and_stops_at_return(harmony_vocab):
    answer, reasoning, finish, steps, _ = run_loop(
        harmony_vocab, "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>"
                       "Yes.<|return|>")
    assert (answer, reasoning, finish) == ("Yes.", "Think.", "stop")
    (end,) = harmony_vocab.special_tokens("<|end|>")
    assert [end] in steps  # evaluated like any token


def test_the_neutral_loop_feeds_the_answers_opening_when_the_budget_is_spent(harmony_vocab):
    answer, reasoning, finish, steps, output = run_loop(
        harmony_vocab, "<|channel|>analysis<|message|>" + "think " * 30, reasoning_budget=10,
        after_cap="Done.<|return|>")
    assert answer == "Done." and finish == "stop" and output.reasoning_tokens == 10
    opener = harmony_vocab.special_tokens(chat.harmony.FINAL)
    fed = [s for s in steps if len(s) > 1]
    assert len(fed) == 1 and fed[0][1:] == opener  # the capped token and the opening, evaluated in one step
    assert reasoning.startswith("think think")


def test_neutral_engines_refuse_only_what_needs_a_grammar(harmony_vocab):
    from disaggregated_inference.backends.transformers import TransformersBackend

    tools = chat.parse_tools([{"name": "now"}])
    plain = GgufVocab(tiny_gguf(LLAMA))
    try:
        backend = TransformersBackend(ModelSettings(backend="transformers", model="unused", n_ctx=512))
        backend.vocab = plain  # a template model: its tool calls are a JSON envelope under a grammar
        with pytest.raises(BadRequest) as info:
            backend._output(Sampling(tools=tools), None, (), [1, 2, 3])
        assert info.value.field == "tools"
        with pytest.raises(BadRequest) as info:
            backend._output(Sampling(json_schema={"type": "object"}), None, (), [1, 2, 3])
        assert info.value.field == "json_schema"
        backend.vocab = harmony_vocab  # harmony calls tools in text: nothing to refuse
        assert backend._output(Sampling(tools=tools), None, (), [1, 2, 3]).format.name == "harmony"
    finally:
        plain.close()
