"""Batch-invariant serving (the llama.cpp engine's ``deterministic`` setting, issue 28).

In process on the generated tiny llama (quick tier): one sequence's logits alone against the same
sequence beside 1, 3 and 7 others, generating and prompt chunks mixed, slots next to each other or
not, over several steps: bit for bit equal with ``deterministic``; without it the same probe sees them
move (so the probe can tell). Two compute threads and a prompt past 512 cells, where ggml's flash
attention splits a lone query's cells across the threads.

Through real servers (slow tier, the session's tiny cluster): eight greedy requests at once give the
texts and first-token log-probabilities of the same requests one at a time, handoff and decode-only;
and under load the canary holds a handoff to the exact tolerance, so a damaged state is refused.
"""
from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from disaggregated_inference.backends import ModelSettings, create
from disaggregated_inference.backends.base import Eval, Prompt, Sampling
from disaggregated_inference.testing.bundles import read_bundle

from .conftest import tiny_model_settings

WORDS = "revenue margin churn cohort pivot quarterly region forecast variance median".split()


def text(i: int, words: int) -> str:
    rng = np.random.default_rng(i)
    return " ".join(rng.choice(WORDS, words)) + " Summarise."


def tiny_backend(deterministic: bool, **settings):
    b = create(ModelSettings(**{**tiny_model_settings(), "n_threads": 2, "n_ctx": 2048, "parallel": 8,
                                "prefix_cache": False, "deterministic": deterministic, **settings}))
    b.load()
    return b


def fill(b, seq: int, tokens: list[int]) -> None:
    """Evaluate a prompt's tokens into ``seq`` as a server does (no logits), in steps of its own."""
    ev = Eval(seq, list(tokens), 0, logits=False)
    while not ev.complete:
        b.evaluate([ev])


def generate_together(b, seqs, prompts, steps: int, mixed: list[int] | None = None) -> list[np.ndarray]:
    """``prompts`` filled into ``seqs``, then ``steps`` greedy steps of them all in shared steps (with
    ``mixed``, a prompt evaluated into a further slot alongside, chunk by chunk); the first one's logits."""
    for seq, p in zip(seqs, prompts):
        fill(b, seq, p[:-1])
    cur, pos, out = [p[-1] for p in prompts], [len(p) - 1 for p in prompts], []
    side = None
    if mixed is not None:
        side = Eval(b._acquire()[0], mixed, 0, logits=False)
    for _ in range(steps):
        evs = [Eval(s, [t], q) for s, t, q in zip(seqs, cur, pos)]
        b.evaluate(evs + ([side] if side is not None and not side.complete else []))
        out.append(b._row_logits(evs[0].row).copy())
        cur, pos = [int(b._row_logits(e.row).argmax()) for e in evs], [q + 1 for q in pos]
    if side is not None:
        b._release(side.seq)
    return out


def moved_beside_others(deterministic: bool, **settings) -> dict:
    """Max |logit difference| of one sequence (a ~600-token prompt, then 5 greedy steps) between alone
    and each way of sharing its steps; ``settings`` (e.g. ``model="gemma3-270m"``) probe another model."""
    b = tiny_backend(deterministic, **settings)
    try:
        prompts = [b.tokenize(Prompt(text=text(i, 120 + 70 * i)))[0] for i in range(8)]
        x, others = prompts[6], prompts[:6] + prompts[7:]
        assert len(x) > 512  # past 512 cells: the lone query's attention is split across threads

        def run(seqs, together, **kw):
            try:
                return generate_together(b, seqs, [x] + together, 5, **kw)
            finally:
                for s in seqs:
                    b._release(s)

        def acquire(n):
            return [b._acquire()[0] for _ in range(n)]

        alone = run(acquire(1), [])
        out = {}
        for k in (1, 3, 7):
            out[f"beside {k}"] = run(acquire(k + 1), others[:k])
        taken = acquire(6)  # slots 0..5: x in 3, beside 0 and 5 (no neighbouring id brings a token)
        out["beside 2, not adjacent"] = run([taken[3], taken[0], taken[5]], others[:2])
        for s in (1, 2, 4):
            b._release(taken[s])
        out["beside a prompt being evaluated and 1 generating"] = run(acquire(2), others[:1], mixed=others[4][:-1])
        return {name: max(float(np.abs(a - y).max()) for a, y in zip(alone, got)) for name, got in out.items()}
    finally:
        b.close()


def test_a_sequence_computes_bit_for_bit_the_same_alone_or_beside_any_others():
    moved = moved_beside_others(deterministic=True)
    print("deterministic:", moved)
    assert moved == {name: 0.0 for name in moved}


def test_without_it_the_same_probe_sees_neighbours_move_the_logits():
    """The probe above can fail: the plain step moves them (ggml's one-sequence ubatch, its split
    attention over two threads), so a deterministic step that stopped being invariant would show."""
    moved = moved_beside_others(deterministic=False)
    print("plain:", moved)
    assert max(moved.values()) > 0


def test_a_one_slot_server_computes_as_a_multi_slot_one():
    """Prefill and decode servers may have other ``parallel``: the canary holds them to 1e-4 all the same, so a
    lone token's row must come out the same with no neighbouring slot to pad in (padded in its own stream)."""
    got = []
    for parallel in (1, 8):
        b = tiny_backend(True, parallel=parallel)
        try:
            x = b.tokenize(Prompt(text=text(6, 540)))[0]
            seq = b._acquire()[0]
            got.append(generate_together(b, [seq], [x], 3))
            b._release(seq)
        finally:
            b.close()
    assert all(np.array_equal(a, c) for a, c in zip(*got))


def test_the_load_measures_whether_a_lone_row_needs_its_padding_row():
    """``_lone_rows_exact`` at load: the tiny llama's F16 weights take another matmul path for one row than for
    two (5e-7 apart), so its lone tokens keep the padding row (and a guess in it); with flash attention,
    which splits a lone query's cells across threads, nothing is measured."""
    for flash_attn in (False, True):
        b = tiny_backend(True, flash_attn=flash_attn)
        try:
            assert b._lone_exact is False and b.describe()["lone_rows_exact"] is False and b._free_row
        finally:
            b.close()


@pytest.mark.slow
def test_without_flash_attention_smollm2_computes_a_lone_row_unpadded_bit_for_bit():
    """SmolLM2 (Q4_1/Q8_0 weights) without flash attention: a lone token's one row computes as beside others, so
    the load's probe lets its steps go unpadded (a lone request at the plain steps' speed), and the whole
    probe above, alone against beside 1, 3, 7 others and a prompt, is still 0 apart."""
    moved = moved_beside_others(deterministic=True, model="smollm2", flash_attn=False)
    print("smollm2, no flash attention:", moved)
    assert moved == {name: 0.0 for name in moved}
    b = tiny_backend(True, model="smollm2", flash_attn=False)
    try:
        assert b._lone_exact and not b._free_row and b.describe()["lone_rows_exact"]
        pads, decode = [], b._decode
        b._decode = lambda chosen, extra=None, **kw: (pads.append(({ev.seq for ev, _ in chosen}, extra)),
                                                      decode(chosen, extra, **kw))[1]
        greedy = Sampling(max_new_tokens=8, temperature=0, ignore_eos=True)
        b.run(b.generate(Prompt(text=text(1, 40)), greedy, lambda: False))
        ours = pads[-1][0]  # the request's last token; a step cost measured at its first draft (the cores were
        # busy at load) steps another slot
        steps = [p for seqs, p in pads if p is not None and seqs == ours]  # the prompt's last token, then 7 more
        assert len(steps) == 8 and steps == [[]] * 8  # none padded
    finally:
        b.close()


def test_the_setting_is_off_by_default_and_reported():
    """Off by default (on a CPU a lone request's padding row halves its speed: docs/benchmarks.md); the grader's
    cluster and the suite's turn it on."""
    plain = {k: v for k, v in tiny_model_settings().items() if k != "deterministic"}
    assert ModelSettings(**plain).deterministic is False
    b = tiny_backend(True)
    try:
        assert b.describe()["deterministic"] is True
        assert b.describe()["tiled_matmul"] is False  # ggml's K-quant tiling from 8 rows on is off in the process
    finally:
        b.close()


# -- through real servers ---------------------------------------------------------------------------

PROMPTS = [text(100 + i, 160 + 10 * i) for i in range(8)]  # ~250 tokens each, all different
MAX_TOKENS = 24


def at_once(fn, items):
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


def prefill_canary(http, url: str, prompt: str) -> dict:
    """The first token's top log-probabilities as the prefill server computed them (its canary)."""
    pre = http.post(f"{url}/prefill", json={"prompt": prompt})
    assert pre.status_code == 200, pre.text
    header, _, _ = read_bundle(io.BytesIO(http.get(pre.json()["kv"]["url"]).content))
    return header.meta["canary"]


@pytest.mark.slow
def test_eight_requests_at_once_answer_as_one_at_a_time_handoff_and_decode_only(http, tiny_cluster, tiny_prefill,
                                                                                 tiny_decode):
    import requests

    from disaggregated_inference.client import DisaggregatedClient

    from .conftest import patient

    def decode_only(prompt):
        with requests.Session() as s:
            r = s.post(f"{tiny_decode}/generate", json={"prompt": prompt, "max_new_tokens": MAX_TOKENS,
                                                        "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["generated_text"]

    def canary(prompt):
        with requests.Session() as s:
            return prefill_canary(s, tiny_prefill, prompt)

    with DisaggregatedClient(patient(tiny_cluster.config), health_check=False) as client:
        client.check_health()

        def handoff(prompt):
            out, m = client.generate("qwen", prompt, max_tokens=MAX_TOKENS)
            assert m["method"] == "kv_handoff", m
            return out, m

        alone = [handoff(p) for p in PROMPTS]
        together = at_once(handoff, PROMPTS)
    assert [t for t, _ in together] == [t for t, _ in alone]
    # the decode side's first-token distribution against the prefill side's, under load: bit for bit
    assert all(m["canary_divergence"] == 0.0 and m["canary_tolerance"] == 1e-4 for _, m in together), \
        [(m["canary_divergence"], m["canary_tolerance"]) for _, m in together]

    assert at_once(decode_only, PROMPTS) == [decode_only(p) for p in PROMPTS]
    first_alone = [canary(p) for p in PROMPTS]
    first_together = at_once(canary, PROMPTS)
    assert [c["logprobs"] for c in first_together] == [c["logprobs"] for c in first_alone]
    assert all(c["deterministic"] and c["alone"] for c in first_together)


@pytest.mark.slow
def test_under_load_the_canary_holds_the_exact_tolerance_and_refuses_a_damaged_state(http, tiny_prefill, tiny_decode,
                                                                                     bytes_server):
    """A damaged state handed over while the decode server is busy generating for others (so its check
    shares a step): refused at the exact tolerance, where a plain server allows 0.5 for a shared step."""
    import threading

    import requests

    from .test_batching_e2e import _steps_with_several_requests
    from .test_canary import canary_counts, damaged_bundle

    pre = http.post(f"{tiny_prefill}/prefill", json={"prompt": PROMPTS[0]}).json()
    url = bytes_server("/kv/determinism-damaged", damaged_bundle(http.get(pre["kv"]["url"]).content))
    before, shared = canary_counts(http, tiny_decode), _steps_with_several_requests(http, tiny_decode)
    stop = threading.Event()

    def busy(i):  # long generations that keep the decode server's steps shared
        with requests.Session() as s:
            while not stop.is_set():
                s.post(f"{tiny_decode}/generate", json={"prompt": PROMPTS[i], "max_new_tokens": 400,
                                                        "temperature": 0, "ignore_eos": True})

    workers = [threading.Thread(target=busy, args=(i,), daemon=True) for i in (1, 2, 3)]
    for w in workers:
        w.start()
    try:
        import time

        time.sleep(0.5)
        resp = http.post(f"{tiny_decode}/decode", json={"kv": {"url": url, "handle": "determinism-damaged"},
                                                         "max_new_tokens": 4})
        fresh = http.post(f"{tiny_prefill}/prefill", json={"prompt": PROMPTS[4]}).json()
        good = http.post(f"{tiny_decode}/decode", json={"kv": fresh["kv"], "max_new_tokens": 4})
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=120)
    assert _steps_with_several_requests(http, tiny_decode) > shared + 10  # the server was busy with others
    assert resp.status_code == 422, resp.text
    body = resp.json()
    assert body["code"] == "canary_mismatch" and body["canary_tolerance"] == 1e-4, body
    print("damaged state under load: divergence", body["canary_divergence"])
    assert good.status_code == 200, good.text
    m = good.json()["metrics"]
    assert m["canary"] == "passed" and m["canary_divergence"] == 0.0 and m["canary_tolerance"] == 1e-4, m
    assert canary_counts(http, tiny_decode)["failures"] == before["failures"] + 1


def test_the_graders_embedded_cluster_runs_every_llama_cpp_server_deterministic_whatever_its_config_says():
    from disaggregated_inference import config as cluster_config
    from disaggregated_inference.grading.connect import deterministic
    from disaggregated_inference.server.settings import from_cluster

    from .conftest import tiny_config_dict

    data = tiny_config_dict()
    data["models"]["qwen"]["deterministic"] = False
    data["decode_servers"][1]["deterministic"] = False  # a server's own override too
    cfg = cluster_config.from_dict(data)
    assert not from_cluster(cfg, "local-decode-qwen").model.deterministic
    graded = deterministic(cfg)
    assert all(from_cluster(graded, e.name).model.deterministic for e in graded.servers)
    assert cfg.decode_servers[0].settings["deterministic"] is False  # the caller's config is left alone
    # on the CPU with an f16 V cache, flash attention off on both sides (a lone row computes exact without it),
    # and paired steps on with it (verify rows compute otherwise without flash attention; the load measures them)
    assert not any(from_cluster(graded, e.name).model.flash_attn for e in graded.servers)
    assert all(from_cluster(graded, e.name).model.paired_steps for e in graded.servers)
    data["models"]["qwen"].update(type_v="q8_0", flash_attn=True)  # a quantized V cache needs flash attention
    kept = deterministic(cluster_config.from_dict(data))
    assert all(from_cluster(kept, e.name).model.flash_attn == (e.model == "qwen") for e in kept.servers)
    assert all(from_cluster(kept, e.name).model.paired_steps == (e.model != "qwen") for e in kept.servers)


def test_the_grader_names_the_servers_whose_answers_can_move_with_load():
    from types import SimpleNamespace

    from disaggregated_inference.grading.connect import not_batch_invariant

    def server(name, up, info):
        return SimpleNamespace(entry=SimpleNamespace(name=name), up=up, health={"model_info": info} if info else {})

    client = SimpleNamespace(servers={
        "a": server("decode-a", True, {"deterministic": False}),
        "b": server("decode-b", True, {"deterministic": True}),
        "c": server("decode-c", False, {"deterministic": False}),  # down: asked again when it comes back
        "d": server("ollama", True, {"model": "qwen3-coder:30b"}),  # an engine without the setting
    })
    assert not_batch_invariant(client) == ["decode-a"]


GEMMA_PROBE = r"""
import json, sys
import numpy as np
from disaggregated_inference.backends import ModelSettings, create
from disaggregated_inference.backends.base import Eval, Prompt
from tests.test_determinism import fill, text
b = create(ModelSettings(model="gemma3-270m", n_threads=1, n_ctx=1024, parallel=10, prefix_cache=False,
                         deterministic=sys.argv[1] == "on"))
b.load()
prompts = [b.tokenize(Prompt(text=text(i, 60 + 40 * i)))[0] for i in range(3)]
def first(together):
    seqs = [b._acquire()[0] for _ in together]
    for s, p in zip(seqs, together):
        fill(b, s, p[:-1])
    evs = [Eval(s, p[-1:], len(p) - 1) for s, p in zip(seqs, together)]
    b.evaluate(evs)
    out = b._row_logits(evs[0].row).copy()
    for s in seqs:
        b._release(s)
    return out
x, short = prompts[2], [prompts[0], prompts[1]] * 5
alone = first([x])
print(json.dumps({f"beside {n}": float(np.abs(first([x] + short[:n]) - alone).max()) for n in (3, 7, 9)}))
"""


def gemma_moved(setting: str) -> dict:
    """The probe in a process of its own: ggml reads ``GGML_CPU_TILED_MM`` once per process."""
    import json
    import os
    import subprocess
    import sys

    from .conftest import ROOT

    env = {k: v for k, v in os.environ.items() if k != "GGML_CPU_TILED_MM"}
    done = subprocess.run([sys.executable, "-c", GEMMA_PROBE, setting], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_k_quant_weights_compute_a_step_of_eight_rows_or_more_as_one_of_fewer():
    """Gemma 3's Q4_K/Q6_K layers: ggml's tiled K-quant matmul takes a matmul of 8 rows or more, ``vec_dot``
    fewer (0.377 apart measured); ``deterministic`` turns the tiled path off in its process, and the
    plain setting shows the probe can tell."""
    on, off = gemma_moved("on"), gemma_moved("off")
    print("deterministic:", on, "plain:", off)
    assert on == {"beside 3": 0.0, "beside 7": 0.0, "beside 9": 0.0}
    assert off["beside 7"] > 0 and off["beside 9"] > 0


@pytest.mark.parametrize("settings", [
    {},
    pytest.param({"model": "gemma3-270m", "flash_attn": False}, marks=pytest.mark.slow),  # sliding window, K-quants
    pytest.param({"model": "smollm2"}, marks=pytest.mark.slow),  # flash attention
], ids=["tiny llama", "gemma 3", "smollm2"])
def test_a_prompt_in_the_short_steps_of_shared_cores_computes_bit_for_bit_as_in_whole_chunks(settings):
    """While another server computes on the same cores a prompt's chunks go in pieces (``set_threads(...,
    shared=True)``: llama_slots.SHARED_PIECE); the KV they leave gives the next steps the logits that whole
    chunks give, bit for bit."""
    from disaggregated_inference.backends.llama_slots import SHARED_PIECE

    b = tiny_backend(True, **settings)
    try:
        x = b.tokenize(Prompt(text=text(6, 900)))[0][:1000]
        assert len(x) > 512 + 2 * SHARED_PIECE
        got = {}
        for shared in (False, True):
            b.set_threads(2, shared=shared)
            seq = b._acquire()[0]
            try:
                steps = b._batches
                got[shared] = generate_together(b, [seq], [x], 3)
                steps = b._batches - steps
            finally:
                b._release(seq)
            assert steps > 6 if shared else steps < 6  # 3 steps after the prompt: its chunks, or its pieces
        assert all(np.array_equal(a, y) for a, y in zip(got[False], got[True]))
    finally:
        b.close()


def verify_probe(settings: dict) -> dict:
    """Deterministic steps with drafts given as they are (no ``cut_drafts``): each sequence's rows against its
    one-token steps alone, over a plan of steps that mixes singles, verify steps, idle sequences and gaps in
    the ids. Runs in a process of its own (``run_verify_probe``): ggml reads ``GGML_CPU_TILED_MM`` once per
    process, and a deterministic server's process never computes with the tiled matmul on."""
    from disaggregated_inference.backends import llama_slots
    from disaggregated_inference.backends.speculate import StepCost

    settings = dict(settings)
    forced = settings.pop("force_paired", False)
    b = tiny_backend(True, **settings)
    if forced:  # the tiny llama's verify rows are exact without them: paired steps on its layout all the same
        b._paired = b._verify_exact = True
    b._step_cost = StepCost()
    llama_slots.cut_drafts = lambda *a, **k: None  # the drafts as given: the numerics, not what pays
    try:
        prompts = [b.tokenize(Prompt(text=text(i, 120 + 70 * i)))[0] for i in range(3)]
        prompts.append(b.tokenize(Prompt(text=text(6, 540)))[0][:600])  # past 512 cells
        steps = 20

        def alone(p):  # the tokens fed (the prompt's last, then greedy) and the logits after each
            seq = b._acquire()[0]
            try:
                fill(b, seq, p[:-1])
                fed, logits = [p[-1]], []
                for i in range(steps):
                    ev = Eval(seq, [fed[-1]], len(p) - 1 + i)
                    b.evaluate([ev])
                    logits.append(b._row_logits(ev.row).copy())
                    fed.append(int(logits[-1].argmax()))
                return fed, logits
            finally:
                b._release(seq)

        refs = [alone(p) for p in prompts]
        # guesses per sequence in each step (None: not in the step); every guess is the token alone gave
        plan = [(2, 0, 0, None), (2, 2, None, 0), (1, 0, None, None), (None, 3, None, 2), (0, 1, 1, 1),
                (2, None, 1, 0), (1, 1, 2, 2)]
        seqs = [b._acquire()[0] for _ in prompts]
        assert seqs == sorted(seqs) and seqs[-1] - seqs[0] == 3  # adjacent ids: 0 and 2 idle leave gaps
        at = [0] * len(prompts)
        cut = rows = 0
        moved = []
        try:
            for seq, p in zip(seqs, prompts):
                fill(b, seq, p[:-1])
            for guesses in plan:
                evs = {}
                for k, (seq, p) in enumerate(zip(seqs, prompts)):
                    if guesses[k] is not None:
                        fed = refs[k][0][at[k]:at[k] + 1 + guesses[k]]
                        evs[k] = Eval(seq, list(fed), len(p) - 1 + at[k],
                                      draft_acceptance=0.9 if guesses[k] else None)
                given = {k: len(ev.tokens) for k, ev in evs.items()}
                b.evaluate(list(evs.values()))
                for k, ev in evs.items():
                    cut += given[k] - len(ev.tokens)
                    for j in range(len(ev.tokens)):
                        row = ev.row_of(j) if len(ev.tokens) > 1 else ev.row
                        apart = float(np.abs(b._row_logits(row) - refs[k][1][at[k] + j]).max())
                        if apart:
                            moved.append([list(guesses), k, j, apart])
                        rows += 1
                    at[k] += len(ev.tokens)
        finally:
            for seq in seqs:
                b._release(seq)
        return {"verify_exact": b._verify_exact, "lone_exact": b._lone_exact, "paired": b._paired, "cut": cut,
                "rows": rows,
                "moved": moved, "guesses": sum(g or 0 for step in plan for g in step), "steps": len(plan),
                "planned_rows": sum(1 + g for step in plan for g in step if g is not None)}
    finally:
        b.close()


def run_verify_probe(settings: dict) -> dict:
    import json
    import os
    import subprocess
    import sys

    from .conftest import ROOT

    env = {k: v for k, v in os.environ.items() if k != "GGML_CPU_TILED_MM"}
    code = ("import json, sys; from tests.test_determinism import verify_probe; "
            "print(json.dumps(verify_probe(json.loads(sys.argv[1]))))")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(settings)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("settings", [
    {},
    pytest.param({"model": "smollm2"}, marks=pytest.mark.slow),  # flash attention, Q4/Q8 weights
    pytest.param({"model": "smollm2", "flash_attn": False}, marks=pytest.mark.slow),  # lone rows unpadded
    pytest.param({"model": "gemma3-270m", "flash_attn": False}, marks=pytest.mark.slow),  # sliding window
    pytest.param({"model": "gemma3-270m"}, marks=pytest.mark.slow),
    pytest.param({"flash_attn": False}),
], ids=["tiny llama", "smollm2", "smollm2 without flash attention", "gemma 3 without flash attention", "gemma 3",
        "tiny llama without flash attention"])
def test_verify_steps_beside_others_compute_every_row_as_one_token_steps_alone_do(settings):
    """Speculation under deterministic steps: a sequence that verifies guesses beside others (generating
    ones, another verifying one, a gap in the ids) gets in every row the logits its one-token steps get
    alone, bit for bit, and so do its neighbours; a verify step whose last row would be left alone in a
    ubatch gives up that guess. Where the load measured that a verify step's rows would differ (SmolLM2 and
    Gemma 3 without flash attention), every guess is stripped, and the singles still compute as alone."""
    got = run_verify_probe(settings)
    assert got["moved"] == []
    assert got["verify_exact"] == (settings.get("flash_attn", True) or "model" not in settings)
    assert got["rows"] >= 2 * got["steps"]
    if got["verify_exact"]:
        assert got["cut"] > 0 or got["lone_exact"]  # a lone row measured to compute as one beside others: no cut
        assert got["rows"] > 2 * got["steps"] + 10
    else:
        assert got["cut"] == got["guesses"]  # every guess stripped


@pytest.mark.parametrize("settings", [
    {"flash_attn": False, "force_paired": True},
    pytest.param({"model": "smollm2", "flash_attn": False, "paired_steps": True}, marks=pytest.mark.slow),
    pytest.param({"model": "gemma3-270m", "flash_attn": False, "paired_steps": True}, marks=pytest.mark.slow),
], ids=["tiny llama, paired", "smollm2 without flash attention, paired", "gemma 3 without flash attention, paired"])
def test_paired_steps_verify_every_guess_bit_for_bit_where_one_row_computes_otherwise(settings):
    """``paired_steps``: every generating sequence evaluates two rows or more a step (a single gets a throwaway
    row in its own stream, a verify step of an odd number of rows one more), so its one-token steps compute
    as verify steps do. On SmolLM2 and Gemma 3 without flash attention, where a verify step's rows differ
    from one-token steps (the test above: every guess stripped), the load measures the paired layout exact
    and every guess of the plan is verified, bit for bit against the paired one-token steps alone, beside
    others and with gaps in the ids, and none is cut (every stream's rows come in even numbers). The tiny
    llama needs no pairing (its verify rows are exact unpaired), so its run forces the layout on, with
    logits on the throwaway rows (its F16 weights compute one output row otherwise than two)."""
    got = run_verify_probe(settings)
    assert got["paired"] and got["verify_exact"]
    assert got["moved"] == []
    assert got["cut"] == 0 and got["rows"] == got["planned_rows"]


def test_paired_steps_stay_off_where_verify_steps_are_exact_unpaired():
    """The tiny llama's verify rows compute as its one-token steps without pairing: the setting then changes
    nothing, and ``/health`` says so; off by default."""
    plain = {k: v for k, v in tiny_model_settings().items() if k != "paired_steps"}
    assert ModelSettings(**plain).paired_steps is False
    b = tiny_backend(True, flash_attn=False, paired_steps=True)
    try:
        assert b._verify_exact and not b._paired and b.describe()["paired_steps"] is False
    finally:
        b.close()
