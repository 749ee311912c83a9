"""Engine pairs through real gunicorn servers: llama.cpp, MLX and transformers prefill -> MLX decode, and
MLX and transformers prefill -> llama.cpp decode.

Model "smol" pairs a llama.cpp prefill server with an MLX decode server (the client asks the
prefill server for neutral_kv because the decode server's /health accepts only that);
"smol-mlx" pairs two MLX servers; "smol-tf" a transformers prefill server (PyTorch, CPU) with
an MLX decode server, which permutes K from transformers' head-dim order on import (where torch
is not installed, that pair is left out of the cluster and its case skipped). Each continues the
prompt after one recomputed token, with MLX's own greedy text for N_TOKENS tokens.

"decode-llama" (model key "smol-llama", a llama.cpp decode server with no prefill server of its own)
continues the neutral bundles of the MLX and transformers prefill servers: llama.cpp computes with
the GGUF's quantized weights, they with its float32 dequantisation, so the canary is held to
LLAMA_TOLERANCE (tests/test_vllm_e2e.py says what was measured) and the greedy text, on LONG_PROMPT,
to llama.cpp's own.
"""
from __future__ import annotations

import importlib.util
import io
import json

import pytest

pytest.importorskip("mlx_lm")

from disaggregated_inference.testing.bundles import read_bundle  # noqa: E402

from .conftest import THREADS  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT = "Name two uses of a pandas groupby."
N_TOKENS = 8
HAS_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
# The largest log-prob difference over the top-8 (the canary's divergence) between transformers' own
# next-token distribution and MLX's after importing transformers' KV: both run the same float32
# weights, so only kernel rounding separates them (measured 3.7e-5 in process on this prompt; a K
# left in the wrong head-dim order moves the logits by 5.6 mean abs). The canary's own cross-engine
# tolerance is 1.0; this test holds the pair to 1e-3.
TF_CANARY_TOLERANCE = 1e-3
LONG_PROMPT = "Explain what a confusion matrix shows, and how precision and recall are computed from it. " * 6
LLAMA_TOLERANCE = 0.75


def engines_config() -> dict:
    model = {"backend": "llama_cpp", "model": "smollm2", "n_ctx": 2048, "n_threads": THREADS}
    config = {
        "models": {"smol": dict(model), "smol-mlx": dict(model, backend="mlx"), "smol-llama": dict(model)},
        "prefill_servers": [
            {"name": "prefill-llama", "host": "127.0.0.1", "port": 18110, "model": "smol"},
            {"name": "prefill-mlx", "host": "127.0.0.1", "port": 18111, "model": "smol-mlx"},
        ],
        "decode_servers": [
            {"name": "decode-mlx", "host": "127.0.0.1", "port": 18112, "model": "smol", "backend": "mlx"},
            {"name": "decode-mlx-2", "host": "127.0.0.1", "port": 18113, "model": "smol-mlx"},
            {"name": "decode-llama", "host": "127.0.0.1", "port": 18116, "model": "smol-llama"},
        ],
        "client": {"prefill_timeout": 120, "decode_timeout": 300, "health_check_interval": 0, "retries": 1},
        "server": {"lease_seconds": 60, "queue_timeout": 120},
    }
    if HAS_TORCH:  # one torch thread: every server of the module shares this machine's cores
        config["models"]["smol-tf"] = dict(model, backend="transformers", device="cpu", n_threads=1)
        config["prefill_servers"].append({"name": "prefill-tf", "host": "127.0.0.1", "port": 18114, "model": "smol-tf"})
        config["decode_servers"].append({"name": "decode-mlx-3", "host": "127.0.0.1", "port": 18115,
                                         "model": "smol-tf", "backend": "mlx"})
    return config


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from disaggregated_inference.ops.cluster import LocalCluster

    with LocalCluster(engines_config(), free_ports=True, log_dir=tmp_path_factory.mktemp("engine-logs")) as running:
        running.wait_healthy(timeout=900)
        yield running


@pytest.fixture(scope="module")
def urls(engines) -> dict:
    return {p.entry.name: p.url for p in engines.processes}


def test_decode_server_advertises_the_kinds_it_accepts(urls, http):
    health = http.get(urls["decode-mlx"] + "/health", timeout=30).json()
    assert health["backend"] == "mlx" and health["accepts"] == ["neutral_kv", "token_ids"]
    assert "llama_seq_state" in http.get(urls["prefill-llama"] + "/health", timeout=30).json()["accepts"]


NEEDS_TORCH = pytest.mark.skipif(not HAS_TORCH, reason="torch and transformers are not installed")
DECODE = {"smol": "decode-mlx", "smol-mlx": "decode-mlx-2", "smol-tf": "decode-mlx-3"}


@pytest.mark.parametrize("model,prefill", [("smol", "prefill-llama"), ("smol-mlx", "prefill-mlx"),
                                           pytest.param("smol-tf", "prefill-tf", marks=NEEDS_TORCH)])
def test_pair_continues_with_one_recomputed_token_as_mlx_generates(engines, urls, http, model, prefill):
    from disaggregated_inference.client import DisaggregatedClient

    decode = DECODE[model]
    own = http.post(urls[decode] + "/generate", json={"prompt": PROMPT, "max_new_tokens": N_TOKENS,
                                                       "temperature": 0}, timeout=300).json()
    client = DisaggregatedClient(engines.config)
    client.check_health()  # what the periodic checks do: the decode server's "accepts" picks the kind
    text, metrics = client.generate(model=model, prompt=PROMPT, max_tokens=N_TOKENS, temperature=0)
    assert metrics["method"] == "kv_handoff", metrics
    assert metrics["prompt_tokens_recomputed"] == 1
    assert metrics["prefill_server"].endswith(urls[prefill].rsplit(":", 1)[1])
    assert text == own["generated_text"] and text
    assert metrics["canary"] == "passed" and metrics["canary_top1_match"] is True
    if model == "smol-tf":
        assert metrics["canary_divergence"] < TF_CANARY_TOLERANCE, metrics
    # a stream asks for the same kind: the MLX decode server continues it the same way
    *pieces, streamed = client.stream(model=model, prompt=PROMPT, max_tokens=N_TOKENS, temperature=0)
    assert streamed["method"] == "kv_handoff" and streamed["prompt_tokens_recomputed"] == 1, streamed
    assert "".join(pieces) == text


def test_llama_prefill_converts_on_request_and_refuses_other_kinds(urls, http):
    body = {"prompt": PROMPT}
    native = http.post(urls["prefill-llama"] + "/prefill", json=body, timeout=120).json()
    assert native["handoff"] == "llama_seq_state"
    converted = http.post(urls["prefill-llama"] + "/prefill", json={**body, "kv_kind": "neutral_kv"}, timeout=120).json()
    assert converted["handoff"] == "neutral_kv" and converted["metrics"]["kv_convert_time"] >= 0
    refused = http.post(urls["prefill-mlx"] + "/prefill", json={**body, "kv_kind": "llama_seq_state"}, timeout=120)
    assert refused.status_code == 400 and refused.json()["field"] == "kv_kind"
    bad = http.post(urls["prefill-llama"] + "/prefill", json={**body, "kv_kind": "pickle"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["field"] == "kv_kind"
    # an MLX decode server refuses llama.cpp's own state: its fingerprint names another engine
    answer = http.post(urls["decode-mlx"] + "/decode", json={"kv": native["kv"], "max_new_tokens": 2}, timeout=120)
    assert answer.status_code == 409 and answer.json()["field"] == "fingerprint"
    assert "backend: bundle has 'llama_cpp', this server has 'mlx'" in json.dumps(answer.json())


@NEEDS_TORCH
def test_transformers_prefill_hands_over_halves_order_k_and_names_what_it_ran(urls, http):
    health = http.get(urls["prefill-tf"] + "/health", timeout=30).json()
    assert health["backend"] == "transformers"
    assert health["fingerprint"]["weights_from"] == "gguf" and health["fingerprint"]["device"] == "cpu"
    mlx_health = http.get(urls["decode-mlx-3"] + "/health", timeout=30).json()
    assert health["fingerprint"]["model_sha256"] == mlx_health["fingerprint"]["model_sha256"]
    answer = http.post(urls["prefill-tf"] + "/prefill", json={"prompt": PROMPT}, timeout=120).json()
    assert answer["handoff"] == "neutral_kv", answer
    refused = http.post(urls["prefill-tf"] + "/prefill", json={"prompt": PROMPT, "kv_kind": "llama_seq_state"},
                        timeout=120)
    assert refused.status_code == 400 and refused.json()["field"] == "kv_kind"
    # the bundle itself: K in halves order with neox rope, as the in-process test measured
    got = http.get(answer["kv"]["url"], timeout=60)
    header, tokens, payload = read_bundle(io.BytesIO(got.content))
    meta = header.meta["neutral"]
    assert meta["head_dim_order"] == "halves" and meta["rope"]["style"] == "neox" and meta["dtype"] == "f32"
    assert header.meta["canary"]["engine"] == "transformers/cpu"
    assert len(payload) == meta["n_layer"] * 2 * meta["n_kv_heads"] * (len(tokens) - 1) * meta["head_dim_k"] * 4


@pytest.mark.parametrize("prefill, mode", [("prefill-mlx", "streamed"), pytest.param("prefill-tf", "whole", marks=NEEDS_TORCH),
                                           pytest.param("prefill-tf", "streamed", marks=NEEDS_TORCH)])
def test_llama_cpp_decode_continues_another_engines_neutral_kv(urls, http, prefill, mode):
    pre = http.post(urls[prefill] + "/prefill", json={"prompt": LONG_PROMPT, "raw": True, "handoff_mode": mode},
                    timeout=120).json()
    assert pre["handoff"] == "neutral_kv"
    # transformers streams its KV layer by layer; MLX, asked to, hands it over whole and says why
    streams = mode == "streamed" and prefill == "prefill-tf"
    assert pre["kv"]["mode"] == ("streamed" if streams else "whole"), pre
    if mode == "streamed" and not streams:
        assert pre["metrics"]["handoff_mode"] == "whole" and pre["metrics"]["handoff_mode_reason"], pre
    body = {"max_new_tokens": N_TOKENS, "temperature": 0}
    answer = http.post(urls["decode-llama"] + "/decode", json={"kv": pre["kv"], **body}, timeout=300).json()
    m = answer["metrics"]
    if streams:  # llama.cpp takes a neutral stream whole before converting it; the prefill's figures from its end
        assert m["handoff_mode"] == "streamed" and m["prefill_metrics"]["handoff_mode"] == "streamed", m
    assert m["method"] == "kv_handoff" and m["handoff"] == "neutral_kv" and m["prompt_tokens_recomputed"] == 1, m
    assert m["canary"] == "passed" and m["canary_divergence"] < LLAMA_TOLERANCE, m
    assert m["kv_convert_time"] > 0  # float32 -> the f16 cache (and, from transformers, K into interleaved order)
    own = http.post(urls["decode-llama"] + "/generate", json={"prompt": LONG_PROMPT, "raw": True, **body},
                    timeout=300).json()
    assert answer["generated_text"] == own["generated_text"] and own["generated_text"]


def test_json_schema_is_refused_with_400(urls, http):
    answer = http.post(urls["decode-mlx"] + "/generate", json={"prompt": PROMPT, "json_schema": {"type": "object"}},
                       timeout=120)
    assert answer.status_code == 400 and answer.json()["field"] == "json_schema"


def test_ignore_eos_is_refused_where_the_backend_cannot_honour_it(urls, http):
    answer = http.post(urls["decode-mlx"] + "/generate", json={"prompt": PROMPT, "ignore_eos": True}, timeout=120)
    assert answer.status_code == 400 and answer.json()["field"] == "ignore_eos"
    assert "mlx" in answer.json()["error"]


def test_servers_end_by_themselves_on_sigterm(engines):
    """Last in this module: stopping ends each server by its own exit path, status 0. An MLX server
    used to abort at exit ("terminate called without an active exception": its model's thread was
    still alive) and then spend seconds in torch's static destructors, so the launcher's 15 s wait
    ended in SIGKILL (-9) and every teardown of this module took a minute."""
    for name in ("decode-mlx-2", "prefill-mlx", "prefill-llama"):
        process = engines.process(name)
        process.stop()
        assert process.proc.returncode == 0, (name, process.proc.returncode, process.log_tail())
        assert "terminate called" not in process.log_path.read_text(errors="replace")
