"""Request bodies are parsed at the edge; every refusal names the offending field."""
import pytest

from disaggregated_inference.server import parse as api
from disaggregated_inference.errors import BadRequest


def refused(parse, body):
    with pytest.raises(BadRequest) as info:
        parse(body)
    return info.value


def test_prefill_accepts_prompt_or_messages():
    assert api.parse_prefill({"prompt": "hi"}).prompt.text == "hi"
    req = api.parse_prefill({"messages": [{"role": "user", "content": "hi"}], "lease_seconds": 5})
    assert req.prompt.messages == ({"role": "user", "content": "hi"},) and req.lease_seconds == 5


@pytest.mark.parametrize("body, field", [
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": 3}, "prompt"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"name": "f", "arguments": "{x"}]}]},
     "messages[0].tool_calls[0].arguments"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {}}]},
     "tools[0].function.name"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f"}], "tool_choice": {"name": "g"}},
     "tool_choice"),
    ({"prompt": "a", "reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"prompt": "a", "lease_seconds": 0}, "lease_seconds"),
    ({"prompt": "a", "promt": "typo"}, "promt"),
    ([1, 2], "body"),
])
def test_prefill_refusals_name_the_field(body, field):
    assert refused(api.parse_prefill, body).field == field


def test_decode_needs_exactly_one_source_of_prompt_state():
    assert refused(api.parse_decode, {"max_new_tokens": 3}).field == "kv"
    both = {"kv": {"url": "http://h/kv/x", "handle": "x"}, "tokens": [1]}
    assert refused(api.parse_decode, both).field == "kv"
    req = api.parse_decode({"tokens": [1, 2, 3], "max_tokens": 5, "stop": "\n", "seed": 7, "stream": True})
    assert req.tokens == (1, 2, 3) and req.sampling.max_new_tokens == 5 and req.sampling.stop == ("\n",)
    assert req.sampling.seed == 7 and req.stream is True


@pytest.mark.parametrize("body, field", [
    ({"kv": {"url": "ftp://x", "handle": "h"}}, "kv.url"),
    ({"kv": {"url": "http://x/kv/h"}}, "kv.handle"),
    ({"kv": {"url": "http://x/kv/h", "handle": "h", "bytes": -1}}, "kv.bytes"),
    ({"tokens": [1, "2"]}, "tokens"),
    ({"tokens": [1], "temperature": 9}, "temperature"),
    ({"tokens": [1], "top_p": "high"}, "top_p"),
    ({"tokens": [1], "max_new_tokens": 0}, "max_new_tokens"),
    ({"tokens": [1], "stop": [""]}, "stop"),
    ({"tokens": [1], "stream": "yes"}, "stream"),
    ({"tokens": [1], "format": "yaml"}, "format"),
    ({"tokens": [1], "max_tokens": 1, "max_new_tokens": 2}, "max_tokens"),
    ({"tokens": [1], "reasoning_budget": -1}, "reasoning_budget"),
    ({"tokens": [1], "tools": {"name": "f"}}, "tools"),
])
def test_decode_refusals_name_the_field(body, field):
    assert refused(api.parse_decode, body).field == field


def test_format_json_and_schema_become_a_json_schema():
    assert api.parse_generate({"prompt": "a", "format": "json"}).sampling.json_schema == {"type": "object"}
    schema = {"type": "object", "properties": {"score": {"type": "integer"}}}
    assert api.parse_generate({"prompt": "a", "json_schema": schema}).sampling.json_schema == schema
