"""Tool calling and reasoning through a real ``trillm serve`` and the official openai client:
request shapes for tool_choice none / auto / required / named, the 400s for bad tool specs,
tools and tool history in the rendered prompt, reasoning_content split by --reasoning-parser
(enable_thinking through chat_template_kwargs), streamed and not.

The default model is random text, so it calls a tool only when made to: "required" and named
choices are constrained by structured outputs, and auto is made to write a Hermes call with a
regex constraint. Those checks need the engine to enforce structured outputs and are skipped
(with the reason) while it does not.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest
from server_harness import ServerProcess

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for tc in m.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n"
    # Thinking off unless asked: the closed block Qwen3 renders for enable_thinking=false, so
    # a constrained output is constrained from its first token.
    "{%- if enable_thinking is defined and enable_thinking %}<think>\n"
    "{%- else %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "enum": ["CET", "UTC"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "template.jinja"
    path.write_text(TEMPLATE)
    return str(path)


@pytest.fixture(scope="module")
def server(template_file, tmp_path_factory):
    # --reasoning-parser needs <think> / </think> tokens (the engine's structured outputs wait
    # for </think>): the default model with them added.
    from trillm.testing.reasoning_model import build_reasoning_model
    from trillm.testing.tiny_models import DEFAULT_MODEL_DIR

    model, _, _ = build_reasoning_model(
        DEFAULT_MODEL_DIR, tmp_path_factory.mktemp("think-default") / "model"
    )
    log = tmp_path_factory.mktemp("server-tools") / "server.log"
    srv = ServerProcess(
        [
            str(model),
            "--chat-template",
            template_file,
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--reasoning-parser",
            "qwen3",
            "--max-model-len",
            "1024",
            "--kv-cache-memory",
            "64MiB",
            "--trust-request-chat-template",
        ],
        log,
    ).start()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def constrained(client):
    """Whether the engine enforces structured outputs (else those checks skip)."""
    r = client.chat.completions.create(
        model=None,
        messages=ASK,
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
        extra_body={"structured_outputs": {"regex": "abc"}},
    )
    return r.choices[0].message.content == "abc"


def create(client, **kw):
    kw = {"messages": ASK, "max_tokens": 24, "temperature": 0, **kw}
    return client.chat.completions.create(model=None, **kw)


def streamed(client, **kw):
    """(content, reasoning, calls as [name, arguments], finish_reason) from a stream."""
    content, reasoning, calls, finish = "", "", [], None
    for chunk in create(client, stream=True, **kw):
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for tc in delta.tool_calls or []:
            if tc.id is not None:  # the header: index, id, type and name first
                assert tc.index == len(calls) and tc.type == "function" and tc.function.name
                calls.append([tc.function.name, tc.function.arguments or ""])
            else:
                assert tc.function.name is None
                calls[tc.index][1] += tc.function.arguments
        finish = choice.finish_reason or finish
    return content, reasoning, calls, finish


def need(constrained):
    if not constrained:
        pytest.skip("the engine does not enforce structured outputs yet")


# ---------------------------------------------------------------- request shapes


def test_tool_choice_none_renders_tools_and_parses_nothing(client):
    plain = create(client)
    none = create(client, tools=TOOLS, tool_choice="none")
    assert none.usage.prompt_tokens > plain.usage.prompt_tokens + 40  # the tools were rendered
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].finish_reason in ("stop", "length")


def test_auto_without_a_call_answers_content(client):
    r = create(client, tools=TOOLS)  # no tool_choice with tools: "auto"
    message = r.choices[0].message
    assert message.tool_calls is None and message.content
    assert r.choices[0].finish_reason in ("stop", "length")


def test_auto_parses_a_hermes_call_streamed_and_not(client, constrained):
    need(constrained)
    call = '<tool_call>\\n\\{"name": "get_weather", "arguments": \\{"city": "Paris"\\}\\}\\n</tool_call>'
    body = {"structured_outputs": {"regex": "Checking\\.\\n" + call}}
    r = create(client, tools=TOOLS, max_tokens=300, extra_body=body)
    message = r.choices[0].message
    assert message.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert message.tool_calls[0].id and message.tool_calls[0].type == "function"
    assert r.choices[0].finish_reason == "tool_calls"
    content, _, calls, finish = streamed(client, tools=TOOLS, max_tokens=300, extra_body=body)
    assert content == "Checking." and finish == "tool_calls"
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Paris"})]
    two = {"structured_outputs": {"regex": call + "\\n" + call.replace("Paris", "Rome")}}
    r = create(client, tools=TOOLS, max_tokens=400, extra_body=two)
    assert [json.loads(c.function.arguments)["city"] for c in r.choices[0].message.tool_calls] == [
        "Paris",
        "Rome",
    ]
    r = create(client, tools=TOOLS, max_tokens=400, extra_body=two, parallel_tool_calls=False)
    assert [json.loads(c.function.arguments)["city"] for c in r.choices[0].message.tool_calls] == [
        "Paris"
    ]


def test_named_function_gives_that_call(client, constrained):
    r = create(client, tools=TOOLS, tool_choice=NAMED, max_tokens=120)
    message = r.choices[0].message
    assert message.content is None and len(message.tool_calls) == 1
    assert message.tool_calls[0].function.name == "get_weather"
    assert r.choices[0].finish_reason in ("stop", "length")  # named: "stop", as OpenAI
    content, _, calls, _ = streamed(client, tools=TOOLS, tool_choice=NAMED, max_tokens=120)
    assert content == "" and calls == [["get_weather", message.tool_calls[0].function.arguments]]
    need(constrained)
    args = json.loads(message.tool_calls[0].function.arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str) and len(args["city"]) <= 12
    assert r.choices[0].finish_reason == "stop"


def test_each_choice_parses_its_own_calls(client, constrained):
    need(constrained)
    r = create(client, tools=TOOLS, tool_choice=NAMED, n=3, temperature=1.0, seed=3, max_tokens=120)
    ids = set()
    for choice in r.choices:
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
        ids.add(call.id)
    assert len(ids) == 3


def _check_calls(calls):
    for name, arguments in calls:
        args = json.loads(arguments)
        assert name in ("get_weather", "get_time")
        assert set(args) == ({"city"} if name == "get_weather" else {"tz"})


def test_required_gives_valid_calls(client, constrained):
    need(constrained)
    r = create(
        client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=200
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    assert choice.message.content is None
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    _check_calls(calls)
    _, _, streamed_calls, finish = streamed(
        client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=200
    )
    assert finish == "tool_calls" and [tuple(c) for c in streamed_calls] == calls
    # Parallel: the random model may list calls until max_tokens; each one listed is whole.
    for seed in (1, 2):
        r = create(
            client, tools=TOOLS, tool_choice="required", max_tokens=150, temperature=1.0, seed=seed
        )
        assert r.choices[0].finish_reason in ("tool_calls", "length")
        assert r.choices[0].message.tool_calls
        _check_calls(
            [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
        )


def test_tool_history_is_rendered(client, server):
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C and sunny"},
    ]
    short = create(client, messages=history[:1], tools=TOOLS, tool_choice="none")
    full = create(client, messages=history, tools=TOOLS, tool_choice="none")
    assert full.usage.prompt_tokens > short.usage.prompt_tokens + 20
    bad = [
        *history[:1],
        {
            **history[1],
            "tool_calls": [
                {
                    "id": "c",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{oops"},
                }
            ],
        },
    ]
    r = httpx.post(server.base_url + "/chat/completions", json={"messages": bad}, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"


def test_documents_and_reasoning_history_reach_the_template(server):
    template = (
        "{%- for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{%- endfor %}"
        "{%- for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{%- if m.reasoning_content %}(thought: {{ m.reasoning_content }}){%- endif %}"
        "{%- endfor %}<assistant>"
    )
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "reasoning_content": "be nice"},
        {"role": "user", "content": "and?"},
    ]
    docs = [{"title": "Paris", "text": "the capital of France"}]
    r = httpx.post(
        server.base_url + "/chat/completions",
        timeout=60,
        json={
            "messages": messages,
            "documents": docs,
            "chat_template": template,
            "max_tokens": 1,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    ids = r.json()["prompt_token_ids"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids}, timeout=60).json()
    assert text["prompt"] == (
        "[Paris: the capital of France]<user>hi<assistant>hello(thought: be nice)<user>and?"
        "<assistant>"
    )


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "body,param",
    [
        (
            {"tools": [{"type": "function", "function": {"description": "no name"}}]},
            "tools[0].function.name",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools[0].type"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        (
            {
                "tools": [
                    TIME,
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "nonsense"}},
                    },
                ],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
            "tools[1].function.parameters",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"$ref": "#/defs/missing"}},
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
def test_bad_tool_specs_are_400s(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        create(client, extra_body=body)
    assert info.value.status_code == 400 and info.value.body["param"] == param


PLUGIN = """
from trillm.parsers.tool_parsers import CallPiece, ToolParser, register_tool_parser

@register_tool_parser("shout")
class Shout(ToolParser):
    def split(self, text, final):
        return [text]
"""


def test_auto_without_the_flag_is_a_400_and_plugins_load(template_file, tmp_path):
    plugin = tmp_path / "shout.py"
    plugin.write_text(PLUGIN)
    srv = ServerProcess(
        [
            "--chat-template",
            template_file,
            "--runner",
            "trillm.worker.fake_runner:FakeModelRunner",
            "--tool-parser-plugin",
            str(plugin),
            "--tool-call-parser",
            "shout",
        ],
        tmp_path / "server.log",
    ).start()
    try:
        client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
            create(client, tools=TOOLS)
        r = create(client, tools=TOOLS, tool_choice="none", max_tokens=4)
        assert r.choices[0].message.tool_calls is None
    finally:
        assert srv.stop() == 0, srv.log()


@pytest.mark.parametrize(
    "flags,words",
    [
        (["--tool-call-parser", "nope"], "Unknown tool-call parser 'nope'"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
        (["--reasoning-parser", "nope"], "Unknown reasoning parser 'nope'"),
        (["--tool-parser-plugin", "/nonexistent/p.py"], "is not a file"),
    ],
)
def test_bad_parser_flags_stop_the_cli(flags, words):
    proc = subprocess.run(
        [sys.executable, "-m", "trillm", "serve", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr


# ---------------------------------------------------------------- reasoning


def test_enable_thinking_puts_the_output_in_reasoning(client):
    kwargs = {"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}
    r = create(client, **kwargs)
    message = r.choices[0].message
    extra = message.model_extra or {}
    # The template opened <think> in the prompt; the random model never closes it.
    assert extra["reasoning_content"] and extra["reasoning"] == extra["reasoning_content"]
    assert message.content is None
    content, reasoning, _, _ = streamed(client, **kwargs)
    assert reasoning == extra["reasoning_content"] and content == ""
    hidden = create(client, extra_body={**kwargs["extra_body"], "include_reasoning": False})
    assert (hidden.choices[0].message.model_extra or {})["reasoning_content"] is None
    off = create(client).choices[0].message  # thinking off: all content
    assert off.content and (off.model_extra or {})["reasoning_content"] is None
