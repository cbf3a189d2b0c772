"""Tool calling without a server: each parser on outputs as its model family writes them,
non-streamed and streamed split at every point; malformed calls stay content; the chat
template sees the tools and the tool history; tool_choice planning (schemas, 400s); plugins.
The HTTP side is in test_tool_calling_http.py."""

from __future__ import annotations

import json

import attrs
import pytest
from tool_call_streams import parse_calls, stream_calls

from trillm.engine.chat_template import ChatTemplateError, render_template
from trillm.entrypoints.openai.endpoints.chat_parsing import ChoiceParser, plan_tools
from trillm.entrypoints.openai.http.errors import BadRequestError
from trillm.entrypoints.openai.schemas.protocol import ChatCompletionRequest
from trillm.entrypoints.openai.schemas.structuring import structure
from trillm.parsers.tool_parsers import (
    RequiredToolCallParser,
    get_tool_parser,
    load_tool_parser_plugin,
    required_schema,
    tool_parser_names,
)

# ---------------------------------------------------------------- recorded outputs

QWEN25_TWO_CALLS = (
    "<tool_call>\n"
    '{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA", '
    '"unit": "celsius"}}\n'
    "</tool_call>\n"
    "<tool_call>\n"
    '{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", '
    '"date": "2024-10-01", "unit": "celsius"}}\n'
    "</tool_call>"
)
QWEN3_TEXT_THEN_CALL = (
    "I'll look that up for you.\n\n<tool_call>\n"
    '{"name": "run_code", "arguments": {"code": "if (x) { return [1, \\"}\\"]; }", '
    '"city": "Zürich"}}\n</tool_call>'
)
HERMES2_ARGS_FIRST = (
    '<tool_call>\n{"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}\n</tool_call>'
)
LLAMA31_JSON = (
    '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", '
    '"unit": "Fahrenheit"}}'
)
LLAMA32_TAGGED_TWO = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}'
)
MISTRAL_V3 = (
    '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
    '"format": "celsius"}}, {"name": "get_time", "arguments": {}}]'
)
MISTRAL_V11 = (
    'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    '[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}'
)
LLAMA32_PYTHONIC = (
    "[get_weather(city='San Francisco', metric='celsius', days=[1, 2]), "
    'get_time(timezone="PST", exact=True, note=None)]'
)
LLAMA4_PYTHONIC = '<|python_start|>[get_weather(location="Paris")]<|python_end|>'

# (parser, output, content, [(name, arguments as an object)])
CASES = [
    (
        "hermes",
        QWEN25_TWO_CALLS,
        None,
        [
            ("get_current_temperature", {"location": "San Francisco, CA, USA", "unit": "celsius"}),
            (
                "get_temperature_date",
                {"location": "San Francisco, CA, USA", "date": "2024-10-01", "unit": "celsius"},
            ),
        ],
    ),
    (
        "hermes",
        QWEN3_TEXT_THEN_CALL,
        "I'll look that up for you.",
        [("run_code", {"code": 'if (x) { return [1, "}"]; }', "city": "Zürich"})],
    ),
    ("hermes", HERMES2_ARGS_FIRST, None, [("get_stock_fundamentals", {"symbol": "TSLA"})]),
    (
        "hermes",
        "The capital of France is Paris. Use <b>bold</b> here.\n",
        "The capital of France is Paris. Use <b>bold</b> here.\n",
        [],
    ),
    (
        "llama3_json",
        LLAMA31_JSON,
        None,
        [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})],
    ),
    (
        "llama3_json",
        LLAMA32_TAGGED_TWO,
        None,
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})],
    ),
    ("llama3_json", "Paris is sunny today.", "Paris is sunny today.", []),
    (
        "llama3_json",
        '{"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>',
        None,
        [("f", {"a": 1})],
    ),  # arguments as a JSON string
    (
        "mistral",
        MISTRAL_V3,
        None,
        [
            ("get_current_weather", {"location": "Paris, France", "format": "celsius"}),
            ("get_time", {}),
        ],
    ),
    (
        "mistral",
        MISTRAL_V11,
        "Let me check.",
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})],
    ),
    ("mistral", "No tools [needed] here.", "No tools [needed] here.", []),
    (
        "mistral",
        MISTRAL_V11 + "</s>",
        "Let me check.",  # special tokens kept: EOS text follows
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})],
    ),
    (
        "mistral",
        MISTRAL_V3 + "</s>",
        None,
        [
            ("get_current_weather", {"location": "Paris, France", "format": "celsius"}),
            ("get_time", {}),
        ],
    ),
    (
        "pythonic",
        LLAMA32_PYTHONIC,
        None,
        [
            ("get_weather", {"city": "San Francisco", "metric": "celsius", "days": [1, 2]}),
            ("get_time", {"timezone": "PST", "exact": True, "note": None}),
        ],
    ),
    ("pythonic", LLAMA4_PYTHONIC, None, [("get_weather", {"location": "Paris"})]),
    ("pythonic", "It is 20 degrees.", "It is 20 degrees.", []),
]

MALFORMED = [
    ("hermes", "<tool_call>\nI will call get_weather now.\n</tool_call>"),
    ("hermes", '<tool_call>\n{name: "get_weather"}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"city": "Paris"}\n</tool_call>'),  # no name
    ("llama3_json", '{"city": "Paris", "unit": "c"}'),
    ("mistral", "[TOOL_CALLS] this is not json"),
    ("pythonic", "[get_weather('Paris')]"),  # positional argument
    ("pythonic", "[1, 2, 3]"),
]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_parser_on_recorded_output(name, text, content, calls):
    assert parse_calls(name, text) == (content, calls)


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_streamed_at_every_split_point_equals_non_streamed(name, text, content, calls):
    expected = (content, calls)
    assert stream_calls(name, list(text)) == expected  # one character a delta
    for k in range(len(text) + 1):
        assert stream_calls(name, [text[:k], text[k:]]) == expected, k
    for k in range(0, len(text), 7):  # three-way splits
        assert stream_calls(name, [text[:k], text[k : k + 5], text[k + 5 :]]) == expected, k


def test_streamed_arguments_come_in_fragments_after_the_header():
    streamer = get_tool_parser("hermes")().streamer()
    events = []
    for ch in QWEN25_TWO_CALLS:
        events += streamer.feed(ch)[1]
    events += streamer.finish()[1]
    first = [e for e in events if e["index"] == 0]
    assert "id" in first[0] and len(first) > 5  # header, then many argument fragments
    assert streamer.tools_called


@pytest.mark.parametrize("name,text", MALFORMED)
def test_malformed_calls_stay_content(name, text):
    assert parse_calls(name, text) == (text, [])
    assert stream_calls(name, list(text)) == (text, [])
    for k in range(len(text) + 1):
        assert stream_calls(name, [text[:k], text[k:]]) == (text, []), k


def test_output_that_breaks_after_a_call_was_announced():
    """Non-streamed, the whole output is content (vLLM's rule); streamed, a call announced
    cannot be taken back: it stands, and the rest comes as content."""
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}} and more text'
    assert parse_calls("llama3_json", text) == (text, [])
    content, calls = stream_calls("llama3_json", list(text))
    assert calls == [("get_weather", {"city": "Paris"})]


def test_a_call_cut_off_by_max_tokens_is_content_when_not_streamed():
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    assert parse_calls("hermes", text) == (text, [])
    # The closing tag may be what max_tokens cut: a whole object is still a call.
    whole = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    assert parse_calls("hermes", whole) == (None, [("get_weather", {"city": "Paris"})])


def test_mistral_ids_are_nine_alphanumerics():
    calls = get_tool_parser("mistral")().extract(MISTRAL_V3).tool_calls
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    calls = get_tool_parser("hermes")().extract(QWEN25_TWO_CALLS).tool_calls
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


# ---------------------------------------------------------------- tool_choice: required / named

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather now.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]


def test_required_schema_lists_each_tool_with_its_parameters():
    schema = required_schema(TOOLS, parallel_tool_calls=True)
    items = schema["items"]["anyOf"]
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert items[0]["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert items[0]["properties"]["parameters"] == TOOLS[0]["function"]["parameters"]
    assert items[1]["properties"]["parameters"] == {"type": "object"}
    assert required_schema(TOOLS, parallel_tool_calls=False)["maxItems"] == 1


def test_required_output_parses_streamed_and_not():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    want = (None, [("get_weather", {"city": "Paris"}), ("get_time", {})])
    result = RequiredToolCallParser(TOOLS).extract(text)
    assert (result.content, [(c.name, json.loads(c.arguments)) for c in result.tool_calls]) == want


@attrs.define
class _State:
    enable_auto_tool_choice: bool = True
    tool_call_parser: str | None = "hermes"
    exclude_tools_when_tool_choice_none: bool = False
    reasoning_parser: str | None = None


def _request(**body):
    return structure(
        ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], **body}
    )


def test_plan_named_constrains_to_the_functions_parameters():
    named = {"type": "function", "function": {"name": "get_weather"}}
    plan = plan_tools(_State(), _request(tools=TOOLS, tool_choice=named))
    assert plan.mode == "named" and plan.template_tools == TOOLS
    assert plan.structured_outputs.json == TOOLS[0]["function"]["parameters"]
    parser = ChoiceParser(plan, None, True)
    message = parser.message('{"city": "Paris"}')
    assert message["content"] is None
    assert message["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    assert parser.finish_reason("stop") == "stop"  # OpenAI: a named function stops


def test_plan_required_and_auto_and_none():
    plan = plan_tools(
        _State(), _request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    )
    assert plan.mode == "required" and plan.structured_outputs.json["maxItems"] == 1
    plan = plan_tools(_State(), _request(tools=TOOLS))  # tools without a choice: "auto"
    assert plan.mode == "auto" and plan.structured_outputs is None
    parser = ChoiceParser(plan, None, True)
    assert parser.message(QWEN3_TEXT_THEN_CALL)["tool_calls"][0]["function"]["name"] == "run_code"
    assert parser.finish_reason("stop") == "tool_calls"
    plan = plan_tools(_State(), _request(tools=TOOLS, tool_choice="none"))
    assert plan.mode is None and plan.parser is None and plan.template_tools == TOOLS
    plan = plan_tools(
        _State(exclude_tools_when_tool_choice_none=True), _request(tools=TOOLS, tool_choice="none")
    )
    assert plan.template_tools is None
    assert plan_tools(_State(), _request(tools=[], tool_choice="required")).mode is None


def test_auto_without_parallel_tool_calls_keeps_the_first_call():
    plan = plan_tools(_State(), _request(tools=TOOLS, parallel_tool_calls=False))
    message = ChoiceParser(plan, None, True).message(QWEN25_TWO_CALLS)
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_current_temperature"]
    parser = ChoiceParser(plan, None, True)
    deltas = [parser.feed(ch, False) for ch in QWEN25_TWO_CALLS] + [parser.feed("", True)]
    indexes = {tc["index"] for d in deltas for tc in d.get("tool_calls", [])}
    assert indexes == {0} and not any(d.get("content") for d in deltas)


@pytest.mark.parametrize(
    "state,body,param,words",
    [
        (_State(False, None), {"tools": TOOLS}, "tool_choice", "--enable-auto-tool-choice"),
        (
            _State(),
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
            "nope",
        ),
        (_State(), {"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
        (_State(), {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
        (_State(), {"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name", "twice"),
        (
            _State(),
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "response_format",
        ),
    ],
)
def test_plan_refusals_name_the_field(state, body, param, words):
    with pytest.raises(BadRequestError) as info:
        plan_tools(state, _request(**body))
    assert info.value.param == param and words in str(info.value)


def test_a_tool_without_a_function_name_is_refused_when_structured():
    with pytest.raises(BadRequestError) as info:
        _request(tools=[{"type": "function", "function": {"description": "x"}}])
    assert info.value.param == "tools[0].function.name"


def test_special_token_markers_keep_special_tokens(tok):
    from types import SimpleNamespace

    from trillm.entrypoints.openai.endpoints.chat_parsing import keeps_special_tokens

    mistral_like = SimpleNamespace(
        all_special_tokens=["</s>", "[TOOL_CALLS]", "[ARGS]"], added_tokens_decoder={}
    )
    auto = plan_tools(_State(tool_call_parser="mistral"), _request(tools=TOOLS))
    assert keeps_special_tokens(mistral_like, auto, reasoning=False)
    hermes = plan_tools(_State(), _request(tools=TOOLS))
    assert not keeps_special_tokens(tok, hermes, reasoning=True)  # <tool_call>, <think>: text
    none = plan_tools(_State(tool_call_parser="mistral"), _request(tools=TOOLS, tool_choice="none"))
    assert not keeps_special_tokens(mistral_like, none, reasoning=False)


# ---------------------------------------------------------------- the chat template

QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{%- for tc in m.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"city": "Paris", "note": "<&>"}',
                },
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"},
]


def test_tools_reach_the_template():
    plain = render_template(QWEN_LIKE, HISTORY[:1])
    with_tools = render_template(QWEN_LIKE, HISTORY[:1], tools=TOOLS)
    assert "<tools>" not in plain and plain in with_tools
    assert json.dumps(TOOLS[0], ensure_ascii=False) in with_tools  # Hugging Face's tojson


def test_tool_history_reaches_the_template_with_arguments_as_objects():
    text = render_template(QWEN_LIKE, HISTORY)
    # arguments were a JSON string: the template got an object (tojson would quote a string)
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "note": "<&>"}}' in text
    assert "<tool_response>\n22 C, sunny\n</tool_response>" in text
    structured = structure(ChatCompletionRequest, {"messages": HISTORY})
    assert render_template(QWEN_LIKE, structured.messages) == text  # protocol objects alike
    ids = "{{ messages[1].tool_calls[0].id }}/{{ messages[2].tool_call_id }}"
    assert render_template(ids, structured.messages) == "call_1/call_1"


def test_tool_history_with_bad_arguments_is_refused():
    bad = [
        HISTORY[0],
        {
            **HISTORY[1],
            "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": "{not json"}}
            ],
        },
    ]
    with pytest.raises(ChatTemplateError) as info:
        render_template(QWEN_LIKE, bad)
    assert info.value.param == "messages[1].tool_calls[0].function.arguments"


def test_templates_see_tools_none_when_not_given():
    assert (
        render_template("{{ tools is none }}|{{ documents is none }}", HISTORY[:1]) == "True|True"
    )
    docs = [{"title": "a", "text": "b"}]
    out = render_template(
        "{% for d in documents %}{{ d.title }}{% endfor %}", HISTORY[:1], documents=docs
    )
    assert out == "a"


# ---------------------------------------------------------------- the registry


def test_registry_has_the_builtin_parsers_and_takes_plugins(tmp_path):
    assert {"hermes", "llama3_json", "mistral", "pythonic"} <= set(tool_parser_names())
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(
        "from trillm.parsers.tool_parsers import CallPiece, ToolParser, register_tool_parser\n"
        "@register_tool_parser('shout')\n"
        "class Shout(ToolParser):\n"
        "    def split(self, text, final):\n"
        "        if text.startswith('CALL '):\n"
        "            return [CallPiece(text[5:].strip(), '{}', final)] if final else []\n"
        "        return [text]\n"
    )
    load_tool_parser_plugin(str(plugin))
    assert parse_calls("shout", "CALL ping") == (None, [("ping", {})])
    assert parse_calls("shout", "hello") == ("hello", [])
    with pytest.raises(ValueError, match="Unknown tool-call parser 'nope'"):
        get_tool_parser("nope")
    with pytest.raises(ValueError, match="not a file"):
        load_tool_parser_plugin(str(tmp_path / "missing.py"))


# ---------------------------------------------------------------- the Python API


def test_llm_chat_renders_tools_and_returns_the_parsed_calls():
    from trillm import LLM, SamplingParams
    from trillm.sampling_params import StructuredOutputsParams

    call = '<tool_call>\\n\\{"name": "get_weather", "arguments": \\{"city": "Paris"\\}\\}\\n</tool_call>'
    forced = StructuredOutputsParams(regex="Checking\\.\\n" + call)
    params = SamplingParams(temperature=0.0, max_tokens=300, structured_outputs=forced)
    ask = HISTORY[:1]
    with LLM(
        max_model_len=1024, kv_cache_memory="16MiB", distributed_executor_backend="uni"
    ) as llm:
        plain = llm.chat(ask, params, use_tqdm=False, chat_template=QWEN_LIKE)[0]
        out = llm.chat(
            ask, params, use_tqdm=False, chat_template=QWEN_LIKE, tools=TOOLS, tool_parser="hermes"
        )[0]
        with pytest.raises(ValueError, match="Unknown tool-call parser"):
            llm.chat(ask, params, use_tqdm=False, tools=TOOLS, tool_parser="nope")
    assert len(out.prompt_token_ids) > len(plain.prompt_token_ids) + 40  # tools rendered
    assert plain.outputs[0].tool_calls is None  # no parser asked for: nothing parsed
    c = out.outputs[0]
    if not c.text.startswith("Checking.\n<tool_call>"):
        pytest.skip("the engine does not enforce structured outputs yet")
    assert c.content == "Checking."
    assert [
        (t["function"]["name"], json.loads(t["function"]["arguments"])) for t in c.tool_calls
    ] == [("get_weather", {"city": "Paris"})]
    assert c.tool_calls[0]["id"].startswith("call_") and c.tool_calls[0]["type"] == "function"
