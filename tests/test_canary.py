"""The handoff canary (kv/canary.py): the comparison, the tolerances, and real servers refusing
an intact-but-wrong KV state, with the client recomputing it."""
from __future__ import annotations

import io
import json
import re
import warnings

import numpy as np
import pytest

from disaggregated_inference import config as cluster_config
from disaggregated_inference.client import KV_LOST_CODES, DisaggregatedClient
from disaggregated_inference.errors import BundleError, CanaryMismatch, ConfigError, from_body
from disaggregated_inference.kv import bundle
from disaggregated_inference.kv.canary import CanaryPolicy, compare, fingerprint, log_softmax
from disaggregated_inference.testing.bundles import read_bundle, to_bytes

from .conftest import cluster_config_dict


def logits_with(top: dict, n: int = 1000, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).normal(size=n).astype(np.float32)
    for i, v in top.items():
        x[i] = v
    return x


def roundtrip(canary: dict) -> dict:
    return json.loads(json.dumps(canary))  # as it travels in the bundle header


# -- the comparison -------------------------------------------------------------------------------

def test_the_fingerprint_is_the_top_k_log_probs_likeliest_first():
    x = logits_with({7: 9.0, 3: 8.0, 500: 7.5})
    c = fingerprint(x, 3, "llama_cpp/cpu")
    assert c["ids"] == [7, 3, 500] and c["k"] == 3 and c["engine"] == "llama_cpp/cpu"
    lp = log_softmax(x)
    assert c["logprobs"] == pytest.approx([lp[7], lp[3], lp[500]], abs=0)
    assert np.exp(lp).sum() == pytest.approx(1.0)


def test_identical_logits_compare_as_zero_after_travelling_as_json_and_a_constant_shift_changes_nothing():
    x = logits_with({7: 9.0, 3: 8.0})
    sent = roundtrip(fingerprint(x, 8, "e"))
    assert compare(sent, x) == (True, 0.0)
    top1, divergence = compare(sent, x + np.float32(3.0))
    assert top1 and divergence < 1e-5


def test_divergence_is_the_largest_log_prob_difference_over_the_prefill_top_k():
    x = logits_with({7: 9.0, 3: 8.0, 11: 7.0})
    sent = fingerprint(x, 3, "e")
    y = x.copy()
    y[11] += 0.3  # the third token gains; everything else renormalises a little
    top1, divergence = compare(sent, y)
    expected = np.max(np.abs(log_softmax(y)[[7, 3, 11]] - log_softmax(x)[[7, 3, 11]]))
    assert top1 and divergence == pytest.approx(expected) and divergence > 0.2


def test_a_token_only_the_decode_side_ranks_high_counts_by_how_far_it_rose_above_the_prefill_floor():
    x = logits_with({7: 9.0, 3: 8.0, 11: 7.0})
    sent = fingerprint(x, 3, "e")
    y = x.copy()
    y[42] = 12.0  # unseen by the prefill's top-3: now the likeliest
    top1, divergence = compare(sent, y)
    lp = log_softmax(y)
    assert not top1
    assert divergence >= lp[42] - min(sent["logprobs"]) - 1e-9 and divergence > 2


def test_a_malformed_canary_is_a_mismatch_not_a_crash():
    x = logits_with({})
    with pytest.raises(CanaryMismatch):
        compare({"ids": [1, 2], "logprobs": [0.0]}, x)
    with pytest.raises(CanaryMismatch, match="vocabulary"):
        compare({"ids": [len(x) + 5], "logprobs": [0.0]}, x)


# -- the tolerances -------------------------------------------------------------------------------

def test_the_tolerance_depends_on_the_engine_pair_and_on_whether_the_restore_is_exact():
    policy = CanaryPolicy(tolerance=0.5, cross_tolerance=1.0, exact_tolerance=1e-4,
                          pairs=({"prefill": "llama_cpp/gpu", "decode": "llama_cpp/cpu", "tolerance": 0.8},))
    assert policy.tolerance_for("llama_cpp/cpu", "llama_cpp/cpu") == 0.5
    assert policy.tolerance_for("llama_cpp/cpu", "llama_cpp/cpu", exact=True) == 1e-4
    assert policy.tolerance_for("llama_cpp/gpu", "llama_cpp/cpu", exact=True) == 0.8
    assert policy.tolerance_for("mlx/metal", "llama_cpp/cpu") == 1.0


def test_check_reports_figures_within_tolerance_and_refuses_beyond_it():
    x = logits_with({7: 9.0, 3: 8.0, 11: 7.0})
    policy = CanaryPolicy(tolerance=0.5, exact_tolerance=1e-4)
    sent = roundtrip(policy.make(x, "llama_cpp/cpu", alone=True))
    y = x.copy()
    y[11] += 0.3
    figures = policy.check(sent, y, "llama_cpp/cpu")  # batched on this side: the loose tolerance
    assert figures["canary"] == "passed" and figures["canary_top1_match"] is True
    assert 0.2 < figures["canary_divergence"] <= 0.5 and figures["canary_tolerance"] == 0.5
    with pytest.raises(CanaryMismatch) as caught:  # both alone, exact restore: the same change is refused
        policy.check(sent, y, "llama_cpp/cpu", exact=True)
    assert caught.value.details["canary_tolerance"] == 1e-4 and caught.value.status == 422
    assert policy.check({}, y, "llama_cpp/cpu").as_dict() == {"canary": "absent"}


def test_the_exact_tolerance_needs_the_same_thread_count_on_both_sides():
    x = logits_with({7: 9.0, 3: 8.0, 11: 7.0})
    y = x.copy()
    y[11] += 0.1
    policy = CanaryPolicy(tolerance=0.5, exact_tolerance=1e-4)
    sent = roundtrip(policy.make(x, "llama_cpp/cpu", alone=True, threads=2))
    assert sent["threads"] == 2
    with pytest.raises(CanaryMismatch):
        policy.check(sent, y, "llama_cpp/cpu", exact=True, threads=2)
    assert policy.check(sent, y, "llama_cpp/cpu", exact=True, threads=1)["canary_tolerance"] == 0.5
    # a canary that names no thread count (an older prefill server) is not held to bit-exactness
    unnamed = roundtrip(policy.make(x, "llama_cpp/cpu", alone=True))
    assert "threads" not in unnamed
    assert policy.check(unnamed, y, "llama_cpp/cpu", exact=True, threads=2)["canary_tolerance"] == 0.5


def test_the_exact_tolerance_needs_both_sides_batch_invariant_or_both_not():
    """A batch-invariant step computes even a lone token as it computes one among others, which a plain
    step alone does not: exact only when both sides' steps were of the same kind."""
    x = logits_with({7: 9.0, 3: 8.0, 11: 7.0})
    y = x.copy()
    y[11] += 0.1
    policy = CanaryPolicy(tolerance=0.5, exact_tolerance=1e-4)
    invariant = roundtrip(policy.make(x, "llama_cpp/cpu", alone=True, threads=2, deterministic=True))
    assert invariant["deterministic"] is True
    with pytest.raises(CanaryMismatch):
        policy.check(invariant, y, "llama_cpp/cpu", exact=True, threads=2, deterministic=True)
    assert policy.check(invariant, y, "llama_cpp/cpu", exact=True, threads=2)["canary_tolerance"] == 0.5
    plain = roundtrip(policy.make(x, "llama_cpp/cpu", alone=True, threads=2))
    assert "deterministic" not in plain
    assert policy.check(plain, y, "llama_cpp/cpu", exact=True, threads=2, deterministic=True)["canary_tolerance"] == 0.5
    # paired steps compute a token otherwise than unpaired batch-invariant ones: exact only beside paired
    paired = roundtrip(policy.make(x, "llama_cpp/cpu", alone=True, threads=2, deterministic="paired"))
    assert paired["deterministic"] == "paired"
    with pytest.raises(CanaryMismatch):
        policy.check(paired, y, "llama_cpp/cpu", exact=True, threads=2, deterministic="paired")
    assert policy.check(paired, y, "llama_cpp/cpu", exact=True, threads=2, deterministic=True)["canary_tolerance"] == 0.5
    assert policy.check(invariant, y, "llama_cpp/cpu", exact=True, threads=2,
                        deterministic="paired")["canary_tolerance"] == 0.5


@pytest.mark.slow  # SmolLM2 in process, twice
def test_a_handoff_between_cpu_contexts_of_different_thread_counts_passes_at_the_same_engine_tolerance():
    """Measured: ggml's CPU attention splits one query's cells over its threads past a few hundred
    cells, so a 301-token SmolLM2 state prefilled with 2 threads and continued with 1 gives a
    divergence of ~0.15 with both canary steps alone; with the same count it is 0. Before the
    canary carried ``threads``, the exact tolerance refused every such handoff (a prefill server
    and a decode server sized for their own machines)."""
    from disaggregated_inference.backends import ModelSettings, create
    from disaggregated_inference.backends.base import Prompt, Received, Sampling

    # plain steps: a lone token's attention split over the threads (with ``deterministic`` its padding row
    # keeps it off that path: the two contexts measured 0.0 apart on this prompt)
    two, one = (create(ModelSettings(model="smollm2", n_threads=n, n_ctx=1024, flash_attn=True, parallel=1,
                                     deterministic=False)) for n in (2, 1))
    try:
        for backend in (two, one):
            backend.load()
        prompt = Prompt(text="The quarterly sales report lists revenue by region, product line and month, " * 20)
        _, prefilled = two.run(two.prefill(prompt))
        assert prefilled.meta["canary"]["threads"] == 2 and len(prefilled.tokens) > 256

        def continued(backend) -> dict:
            received = Received(kind=prefilled.kind, tokens=prefilled.tokens, payload=prefilled.payload,
                                fingerprint=prefilled.fingerprint, meta=prefilled.meta)
            events, _ = backend.run(backend.decode(received, Sampling(max_new_tokens=1, temperature=0), lambda: False))
            return next(e.metrics for e in events if e.metrics)

        same, other = continued(two), continued(one)
        assert same["canary_tolerance"] == 1e-4 and same["canary_divergence"] == 0.0
        assert other["canary"] == "passed" and other["canary_tolerance"] == 0.5
        assert 0 < other["canary_divergence"] <= 0.5
    finally:
        for backend in (two, one):
            backend.close()


def test_a_canary_mismatch_travels_as_its_own_code_and_the_client_treats_it_as_a_lost_kv():
    err = from_body(422, CanaryMismatch("wrong state", field="kv", canary_divergence=3.0).to_dict())
    assert isinstance(err, CanaryMismatch) and isinstance(err, BundleError)
    assert err.code == "canary_mismatch" and err.details["canary_divergence"] == 3.0
    assert "canary_mismatch" in KV_LOST_CODES


@pytest.mark.parametrize("server, says", [
    ({"canary_tolerance": -1}, "server.canary_tolerance"),
    ({"canary_top_k": -2}, "server.canary_top_k"),
    ({"canary_pairs": [{"prefill": "llama_cpp/gpu", "decode": "llama_cpp/cpu"}]}, "server.canary_pairs"),
    ({"canary_pairs": [{"prefill": "a", "decode": "b", "tolerance": "high"}]}, "server.canary_pairs"),
    ({"canary_toleranse": 1.0}, "server.canary_toleranse"),
])
def test_bad_canary_settings_are_refused_on_load_naming_the_key(server, says):
    data = cluster_config_dict()
    data["server"].update(server)
    with pytest.raises(ConfigError) as caught:
        cluster_config.from_dict(data)
    assert caught.value.field == says


# -- real servers ---------------------------------------------------------------------------------

PROMPT = ("The quarterly sales report lists revenue by region, product line and month, with notes on "
          "returns and discounts. " * 6 + "\nSummarise the report above in one sentence.")


def canary_counts(http, decode_url: str) -> dict:
    text = http.get(f"{decode_url}/metrics").text
    counts = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^disagg_canary_checks_total\{result="(\w+)"\} (\S+)$', text, re.M)}
    failures = re.search(r"^disagg_canary_failures_total (\S+)$", text, re.M)
    counts["failures"] = float(failures.group(1)) if failures else 0.0
    return counts


def damaged_bundle(raw: bytes) -> bytes:
    """The bundle with its KV's last 1% zeroed (values of the last layer's latest cells) and its
    checksum recomputed: framing, sizes and CRC all pass; only the state is wrong."""
    header, tokens, payload = read_bundle(io.BytesIO(raw))
    payload = bytearray(payload)
    cut = len(payload) - len(payload) // 100
    payload[cut:] = bytes(len(payload) - cut)
    header.payload_crc32c = bundle.payload_checksum(payload)
    return to_bytes(header, tokens, bytes(payload))


ROPE_BASE = 10000.0  # Llama 2's RoPE base; SmolLM2 was trained with 100,000 (its GGUF's llama.rope.freq_base)


@pytest.fixture(scope="module")
def other_rope_base():
    """SmolLM2 loaded in this process as the "qwen" servers load it, except that its context runs under
    RoPE base ROPE_BASE (llama.cpp's ``--rope-freq-base``, which no config key sets here): the same
    file, settings and fingerprint, other rotary positions in every K it caches."""
    import llama_cpp

    from disaggregated_inference.backends.base import ModelSettings
    from disaggregated_inference.backends.llama_cpp import LlamaCppBackend

    defaults = llama_cpp.llama_context_default_params

    def with_other_rope_base():
        params = defaults()
        params.rope_freq_base = ROPE_BASE
        return params

    backend = LlamaCppBackend(ModelSettings.from_dict({**cluster_config_dict()["models"]["qwen"], "parallel": 1}))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llama_cpp, "llama_context_default_params", with_other_rope_base)
        backend.load()
    yield backend
    backend.close()


def rope_bundle(backend, raw: bytes) -> bytes:
    """The bundle with its state replaced by the state of the same tokens that ``backend`` (another RoPE
    base) computes, and its checksum recomputed: header, canary, token ids and size are the real ones."""
    header, tokens, payload = read_bundle(io.BytesIO(raw))
    assert backend.fingerprint() == header.fingerprint  # the fingerprint cannot tell: forced through by design
    with backend.sequence() as seq:
        backend.logits(seq, tokens[:-1])  # what a prefill evaluates: all but the last token
        state = bytes(backend.export_state(seq))
    assert len(state) == len(payload) and state != bytes(payload)
    header.payload_crc32c = bundle.payload_checksum(state)
    return to_bytes(header, tokens, state)


@pytest.fixture(params=["zeroed-tail", "other-rope-base"])
def wrong_state(request):
    """``(name, make)``: ``make(raw bundle) -> bytes``, a checksum-valid bundle whose state is wrong."""
    if request.param == "zeroed-tail":
        return request.param, damaged_bundle
    backend = request.getfixturevalue("other_rope_base")
    return request.param, lambda raw: rope_bundle(backend, raw)


@pytest.mark.slow
def test_every_handoff_carries_a_canary_and_an_unloaded_one_matches_bit_for_bit(cluster):
    with DisaggregatedClient(cluster.config, health_check=False) as client:
        client.check_health()
        for model in ("qwen", "gpt-oss"):
            _, m = client.generate(model, PROMPT, max_tokens=4)
            assert m["method"] == "kv_handoff", m
            assert m["canary"] == "passed" and m["canary_top1_match"] is True, m
            # one request at a time: both sides evaluate the token alone, so the exact tolerance applies
            # (not to Gemma's sliding window: backends/llama_handoff.py, _restores_exactly)
            assert m["canary_divergence"] <= 1e-4, m
            assert m["canary_tolerance"] == pytest.approx(1e-4 if model == "qwen" else 0.5), m
            assert m["canary_ms"] > 0


@pytest.mark.slow
def test_a_checksum_valid_but_wrong_state_is_refused_by_the_canary(http, qwen_prefill, qwen_decode, bytes_server,
                                                                   wrong_state):
    name, make = wrong_state
    before = canary_counts(http, qwen_decode)
    pre = http.post(f"{qwen_prefill}/prefill", json={"prompt": PROMPT}).json()
    assert pre["metrics"]["canary_ms"] > 0
    handle = f"canary-{name}"
    url = bytes_server(f"/kv/{handle}", make(http.get(pre["kv"]["url"]).content))
    resp = http.post(f"{qwen_decode}/decode", json={"kv": {"url": url, "handle": handle}, "max_new_tokens": 8})
    assert resp.status_code == 422, resp.text
    body = resp.json()
    assert body["code"] == "canary_mismatch" and body["canary_divergence"] > body["canary_tolerance"], body
    after = canary_counts(http, qwen_decode)
    assert after["failures"] == before["failures"] + 1
    assert after.get("failed", 0) == before.get("failed", 0) + 1


@pytest.mark.slow
def test_the_client_recomputes_a_state_its_canary_refused_and_answers_right(
        cluster, http, qwen_decode, bytes_server, wrong_state, monkeypatch):
    name, make = wrong_state
    with DisaggregatedClient(cluster.config, health_check=False) as client:
        client.check_health()
        client.handoff_mode = "whole"  # the wrong states are made from whole bundles (a streamed one: its own test)
        expected, clean = client.generate("qwen", PROMPT, max_tokens=12)
        assert clean["canary"] == "passed"
        before = canary_counts(http, qwen_decode)

        real_post, damaged = client._post, []

        def post(server, path, body, timeout):
            answer = real_post(server, path, body, timeout)
            if path == "/prefill" and not damaged:  # the first handoff's KV goes wrong on the way
                handle = f"client-canary-{name}"
                url = bytes_server(f"/kv/{handle}", make(http.get(answer["kv"]["url"]).content))
                answer["kv"] = {"url": url, "handle": handle}
                damaged.append(handle)
            return answer

        monkeypatch.setattr(client, "_post", post)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a recompute, not the decode-only fallback
            text, m = client.generate("qwen", PROMPT, max_tokens=12)
    assert damaged, "the damaged bundle was never handed over"
    assert text == expected
    assert m["method"] == "kv_handoff" and m["canary"] == "passed"
    assert any("does not reproduce the prefill's next-token distribution" in w for w in m["warnings"]), m["warnings"]
    after = canary_counts(http, qwen_decode)
    assert after["failures"] == before["failures"] + 1
    assert after["passed"] == before["passed"] + 1
