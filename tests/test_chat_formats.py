"""The chat formats (chat/), on their own: rendering, and parsing generated text as it streams.

Sequences are written from the models' documented formats: harmony's channels and tool calls
(gpt-oss), Qwen3-Coder's ``<tool_call>`` blocks. Every parse is also run on the same text cut into
pieces everywhere (single characters, and markers split across pieces), and must read the same.
The renderings are compared with the models' real templates, read as data from llama-cpp-python's
source distribution (``tiny_models.llama_cpp_template``; those tests are slow the first time: pip
downloads it once)."""
from __future__ import annotations

import json
import random

import pytest

from disaggregated_inference import chat
from disaggregated_inference.chat import harmony
from disaggregated_inference.chat.base import CONTENT, REASONING, TOOL_CALL
from disaggregated_inference.errors import BadRequest, ConfigError

from .tiny_models import llama_cpp_template

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city."},
        "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
        "days": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now", "description": "The time."}}
TOOLS = chat.parse_tools([WEATHER, NOW])


def read(parser_or_format, text: str, pieces=None, tools=None):
    """(answer, reasoning, [(name, arguments)]) of ``text`` fed to a parser in ``pieces`` (default whole)."""
    parser = parser_or_format.parser(tools) if isinstance(parser_or_format, chat.ChatFormat) else parser_or_format
    parts = []
    for piece in pieces if pieces is not None else [text]:
        parts += parser.feed(piece)
    parts += parser.close()
    answer = "".join(p.value for p in parts if p.kind == CONTENT)
    reasoning = "".join(p.value for p in parts if p.kind == REASONING)
    calls = [(p.value.name, json.loads(p.value.arguments)) for p in parts if p.kind == TOOL_CALL]
    return answer, reasoning, calls


def splits(text: str):
    """The same text cut into pieces: single characters, and random cuts (markers split across pieces)."""
    yield list(text)
    rng = random.Random(len(text))
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 12)))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def same_in_every_split(fmt, text, tools=None):
    whole = read(fmt, text, tools=tools)
    for pieces in splits(text):
        assert read(fmt, text, pieces, tools=tools) == whole, pieces
    return whole


# -- harmony ---------------------------------------------------------------------------------------

HARMONY = chat.Harmony()


def test_harmony_analysis_then_final():
    text = ("<|channel|>analysis<|message|>The user wants a colour. Blue.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Blue.")
    assert same_in_every_split(HARMONY, text) == ("Blue.", "The user wants a colour. Blue.", [])


@pytest.mark.parametrize("header", [
    "<|channel|>commentary to=functions.get_weather <|constrain|>json",  # the recipient after the channel
    " to=functions.get_weather<|channel|>commentary json",              # in the role's header, as history has it
])
def test_harmony_tool_call_after_analysis(header):
    text = (f"<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant{header}<|message|>"
            '{"city": "Paris", "days": 2}')  # <|call|> ends the generation: the loop feeds no end token's text
    answer, reasoning, calls = same_in_every_split(HARMONY, text)
    assert (answer, reasoning) == ("", "Need the weather.")
    assert calls == [("get_weather", {"city": "Paris", "days": 2})]


def test_harmony_a_preamble_is_part_of_the_answer_and_a_second_analysis_is_reasoning():
    text = ("<|channel|>analysis<|message|>First.<|end|><|start|>assistant<|channel|>commentary<|message|>"
            "Checking the weather.<|end|><|start|>assistant<|channel|>analysis<|message|> Second.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Done.<|return|>")
    assert same_in_every_split(HARMONY, text) == ("Checking the weather.Done.", "First. Second.", [])


def test_harmony_leniency():
    # a new message without <|end|> first; text that never became harmony is the answer
    assert read(HARMONY, "<|channel|>analysis<|message|>a<|channel|>final<|message|>b") == ("b", "a", [])
    assert same_in_every_split(HARMONY, "Just text, no channels at all.")[0] == "Just text, no channels at all."
    # markup that merely resembles a marker stays text
    assert read(HARMONY, "<|channel|>final<|message|>a <| b < c")[0] == "a <| b < c"


def test_harmony_rendering_structure():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "reasoning": "Ask the tool.",
                 "tool_calls": ({"name": "get_weather", "arguments": {"city": "Paris"}, "id": "c1"},)},
                {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "c1"}]
    text = HARMONY.render(messages, tools=TOOLS, reasoning_effort="low", today="2025-01-02").text
    assert text.startswith("<|start|>system<|message|>You are ChatGPT") and "Current date: 2025-01-02" in text
    assert "Reasoning: low" in text and "Calls to these tools must go to the commentary channel" in text
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions" in text
    assert "type get_weather = (_: {\n// The city.\ncity: string,\nunit?: \"c\" | \"f\", // default: c,\n" in text
    assert "type now = () => any;" in text
    # the analysis behind an unanswered call is kept; the result names the tool; the model's turn is open
    assert ("<|start|>assistant<|channel|>analysis<|message|>Ask the tool.<|end|><|start|>assistant "
            'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>') in text
    assert text.endswith('<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>'
                         '"{\\"temp\\": 21}"<|end|><|start|>assistant')
    # once answered, earlier analysis is dropped and answers are final-channel messages
    later = HARMONY.render(messages + [{"role": "assistant", "content": "21 C."}, {"role": "user", "content": "Ok"}],
                           today="2025-01-02").text
    assert "Ask the tool." not in later and "<|channel|>final<|message|>21 C.<|end|>" in later
    assert "Reasoning: medium" in later  # the default effort


@pytest.mark.slow
def test_harmony_rendering_is_the_real_templates():
    """Our renderer against gpt-oss's own template (the llama.cpp repository's copy), on a conversation with a
    system prompt, tools, a call, its result, an answer and a new question."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    try:
        template = llama_cpp_template("openai-gpt-oss-120b.jinja")
    except LookupError as exc:
        pytest.skip(str(exc))
    tools = [WEATHER, NOW]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": '{"temp": 21}'}, {"role": "assistant", "content": "It is 21 C."},
                {"role": "user", "content": "Thanks"}]
    for effort in ("low", "high"):
        real = Jinja2ChatFormatter(template=template, eos_token="<|return|>", bos_token="<|startoftext|>")(
            messages=messages, tools=tools, reasoning_effort=effort).prompt
        ours = HARMONY.render(chat.parse_messages(messages), tools=chat.parse_tools(tools),
                              reasoning_effort=effort).text
        assert ours == real


# -- Qwen3-Coder -----------------------------------------------------------------------------------

QWEN = chat.Qwen3Coder()
CODER_TOOLS = chat.parse_tools([WEATHER, {"type": "function", "function": {
    "name": "run", "parameters": {"type": "object", "properties": {
        "code": {"type": "string"}, "env": {"type": "object"}, "dry": {"type": "boolean"}}}}}])


def test_qwen3_coder_calls_after_text():
    text = ("Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=run>\n"
            "<parameter=code>\nprint(1)\n\nprint(2)\n</parameter>\n<parameter=env>\n{\"A\": 1}\n</parameter>\n"
            "<parameter=dry>\ntrue\n</parameter>\n</function>\n</tool_call>")
    answer, reasoning, calls = same_in_every_split(QWEN, text, tools=CODER_TOOLS)
    assert answer == "Let me check." and reasoning == ""
    assert calls == [("get_weather", {"city": "New York", "days": 3}),
                     ("run", {"code": "print(1)\n\nprint(2)", "env": {"A": 1}, "dry": True})]


def test_qwen3_coder_plain_answers_and_cut_off_calls():
    assert same_in_every_split(QWEN, "x < y and <tool> is no call.\n", tools=CODER_TOOLS)[0] == \
        "x < y and <tool> is no call.\n"
    # the budget ran out inside a call: what arrived of it is still read
    cut = "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
    assert read(QWEN, cut, tools=CODER_TOOLS)[2] == [("get_weather", {"city": "Rome"})]
    # a string parameter stays text even when it looks like a number; unknown tools read values as JSON
    assert read(QWEN, "<tool_call><function=get_weather><parameter=city>\n42\n</parameter></function></tool_call>",
                tools=CODER_TOOLS)[2] == [("get_weather", {"city": "42"})]
    assert read(QWEN, "<tool_call><function=other><parameter=n>\n42\n</parameter></function></tool_call>")[2] == \
        [("other", {"n": 42})]


@pytest.mark.slow
def test_qwen3_coder_reads_what_its_template_writes():
    """The real Qwen3-Coder template renders an assistant turn with calls; our parser reads those calls back, and
    renders tools and results through the template (``native_tools``)."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    try:
        template = llama_cpp_template("Qwen3-Coder.jinja")
    except LookupError as exc:
        pytest.skip(str(exc))
    renderer = Jinja2ChatFormatter(template=template, eos_token="<|im_end|>", bos_token="")
    fmt = chat.choose("auto", arch="qwen3moe", template=template, make_renderer=lambda source: renderer)
    assert fmt.name == "qwen3_coder"
    calls = ({"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
             {"name": "run", "arguments": {"code": "x = 1\ny = 2", "env": {"A": [1, 2]}}})
    messages = chat.parse_messages([{"role": "user", "content": "Go."},
                                    {"role": "assistant", "content": "Calling.", "tool_calls": list(calls)},
                                    {"role": "tool", "content": "sunny", "tool_call_id": "x"}])
    rendered = fmt.render(messages, tools=CODER_TOOLS).text
    assert "<tools>" in rendered and "<name>get_weather</name>" in rendered
    assert "<tool_response>\nsunny\n</tool_response>" in rendered
    turn = rendered.split("<|im_start|>assistant\n", 1)[1].split("<|im_end|>", 1)[0]
    assert same_in_every_split(fmt, turn, tools=CODER_TOOLS) == ("Calling.", "", [(c["name"], c["arguments"])
                                                                                  for c in calls])


def test_qwen3_coder_refuses_a_schema_beside_tools():
    with pytest.raises(BadRequest) as info:
        chat.Output(QWEN, budget=100, tools=CODER_TOOLS, json_schema={"type": "object"})
    assert info.value.field == "json_schema"


# -- a template model's JSON envelope ----------------------------------------------------------------

def test_envelope_calls_and_answers():
    fmt = chat.TemplateFormat()
    tools = chat.parse_tools([WEATHER], "auto")
    call = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}'
    assert read(fmt, call, list(call), tools=tools) == ("", "", [("get_weather", {"city": "Oslo"})])
    assert read(fmt, '{"content": "Hello."}', tools=tools) == ("Hello.", "", [])
    assert read(fmt, '{"tool_calls": [{"name": "get_we', tools=tools)[0] == '{"tool_calls": [{"name": "get_we'
    assert read(fmt, "plain", tools=None) == ("plain", "", [])  # no tools: no envelope
    schema, at = fmt.constraint(None, tools)
    assert at == chat.START and schema["anyOf"][1]["properties"]["content"] == {"type": "string"}
    named, _ = fmt.constraint(None, chat.parse_tools([WEATHER, NOW], {"type": "function", "function": {"name": "now"}}))
    assert named["properties"]["tool_calls"]["maxItems"] == 1
    assert named["properties"]["tool_calls"]["items"]["properties"]["name"] == {"const": "now"}


# -- the output: what the token loops drive --------------------------------------------------------

def feed(output: chat.Output, pieces):
    parts = []
    for piece in pieces:
        parts += output.push(piece)
    return parts


def test_the_reasoning_budget_moves_the_model_to_its_answer():
    out = chat.Output(HARMONY, budget=100, reasoning_budget=8)
    assert out.cap == 8
    steps = [out.take(t) for t in ["<|channel|>", "analysis", "<|message|>"]]  # a header counts with its message
    assert out.reasoning_tokens == 3 and not any(s.parts or s.feed for s in steps)
    for word in ["one", " two", " three", " four"]:
        assert out.take(word).feed is None
    step = out.take(" five")
    assert out.reasoning_tokens == 8 and step.feed == harmony.FINAL and not step.done
    out.fed(step.feed, 7)
    parts = out.take("Blue").parts + out.take(".").parts + out.close()
    assert "".join(p.value for p in parts if p.kind == CONTENT) == "Blue."
    assert "".join(out.reasoning) == "one two three four five"
    assert out.metrics().as_dict() == {"chat_format": "harmony", "reasoning_tokens": 8, "reasoning_capped": True,
                                       "forced_tokens": 7}


def test_default_caps_and_the_answer_that_must_come():
    assert chat.reasoning_cap(1000, None) == 500
    assert chat.reasoning_cap(1000, 5000) == 750  # a quarter of the budget stays for the answer
    out = chat.Output(HARMONY, budget=100)
    feed(out, ["<|channel|>analysis<|message|>", "Hmm."])
    end = out.take(None)  # the model wrote an end token with no answer: go on with one instead, once
    assert (end.sampled, end.done, end.feed) == (False, False, harmony.FINAL)
    out.fed(end.feed, 7)
    assert out.take(None).done
    answered = chat.Output(HARMONY, budget=100)
    feed(answered, ["<|channel|>final<|message|>", "Yes."])
    assert answered.take(None).done
    calling = chat.Output(HARMONY, budget=100)
    feed(calling, ["<|channel|>commentary to=functions.now<|message|>", "{}"])
    assert calling.take(None).done and calling.close()[0].kind == TOOL_CALL
    assert calling.finish_reason("stop") == "tool_calls"
    assert chat.Output(chat.RAW, budget=10).take(None).done  # formats without reasoning just end


def test_a_schema_on_the_answer_starts_when_the_answer_opens():
    schema = {"type": "object"}
    out = chat.Output(HARMONY, budget=100, json_schema=schema)
    assert out.start_schema is None and out.answer_schema == schema
    feed(out, ["<|channel|>analysis<|message|>", "free prose", "<|end|>", "<|start|>assistant", "<|channel|>final"])
    assert out.schema_due() is None
    feed(out, ["<|message|>"])
    assert out.schema_due() == schema and out.schema_due() is None
    plain = chat.Output(chat.RAW, budget=100, json_schema=schema)
    assert plain.start_schema == schema and plain.schema_due() is None


def test_stop_strings_cut_the_answer_only():
    out = chat.Output(HARMONY, budget=100, stop=("END",))
    parts = feed(out, ["<|channel|>analysis<|message|>", "END is fine here", "<|end|><|start|>assistant",
                       "<|channel|>final<|message|>", "Done E", "N", "D more"]) + out.close()
    assert "".join(p.value for p in parts if p.kind == CONTENT) == "Done " and out.stopped
    assert "".join(out.reasoning) == "END is fine here"


# -- choosing a model's format ---------------------------------------------------------------------

def test_choose_by_architecture_template_or_setting():
    made = []

    def renderer(source):
        made.append(source)
        return lambda **kwargs: None

    assert chat.choose("auto", arch="gpt-oss", template=None, make_renderer=renderer).name == "harmony"
    assert chat.choose("auto", arch="llama", template="x <|channel|> <|message|>", make_renderer=renderer).name \
        == "harmony"
    coder = "{{ '<tool_call>\\n<function=' }}{{ '<parameter=' }}"
    assert chat.choose("auto", arch="qwen3moe", template=coder, make_renderer=renderer).name == "qwen3_coder"
    assert chat.choose("auto", arch="llama", template="{{ x }}", make_renderer=renderer).name == "template"
    assert chat.choose("harmony", arch="llama", template="{{ x }}", make_renderer=renderer).name == "harmony"
    gemma = chat.choose("auto", arch="gemma3", template=None, make_renderer=renderer)
    assert gemma.source == "builtin:gemma3" and made[-1] == chat.FALLBACK_TEMPLATES["gemma3"]
    assert chat.choose("auto", arch="llama", template=None, make_renderer=renderer) is None  # raw prompts only
    with pytest.raises(ConfigError) as info:
        chat.choose("qwen3_coder", arch="qwen3moe", template=None, make_renderer=renderer)
    assert info.value.field == "chat_format"
    assert chat.for_output("raw", HARMONY).name == "raw" and chat.for_output(None, HARMONY) is HARMONY
