"""The llama.cpp backend's prefix cache: a free slot keeps its prompt's KV, and a prompt that starts the same
evaluates only the rest, with the KV and logits it gets without the cache, bit for bit.

In process on SmolLM2 (full attention), one backend with the cache and one without, same settings.
"""
from __future__ import annotations

import pytest

from disaggregated_inference.backends import ModelSettings, create
from disaggregated_inference.backends.base import Prompt, Sampling
from disaggregated_inference.backends.llama_slots import PREFIX_MIN_TOKENS, SHARED_PIECE

from .conftest import THREADS

RUBRIC = ("Grade the notebook against the rubric: data loading, cleaning, a grouped summary, a chart with "
          "labelled axes, and a conclusion that answers the business question with figures. ")


def prompt(repeats: int, work: str) -> Prompt:
    return Prompt(text=RUBRIC * repeats + "\nStudent work: " + work)


def cached_prefixes(b) -> dict[int, int]:
    """Free slot -> how many prompt tokens of KV it holds for reuse."""
    return {seq: len(held) for seq, held in sorted(b._cached.items())}


def backend(prefix_cache: bool, parallel: int = 2):
    b = create(ModelSettings(model="smollm2", n_threads=THREADS, n_ctx=2048, parallel=parallel,
                             prefix_cache=prefix_cache))
    b.load()
    return b


@pytest.fixture(scope="module")
def warm():
    b = backend(True)
    yield b
    b.close()


@pytest.fixture(scope="module")
def cold():
    b = backend(False)
    yield b
    b.close()


def greedy(b, p: Prompt, n: int = 12):
    events, _ = b.run(b.generate(p, Sampling(max_new_tokens=n, temperature=0), lambda: False))
    return "".join(e.piece or "" for e in events if e.piece), events[-1].metrics


@pytest.mark.slow  # the packaged models in process
@pytest.mark.parametrize("repeats", [6, 20])  # one chunk, and two (n_batch 512)
def test_a_shared_start_is_not_evaluated_again_and_the_state_is_bit_identical(warm, cold, repeats):
    first, second = prompt(repeats, "df.groupby('region').sum()"), prompt(repeats, "sales.plot(kind='bar')")
    warm.run(warm.prefill(first))
    _, hit = warm.run(warm.prefill(second))
    _, ref = cold.run(cold.prefill(second))
    n = hit.metrics["prompt_tokens"]
    cached = hit.metrics["prompt_tokens_cached"]
    assert cached >= PREFIX_MIN_TOKENS and hit.metrics["prompt_tokens_evaluated"] == n - 1 - cached
    assert ref.metrics["prompt_tokens_cached"] == 0 and ref.metrics["prompt_tokens_evaluated"] == n - 1
    assert bytes(hit.payload) == bytes(ref.payload)  # the state and the canary are the cache-less ones
    assert hit.meta["canary"] == ref.meta["canary"]


@pytest.mark.slow  # the packaged models in process
def test_a_short_last_chunk_is_evaluated_whole_and_the_state_is_still_bit_identical(warm, cold):
    """A prompt whose cache-less evaluation ends in a chunk of fewer than 64 rows (computed by ggml's other
    path): with the cache that chunk is evaluated whole again, and the rows before it in chunks of 64+."""
    work = "df.groupby('region').revenue.sum()"
    while True:  # lengthen the student's work until the prompt's last chunk (n_batch 512) is short
        p = prompt(19, work)
        tail = (len(warm.tokenize(p)[0]) - 1) % 512
        if 0 < tail < PREFIX_MIN_TOKENS - 8:
            break
        work += " x"
    warm.run(warm.prefill(prompt(19, "something else")))
    _, hit = warm.run(warm.prefill(p))
    _, ref = cold.run(cold.prefill(p))
    assert hit.metrics["prompt_tokens_cached"] >= PREFIX_MIN_TOKENS
    assert bytes(hit.payload) == bytes(ref.payload)
    assert hit.meta["canary"] == ref.meta["canary"]


@pytest.mark.slow  # the packaged models in process
def test_while_the_cores_are_shared_a_prompt_goes_in_shorter_steps_with_the_same_state(cold):
    """``set_threads(..., shared=True)``: prompt chunks in steps of SHARED_PIECE tokens (so the thread count is
    taken again sooner), and the KV and canary bit for bit those of whole chunks."""
    p = prompt(20, "df.groupby('region').revenue.sum()")  # two chunks of n_batch 512
    runs, steps = {}, {}
    try:
        for shared in (False, True):
            cold.set_threads(THREADS, shared=shared)
            before = cold._batches
            _, runs[shared] = cold.run(cold.prefill(p))
            steps[shared] = cold._batches - before
    finally:
        cold.set_threads(THREADS)
    n = runs[True].metrics["prompt_tokens_evaluated"]
    pieces = -(-n // SHARED_PIECE) - (0 < n % SHARED_PIECE < PREFIX_MIN_TOKENS)
    assert n > 512 + SHARED_PIECE and steps[True] - steps[False] == pieces - 2  # against two chunks of 512
    assert bytes(runs[True].payload) == bytes(runs[False].payload)
    assert runs[True].meta["canary"] == runs[False].meta["canary"]


@pytest.mark.parametrize("take, start, piece, expected", [
    (512, 0, 128, 128),   # a whole chunk: its first piece
    (300, 0, 128, 128),   # 172 rows left after it
    (180, 0, 128, 180),   # 52 would be left: whole
    (212, 300, 128, 84),  # after a cached prefix of 300: to the boundary at 384, 128 left
    (150, 500, 128, 150), # the boundary at 512 would leave 12 rows, the one at 640 only 10 after it: whole
    (100, 0, 128, 100),   # shorter than a piece
    (512, 0, 512, 512),   # unshared: n_batch
])
def test_a_piece_keeps_enough_rows_on_both_sides(take, start, piece, expected):
    from disaggregated_inference.backends.llama_slots import _piece_of

    got = _piece_of(take, start, piece)
    assert got == expected and (got == take or min(got, take - got) >= PREFIX_MIN_TOKENS)


@pytest.mark.parametrize("shared, m, reuse", [
    (401, 1546, 401),   # rest: [401, 512) 111 rows, then the cache-less chunks, the short last one whole
    (1000, 1043, 960),  # the short last chunk [1024, 1043) whole, and [960, 1024) 64 rows before it
    (500, 1043, 448),   # [500, 512) would be 12 rows: start 64 before the boundary
    (86, 150, 86),      # one chunk: 64 rows left
    (56, 120, 0),       # less than 64 to reuse
    (4000, 5000, 4000), # [4000, 4096) 96 rows, then the cache-less chunks
])
def test_the_reuse_keeps_every_row_in_a_chunk_of_its_cache_less_kind(shared, m, reuse):
    from disaggregated_inference.backends.llama_slots import _aligned_reuse

    assert _aligned_reuse(min(shared, m - PREFIX_MIN_TOKENS), m, 512) == reuse


@pytest.mark.slow  # the packaged models in process
def test_generate_reuses_a_prefix_and_gives_the_same_greedy_text(warm, cold):
    p = prompt(8, "print(df.describe())")
    warm.run(warm.prefill(prompt(8, "df.head()")))
    text, m = greedy(warm, p)
    assert m["prompt_tokens_cached"] > 0
    assert m["prompt_tokens_recomputed"] + m["prompt_tokens_cached"] == m["prompt_tokens"]
    assert m["prefill_speed"]  # of the tokens evaluated, not of the prompt
    expected, ref = greedy(cold, p)
    assert ref["prompt_tokens_cached"] == 0 and text == expected


@pytest.mark.slow  # the packaged models in process
def test_a_short_shared_start_takes_the_lowest_free_slot_and_evaluates_everything():
    b = backend(True, parallel=3)
    short = Prompt(text="Something else entirely, with few tokens in common.")
    try:
        b.run(b.prefill(prompt(6, "first")))
        assert list(cached_prefixes(b)) == [0]         # slot 0 keeps its prompt's KV
        with b.sequence() as busy:                      # no prompt to match: the lowest free slot, emptied
            assert busy == 0 and cached_prefixes(b) == {}
            _, first = b.run(b.prefill(short))
            assert first.metrics["prompt_tokens_cached"] == 0
            assert cached_prefixes(b) == {1: first.metrics["prompt_tokens"]}
            _, again = b.run(b.prefill(short))          # too short to reuse 64 and leave 64 rows
            assert again.metrics["prompt_tokens_cached"] == 0
            assert again.metrics["prompt_tokens_evaluated"] == again.metrics["prompt_tokens"] - 1
    finally:
        b.close()


@pytest.mark.slow  # the packaged models in process
def test_a_request_that_fails_leaves_nothing_behind(warm):
    p = prompt(6, "df.dropna()")
    warm.run(warm.prefill(p))
    before = dict(cached_prefixes(warm))
    gen = warm.prefill(prompt(6, "df.fillna(0)"))
    next(gen)  # its slot acquired (the cached one) and its first evaluation asked for
    gen.close()  # abandoned mid-request: the slot's cells cannot be trusted for a later prompt
    after = cached_prefixes(warm)
    assert len(after) == len(before) - 1 and warm._free == sorted(warm._free, reverse=True)
    assert len(warm._free) == warm.slots


@pytest.mark.slow  # the packaged models in process
def test_off_by_config_and_on_sliding_window_models():
    gemma = create(ModelSettings(model="gemma3-270m", n_threads=THREADS, n_ctx=1024, parallel=2))
    gemma.load()
    try:
        assert gemma.describe()["n_swa"] and gemma.describe()["prefix_cache"] is False
        p = prompt(6, "df.head()")
        gemma.run(gemma.prefill(p))
        _, again = gemma.run(gemma.prefill(p))
        assert again.metrics["prompt_tokens_cached"] == 0 and cached_prefixes(gemma) == {}
    finally:
        gemma.close()


def test_the_config_key_is_checked():
    from disaggregated_inference import config
    from disaggregated_inference.errors import ConfigError

    from .conftest import cluster_config_dict

    data = cluster_config_dict()
    data["models"]["qwen"]["prefix_cache"] = False
    assert config.coerce(data)  # a boolean is taken
    data["models"]["qwen"]["prefix_cache"] = "yes"
    with pytest.raises(ConfigError) as err:
        config.coerce(data)
    assert "prefix_cache" in str(err.value)
