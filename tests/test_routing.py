"""Conditional disaggregation (routing.py): the cost model's decisions, and the client choosing per request."""
from __future__ import annotations

import uuid
import warnings

import pytest

from disaggregated_inference import config as cluster_config
from disaggregated_inference.client import DisaggregatedClient
from disaggregated_inference.errors import BadRequest, ConfigError
from disaggregated_inference.metrics import ServerFigures
from disaggregated_inference.routing import HANDOFF, LOCAL, CostModel, prompt_chars

from .conftest import cluster_config_dict

FEW = "Say OK."                      # a handful of tokens
LONG = "word " * 2000                 # ~2k tokens as far as the prior's 4 characters per token go


def handoff(model: CostModel, tokens: int, prefill_speed: float, kv_per_token: int = 40_000,
            link: float = 2e9, fixed: float = 0.03, chars: int | None = None) -> None:
    """Feed one handoff's figures: ``tokens`` evaluated at ``prefill_speed``, the KV over ``link`` bytes/s."""
    took = tokens / prefill_speed
    kv = tokens * kv_per_token
    pre = {"prompt_tokens": tokens + 1, "prompt_tokens_evaluated": tokens, "prefill_time": took,
           "kv_export_time": 0.0, "kv_checksum_time": 0.0}
    dec = {"prompt_tokens": tokens + 1, "kv_bytes": kv, "kv_transfer_time": kv / link, "kv_load_time": 0.0,
           "first_token_time": 0.01}
    model.observe("m", chars or 4 * (tokens + 1), HANDOFF, "p", "d", ServerFigures(**pre), ServerFigures(**dec),
                  fixed + took + kv / link + 0.01)


def local(model: CostModel, tokens: int, speed: float, fixed: float = 0.005) -> None:
    took = tokens / speed
    dec = {"prompt_tokens": tokens + 1, "prefill_time": took, "first_token_time": 0.01}
    model.observe("m", 4 * (tokens + 1), LOCAL, None, "d", ServerFigures(), ServerFigures(**dec),
                  fixed + took + 0.01)


def test_the_cold_start_prior_keeps_a_few_tokens_local_and_hands_a_long_prompt_off():
    model = CostModel()
    few = model.decide("auto", "m", len(FEW), "p", "d")
    assert few.path == LOCAL and few.estimates[LOCAL] < few.estimates[HANDOFF]
    assert few.estimates["basis"] == "prior"
    long = model.decide("auto", "m", len(LONG), "p", "d")
    assert long.path == HANDOFF and long.estimates["prompt_tokens"] == 2500
    assert "handoff" in long.reason and "decode-only" in long.reason and "prior" in long.reason


def test_a_fast_prefill_machine_gets_long_prompts_and_short_ones_stay_local():
    model = CostModel()
    for _ in range(3):
        handoff(model, 2000, prefill_speed=8000)   # a GPU
        local(model, 500, speed=400)               # a laptop CPU
    assert model.decide("auto", "m", 4 * 2000, "p", "d").path == HANDOFF
    assert model.decide("auto", "m", 4 * 8, "p", "d").path == LOCAL
    assert model.decide("auto", "m", 4 * 8, "p", "d").estimates["basis"] == "measured"


def test_on_equal_machines_the_handoff_never_pays_and_everything_stays_local():
    model = CostModel()
    for _ in range(3):
        handoff(model, 2000, prefill_speed=300)
        local(model, 2000, speed=300)
    for chars in (40, 4000, 14000):
        assert model.decide("auto", "m", chars, "p", "d").path == LOCAL


def test_a_slow_link_makes_a_fast_prefill_server_not_worth_it():
    model = CostModel()
    for _ in range(3):
        handoff(model, 2000, prefill_speed=8000, kv_per_token=200_000, link=20e6)  # 10 s per 2k-token KV
        local(model, 2000, speed=400)
    decision = model.decide("auto", "m", 4 * 2000, "p", "d")
    assert decision.path == LOCAL
    assert decision.estimates["link_bytes_per_s"] == pytest.approx(20e6, rel=0.01)
    assert decision.estimates["kv_bytes_per_token"] == 200_000


def test_a_queue_on_the_prefill_server_tips_the_choice():
    model = CostModel()
    for _ in range(3):
        handoff(model, 2000, prefill_speed=1000)
        local(model, 2000, speed=400)
    assert model.decide("auto", "m", 4 * 2000, "p", "d").path == HANDOFF
    queued = model.decide("auto", "m", 4 * 2000, "p", "d", prefill_queue=3)
    assert queued.path == LOCAL and queued.estimates["prefill_wait"] == pytest.approx(6.0)


def test_prompts_ahead_on_the_decode_server_count_against_decode_only():
    model = CostModel()
    for _ in range(3):  # equal machines: the handoff's extra round trip does not pay
        handoff(model, 2000, prefill_speed=1000)
        local(model, 2000, speed=1000)
    assert model.decide("auto", "m", 4 * 2000, "p", "d").path == LOCAL
    busy = model.decide("auto", "m", 4 * 2000, "p", "d", decode_queue=2)  # two of ours evaluate there first
    assert busy.path == HANDOFF and busy.estimates["decode_wait"] == pytest.approx(4.0)
    both = model.decide("auto", "m", 4 * 2000, "p", "d", prefill_queue=3, decode_queue=2)
    assert both.path == LOCAL and both.estimates["prefill_wait"] == pytest.approx(6.0)
    fresh = CostModel().decide("auto", "m", 4 * 2000, "p", "d", prefill_queue=2)  # nothing measured:
    assert fresh.estimates["prefill_wait"] == pytest.approx(2 * 1999 / fresh.estimates["prefill_speed"])  # its own


def test_the_client_counts_every_prompt_it_has_on_a_server_as_ahead_in_a_slot_or_not():
    """A batched prefill server evaluates prompts oldest first: one of ours in a slot is ahead all the
    same (its streamed /prefill call has answered, so the call count says nothing)."""
    cfg = cluster_config.coerce(cluster_config_dict())
    with DisaggregatedClient(cfg, health_check=False) as client:
        client.route = "auto"
        prefill = next(s for s in client.servers.values() if s.entry.role == "prefill" and s.entry.model == "qwen")
        decode = next(s for s in client.servers.values() if s.entry.role == "decode" and s.entry.model == "qwen")
        prefill.health = {"slots": {"total": 4, "queued": 0}}
        decode.health = {"slots": {"total": 4}}
        assert client._route("qwen", {"prompt": LONG}, None).estimates["prefill_wait"] == 0
        prefill.prompting = 3  # in its slots
        ahead = client._route("qwen", {"prompt": LONG}, None).estimates
        tokens = ahead["prompt_tokens"] - 1  # this prompt's own time stands in for each, nothing measured yet
        assert ahead["prefill_wait"] == pytest.approx(3 * tokens / ahead["prefill_speed"], rel=1e-3)
        prefill.prompting, prefill.health = 6, {"slots": {"total": 4, "queued": 3}}  # 2 of the 3 queued are ours
        assert client._route("qwen", {"prompt": LONG}, None).estimates["prefill_wait"] == pytest.approx(
            7 * tokens / ahead["prefill_speed"], rel=1e-3)
        decode.prompting = 2
        assert client._route("qwen", {"prompt": LONG}, None).estimates["decode_wait"] == pytest.approx(
            2 * tokens / ahead["decode_side_speed"], rel=1e-3)


def test_speeds_the_servers_report_stand_in_until_the_client_has_measured_its_own():
    model = CostModel()
    fast_prefill = model.decide("auto", "m", 4 * 2000, "p", "d", reported=(300.0, 300.0))
    assert fast_prefill.estimates["basis"] == "measured"
    assert fast_prefill.path == LOCAL  # equal speeds: the handoff's extra round trip does not pay
    assert model.decide("auto", "m", 4 * 2000, "p", "d", reported=(9000.0, 300.0)).path == HANDOFF
    for _ in range(3):
        local(model, 2000, speed=20000)  # what the client measured itself wins over the report
    assert model.decide("auto", "m", 4 * 2000, "p", "d", reported=(9000.0, 300.0)).path == LOCAL


def test_characters_per_token_are_learned_per_model():
    model = CostModel()
    handoff(model, 999, prefill_speed=1000, chars=2 * 1000)  # a tokenizer that makes a token of 2 characters
    assert model.estimate("m", 2000, "p", "d")["prompt_tokens"] == 1000
    assert model.estimate("other", 2000, "p", "d")["prompt_tokens"] == 500


def test_forced_modes_and_missing_servers():
    model = CostModel()
    assert model.decide("handoff", "m", 10, "p", "d").path == HANDOFF
    assert model.decide("decode_only", "m", 10 ** 6, "p", "d").path == LOCAL
    assert model.decide("auto", "m", 10 ** 6, None, "d").path == LOCAL
    assert "forced" in model.decide("decode_only", "m", 10, "p", "d").reason


def test_prompt_chars_counts_prompt_system_and_messages():
    assert prompt_chars({"prompt": "abc", "system": "de"}) == 5
    assert prompt_chars({"messages": [{"role": "user", "content": "abcd"}, {"role": "x", "content": None}]}) == 4


def test_client_route_is_validated_on_load_and_per_request():
    data = cluster_config_dict()
    data["client"]["route"] = "sometimes"
    with pytest.raises(ConfigError) as caught:
        cluster_config.from_dict(data)
    assert caught.value.field == "client.route"
    data["client"]["route"] = "auto"
    assert cluster_config.from_dict(data).client["route"] == "auto"
    assert cluster_config.from_dict(cluster_config_dict()).client["route"] == "handoff"  # the default
    with DisaggregatedClient(cluster_config_dict(), health_check=False) as client:
        with pytest.raises(BadRequest) as caught:
            client.generate("qwen", "hi", route="maybe")
    assert caught.value.field == "route"


# -- real servers ---------------------------------------------------------------------------------

LONG_PROMPT = ("The quarterly sales report lists revenue by region, product line and month, with notes on "
               "returns, discounts and the marketing campaigns that ran. " * 70
               + "\nSummarise the report above in one sentence.")


@pytest.mark.slow
def test_auto_keeps_a_few_tokens_local_and_hands_2k_tokens_off_saying_why(tiny_cluster):
    """A cold start: before the client has measured either path (and before the servers report any
    speed), the prior decides: a few tokens stay on the decode server, a long prompt goes to the
    prefill server; each answer says why. Each request from a client of its own: on the tiny model
    both paths take a millisecond or two, so once a client has measured one of them its own figures
    (rightly) decide, and either answer would be right."""

    def cold_client():
        client = DisaggregatedClient(tiny_cluster.config, health_check=False)
        client.check_health()
        for server in client.servers.values():  # this session's servers may have served other tests
            server.health.pop("prompt_speed", None)
        return client

    with cold_client() as few_client, cold_client() as long_client, warnings.catch_warnings():
        warnings.simplefilter("error")  # chosen paths, never the fallback
        text, few = few_client.generate("qwen", FEW, max_tokens=4, route="auto")
        assert few["method"] == "decode_only" and few["route"] == LOCAL, few
        assert few["route_estimates"]["basis"] == "prior"
        assert few["prompt_tokens_recomputed"] == few["prompt_tokens"] and few["kv_bytes"] == 0
        assert "decode-only" in few["route_reason"] and "handoff" in few["route_reason"]
        assert few["route_estimates"][LOCAL] < few["route_estimates"][HANDOFF]

        # a prompt no earlier test sent, or the decode server's prefix cache makes it cheap there
        _, long = long_client.generate("qwen", f"Report {uuid.uuid4().hex}.\n" + LONG_PROMPT, max_tokens=4,
                                       route="auto")
        assert long["prompt_tokens"] > 1500, long["prompt_tokens"]
        assert long["method"] == "kv_handoff" and long["route"] == HANDOFF, (long["route_reason"],
                                                                              long["route_estimates"])
        assert long["route_estimates"]["basis"] == "prior"
        assert long["route_estimates"][HANDOFF] < long["route_estimates"][LOCAL]
        assert long["prompt_tokens_recomputed"] == 1 and long["canary"] == "passed"

        long_client.check_health()  # both servers now report the prompt speed of their recent requests
        assert all(s["prompt_speed"] > 0 for s in (long_client.servers["local-prefill-qwen"].health,
                                                   long_client.servers["local-decode-qwen"].health))
        assert any(k.startswith("local_speed/") for k in few_client.costs.snapshot())
        assert any(k.startswith("prefill_speed/") for k in long_client.costs.snapshot())
        assert few_client.history[-1]["route_reason"] == few["route_reason"]
        assert long_client.history[-1]["route_reason"] == long["route_reason"]


@pytest.mark.slow
def test_forced_routes_work_in_generate_and_stream(tiny_cluster):
    # the running cluster's ports, with the client forced local
    config = {**tiny_cluster.config, "client": {**tiny_cluster.config["client"], "route": "decode_only"}}
    with DisaggregatedClient(config, health_check=False) as client:
        client.check_health()
        _, m = client.generate("qwen", LONG_PROMPT, max_tokens=2)
        assert m["method"] == "decode_only" and "forced" in m["route_reason"]
        *_, streamed = client.stream("qwen", LONG_PROMPT, max_tokens=2)
        assert streamed["method"] == "decode_only" and streamed["route"] == LOCAL
        _, m = client.generate("qwen", FEW, max_tokens=2, route="handoff")
        assert m["method"] == "kv_handoff" and "forced" in m["route_reason"]
        *_, streamed = client.stream("qwen", FEW, max_tokens=2, route="handoff")
        assert streamed["method"] == "kv_handoff" and streamed["canary"] == "passed"
        assert all(s.prompting == 0 for s in client.servers.values())  # every prompt counted out again


# -- the overlapped handoff (issue 29): the router counts only what the stream leaves after the prefill --

PROD_KV = 96 << 10  # qwen3-coder's KV per token (48 layers x 4 KV heads x 128 x K and V x f16)


def streamed_handoff(model: CostModel, tokens: int, prefill_speed: float, kv_per_token: int, link: float,
                     copy: float, fixed: float, chunk: int = 512) -> float:
    """Feed one streamed handoff measured as a real one reports it; returns the TTFT it was given."""
    took = tokens / prefill_speed
    kv = tokens * kv_per_token
    tail = min(tokens, chunk) * kv_per_token
    exposed = max(tail / link, kv / link - took) + tail / copy
    pre = {"prompt_tokens": tokens + 1, "prompt_tokens_evaluated": tokens, "prefill_time": took,
           "kv_read_time": kv / copy / 2, "kv_chunk_tokens": chunk, "handoff_mode": "streamed"}
    dec = {"prompt_tokens": tokens + 1, "kv_bytes": kv, "kv_transfer_time": kv / link, "kv_load_time": kv / copy / 2,
           "first_token_time": 0.01, "handoff_mode": "streamed"}
    ttft = fixed + took + exposed + 0.01
    model.observe("m", 4 * (tokens + 1), HANDOFF, "p", "d", ServerFigures.of(**pre), ServerFigures.of(**dec), ttft)
    return ttft


def test_the_streamed_handoff_pays_where_the_whole_state_handoff_does_not():
    # a prefill server that is faster than the decode machine but not by much (a busy GPU, a big model) and a
    # 10 Gbit/s link: 8k tokens of production-width KV (790 MB) take 0.63 s to move, as long as part of the prefill
    model = CostModel()
    for _ in range(3):
        handoff(model, 4000, prefill_speed=2000, kv_per_token=PROD_KV, link=1.25e9)
        local(model, 2000, speed=1800)
    chars = 4 * 8000
    whole = model.decide("auto", "m", chars, "p", "d")
    streamed = model.decide("auto", "m", chars, "p", "d", streamed=True)
    assert whole.path == LOCAL and whole.estimates["handoff_mode"] == "whole"
    assert streamed.path == HANDOFF and streamed.estimates["handoff_mode"] == "streamed"
    assert "handoff (streamed)" in streamed.reason
    # the stream hides the transfer behind the 4 s prefill: only the last chunk's 512 tokens are left
    tail = 512 * PROD_KV
    assert streamed.estimates["kv_exposed"] == pytest.approx(tail / 1.25e9 + tail / 4e9, rel=0.05)
    assert whole.estimates[HANDOFF] - streamed.estimates[HANDOFF] == pytest.approx(
        whole.estimates["kv_exposed"] - streamed.estimates["kv_exposed"], abs=1e-6)


def test_on_a_link_slower_than_the_prefill_the_stream_hides_only_the_prefill_time():
    model = CostModel()
    for _ in range(3):
        handoff(model, 4000, prefill_speed=40_000, kv_per_token=PROD_KV, link=1.25e8)  # a fast GPU, 1 Gbit/s
    est = model.estimate("m", 4 * 8000, "p", "d", streamed=True)
    total = 7999 * PROD_KV
    assert est["kv_exposed"] == pytest.approx(total / 1.25e8 - 7999 / 40_000 + 512 * PROD_KV / 4e9, rel=0.05)


def test_the_last_chunk_is_the_prefill_servers_n_batch():
    model = CostModel()
    small = model.estimate("m", 4 * 8000, "p", "d", streamed=True, chunk_tokens=128)
    large = model.estimate("m", 4 * 8000, "p", "d", streamed=True, chunk_tokens=2048)
    assert large["kv_exposed"] == pytest.approx(16 * small["kv_exposed"], rel=0.01)
    # once a streamed handoff reported its chunk, that figure wins over what /health said
    streamed_handoff(model, 8000, 4000, PROD_KV, 1.25e9, 4e9, fixed=0.02, chunk=256)
    assert model.estimate("m", 4 * 8000, "p", "d", streamed=True, chunk_tokens=2048)["kv_exposed"] == pytest.approx(
        model.estimate("m", 4 * 8000, "p", "d", streamed=True, chunk_tokens=256)["kv_exposed"])


def test_a_streamed_handoffs_hidden_transfer_does_not_inflate_the_fixed_cost():
    model = CostModel()
    for _ in range(5):
        streamed_handoff(model, 8000, prefill_speed=4000, kv_per_token=PROD_KV, link=1.25e9, copy=4e9, fixed=0.02)
    assert model.snapshot()["fixed/handoff"] == pytest.approx(0.02, abs=1e-3)
    assert model.snapshot()["link/p/d"] == pytest.approx(1.25e9, rel=1e-3)
    assert model.snapshot()["chunk_tokens/p"] == 512


def test_the_client_routes_for_the_stream_only_where_the_prefill_server_streams(tmp_path):
    cfg = cluster_config.coerce(cluster_config_dict())
    with DisaggregatedClient(cfg, health_check=False) as client:
        client.route = "auto"
        prefill = next(s for s in client.servers.values() if s.entry.role == "prefill" and s.entry.model == "qwen")
        decode = next(s for s in client.servers.values() if s.entry.role == "decode" and s.entry.model == "qwen")
        decode.health = {"handoff_modes": ["whole", "streamed"], "slots": {"total": 1}}
        prefill.health = {"handoff_modes": ["whole", "streamed"], "model_info": {"n_batch": 256}, "slots": {"total": 1}}
        assert client._route("qwen", {"prompt": LONG}, None).estimates["handoff_mode"] == "streamed"
        prefill.health = {"handoff_modes": ["whole"], "slots": {"total": 1}}  # a sliding-window model
        assert client._route("qwen", {"prompt": LONG}, None).estimates["handoff_mode"] == "whole"
        client.handoff_mode = "whole"
        prefill.health = {"handoff_modes": ["whole", "streamed"], "slots": {"total": 1}}
        assert client._route("qwen", {"prompt": LONG}, None).estimates["handoff_mode"] == "whole"
