"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) through a real
``trillm serve`` and the official ``anthropic`` client: text equal to the same chat completion
(greedy), system prompts, stop sequences and max_tokens as Anthropic reports them, the stream
(Anthropic's events, whose final message equals the non-streamed one), forced tool choices whose
tool_use block equals chat's tool call, a tool_result round trip, count_tokens, the API key
(``x-api-key`` or ``Authorization: Bearer``) and errors in Anthropic's shape.

The server is the shared tool server (tests/support/shared_servers.py): the default model with
<think> tokens, a Hermes template, hermes tool calls, the qwen3 reasoning parser and an API key.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from shared_servers import TOOLS_GROUP, TOOLS_KEY, tools_server_args

from trillm.entrypoints.openai.endpoints.anthropic_convert import to_chat_request
from trillm.entrypoints.openai.endpoints.anthropic_output import stop_reason
from trillm.entrypoints.openai.http.errors import BadRequestError
from trillm.entrypoints.openai.schemas.anthropic import MessagesRequest

pytestmark = pytest.mark.xdist_group(TOOLS_GROUP)

ASK = "What is the weather in Paris?"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
TIME_SCHEMA = {
    "type": "object",
    "properties": {"tz": {"type": "string", "enum": ["CET", "UTC"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": WEATHER_SCHEMA,
    },
    {"name": "get_time", "input_schema": TIME_SCHEMA},
]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": WEATHER_SCHEMA,
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_SCHEMA}},
]


@pytest.fixture(scope="module")
def server(shared_server, tmp_path_factory):
    return shared_server(tools_server_args(tmp_path_factory.getbasetemp()))


@pytest.fixture(scope="module")
def model(server):
    headers = {"Authorization": f"Bearer {TOOLS_KEY}"}
    return httpx.get(server.base_url + "/models", headers=headers).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(server):
    import anthropic  # the official client (~1.6 CPU-s): imported by the tests that use it

    return anthropic.Anthropic(base_url=server.url, api_key=TOOLS_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat_client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=TOOLS_KEY, max_retries=0, timeout=120)


def _request(kw):
    """The keywords of a greedy request; sampling fields go in the body as extras (the
    client's signature no longer lists them; the API still takes them)."""
    sampling = {k: kw.pop(k) for k in ("temperature", "top_p", "top_k") if k in kw}
    extra = {"temperature": 0, **sampling, **kw.pop("extra_body", {})}
    return {
        "messages": [{"role": "user", "content": ASK}],
        "max_tokens": 12,
        **kw,
        "extra_body": extra,
    }


def message(client, model, **kw):
    return client.messages.create(model=model, **_request(kw))


def chat(chat_client, messages, **kw):
    kw = {"max_tokens": 12, "temperature": 0, **kw}
    return chat_client.chat.completions.create(model=None, messages=messages, **kw)


def streamed(client, model, **kw):
    with client.messages.stream(model=model, **_request(kw)) as stream:
        return stream.get_final_message()


def dump(msg):
    """A message's content, stop and usage, as plain data; not its ids (new per request)."""
    body = msg.model_dump()
    for block in body["content"]:
        block.pop("id", None)
    return {k: body[k] for k in ("content", "stop_reason", "stop_sequence", "usage", "model")}


# ---------------------------------------------------------------- text


def test_text_equals_the_chat_completion(client, chat_client, model):
    m = message(client, model, system="Be brief.")
    c = chat(
        chat_client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}]
    )
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert m.model == model
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == c.choices[0].message.content and m.content[0].text
    assert m.usage.input_tokens == c.usage.prompt_tokens
    assert m.usage.output_tokens == c.usage.completion_tokens == 12
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    # System text blocks and user text blocks are the same chat, as content parts.
    blocks = message(
        client,
        model,
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": ASK}]}],
        metadata={"user_id": "u-1"},
    )
    parts = chat(
        chat_client,
        [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "text", "text": ASK}]},
        ],
    )
    assert blocks.content[0].text == parts.choices[0].message.content


def test_sampling_fields_reach_the_engine(client, model):
    greedy = message(client, model).content[0].text
    # top_p 1e-6 (or top_k 1) keeps only the most likely token: greedy even at temperature 1.
    assert message(client, model, temperature=1.0, top_p=1e-6).content[0].text == greedy
    assert message(client, model, temperature=1.0, top_k=1).content[0].text == greedy
    short = message(client, model, max_tokens=3)
    assert short.usage.output_tokens == 3 and short.stop_reason == "max_tokens"


def test_stop_sequences(client, chat_client, model):
    full = message(client, model, max_tokens=24).content[0].text
    stop = full[4:7]
    m = message(client, model, max_tokens=24, stop_sequences=["\x00never", stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == full[: full.index(stop)]
    c = chat(
        chat_client, [{"role": "user", "content": ASK}], max_tokens=24, stop=["\x00never", stop]
    )
    assert m.usage.output_tokens == c.usage.completion_tokens
    assert m.content[0].text == c.choices[0].message.content


# ---------------------------------------------------------------- streaming


def test_stream_final_message_equals_the_message(client, model):
    for kw in ({}, {"system": "Be brief.", "max_tokens": 5}):
        whole = message(client, model, **kw)
        assert dump(streamed(client, model, **kw)) == dump(whole)
    stop = message(client, model, max_tokens=24).content[0].text[4:7]
    kw = {"max_tokens": 24, "stop_sequences": [stop]}
    assert dump(streamed(client, model, **kw)) == dump(message(client, model, **kw))


def test_stream_events_as_anthropic_sends_them(server, model):
    body = {"model": model, "max_tokens": 6, "stream": True, "temperature": 0}
    body["messages"] = [{"role": "user", "content": ASK}]
    headers = {"x-api-key": TOOLS_KEY}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers=headers) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = []
    for chunk in text.strip().split("\n\n"):
        name, data = chunk.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        events.append((name[7:], json.loads(data[6:])))
    assert all(kind == data["type"] for kind, data in events)
    kinds = [kind for kind, _ in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert (
        start["id"].startswith("msg_") and start["content"] == [] and start["stop_reason"] is None
    )
    assert events[2][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for _, d in events[3:-3])
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    # vLLM's message_delta: the request's whole usage (no cache counts without
    # --enable-prompt-tokens-details)
    assert delta["usage"] == {"input_tokens": start["usage"]["input_tokens"], "output_tokens": 6}


# ---------------------------------------------------------------- tools


def tool_blocks(msg):
    return [(b.name, b.input) for b in msg.content if b.type == "tool_use"]


def chat_calls(response):
    calls = response.choices[0].message.tool_calls or []
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def test_forced_tool_choices_equal_chats_tool_calls(client, chat_client, model):
    ask = [{"role": "user", "content": ASK}]
    named = {"type": "tool", "name": "get_weather"}
    m = message(client, model, tools=TOOLS, tool_choice=named, max_tokens=120)
    c = chat(
        chat_client,
        ask,
        tools=CHAT_TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=120,
    )
    assert tool_blocks(m) == chat_calls(c) and tool_blocks(m)[0][0] == "get_weather"
    assert [b.type for b in m.content] == ["tool_use"] and m.content[0].id
    assert m.stop_reason == "tool_use"
    assert dump(streamed(client, model, tools=TOOLS, tool_choice=named, max_tokens=120)) == dump(m)
    # "any" is chat's "required"; disable_parallel_tool_use: one call.
    any_one = {"type": "any", "disable_parallel_tool_use": True}
    m = message(client, model, tools=TOOLS, tool_choice=any_one, max_tokens=200)
    c = chat(
        chat_client,
        ask,
        tools=CHAT_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
    )
    assert tool_blocks(m) == chat_calls(c) and len(tool_blocks(m)) == 1
    assert m.stop_reason == "tool_use"
    assert dump(streamed(client, model, tools=TOOLS, tool_choice=any_one, max_tokens=200)) == dump(
        m
    )


def test_tool_choice_auto_and_none_answer_text(client, chat_client, model):
    ask = [{"role": "user", "content": ASK}]
    for choice, chat_choice in (({"type": "auto"}, "auto"), ({"type": "none"}, "none")):
        m = message(client, model, tools=TOOLS, tool_choice=choice)
        c = chat(chat_client, ask, tools=CHAT_TOOLS, tool_choice=chat_choice)
        assert m.content[0].text == c.choices[0].message.content
        assert m.usage.input_tokens == c.usage.prompt_tokens


def test_tool_result_round_trip(client, chat_client, model):
    messages = [
        {"role": "user", "content": ASK},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    m = message(client, model, tools=TOOLS, messages=messages)
    chat_messages = [
        {"role": "user", "content": ASK},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Checking."}],
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny, 21 C"},
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
    ]
    c = chat(chat_client, chat_messages, tools=CHAT_TOOLS)
    assert m.usage.input_tokens == c.usage.prompt_tokens
    assert m.content[0].text == c.choices[0].message.content
    # The history is in the prompt: more tokens than the question alone with the tools.
    assert m.usage.input_tokens > message(client, model, tools=TOOLS).usage.input_tokens + 20


def test_thinking_blocks_from_the_reasoning_parser(client, chat_client, model):
    kw = {"chat_template_kwargs": {"enable_thinking": True}}
    m = message(client, model, extra_body=kw)
    c = chat(chat_client, [{"role": "user", "content": ASK}], extra_body=kw)
    reasoning = c.choices[0].message.model_extra["reasoning_content"]
    assert reasoning and m.content[0].type == "thinking" and m.content[0].thinking == reasoning
    assert dump(streamed(client, model, extra_body=kw)) == dump(m)


# ---------------------------------------------------------------- count_tokens


def test_count_tokens_is_the_prompt(client, model):
    import anthropic

    for kw in ({}, {"system": "Be brief.", "tools": TOOLS}):
        counted = client.messages.count_tokens(
            model=model, messages=[{"role": "user", "content": ASK}], **kw
        )
        assert counted.input_tokens == message(client, model, **kw).usage.input_tokens > 0
    ask = [{"role": "user", "content": ASK}]
    plain = client.messages.count_tokens(model=model, messages=ask).input_tokens
    # The template's variables reach the count as they reach the prompt (an open think block).
    kw = {"chat_template_kwargs": {"enable_thinking": True}}
    thinking = client.messages.count_tokens(model=model, messages=ask, extra_body=kw)
    assert thinking.input_tokens == message(client, model, extra_body=kw).usage.input_tokens
    assert thinking.input_tokens < plain
    marked = client.messages.count_tokens(
        model=model, messages=ask, cache_control={"type": "ephemeral", "ttl": "1h"}
    )
    assert marked.input_tokens == plain
    for kw, fragment in (
        ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "'nope'"),
        ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens"),
        ({"cache_control": {"type": "forever"}}, "'cache_control' must be"),
        ({"extra_body": {"max_tokens": 5}}, "Unknown field 'max_tokens'"),
    ):
        with pytest.raises(anthropic.BadRequestError, match=fragment):
            client.messages.count_tokens(model=model, messages=ask, **kw)


# ---------------------------------------------------------------- auth and errors


def test_the_api_key_as_x_api_key_or_bearer(server, model):
    import anthropic

    body = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        refused = httpx.post(server.url + path, json=body)
        assert refused.status_code == 401
        assert refused.json() == {
            "type": "error",
            "error": {"type": "authentication_error", "message": "Invalid or missing API key."},
        }
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=model, max_tokens=2, messages=body["messages"])
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=TOOLS_KEY, max_retries=0)
    assert bearer.messages.create(model=model, max_tokens=2, messages=body["messages"]).content
    # vLLM's routes take Bearer only (as vLLM), and keep OpenAI's error shape.
    chat_body = {"messages": body["messages"], "max_tokens": 2}
    refused = httpx.post(
        server.base_url + "/chat/completions", json=chat_body, headers={"x-api-key": TOOLS_KEY}
    )
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "AuthenticationError"


BAD = [
    ({"max_tokens": None}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"stream_options": {}}, "Unknown field 'stream_options'"),
    ({"container": "c-1"}, "'container' is not supported"),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens"),
    ({"metadata": {"team": "a"}}, "metadata.team"),
    ({"service_tier": "priority"}, "service_tier"),
    ({"cache_control": {"type": "forever"}}, "'cache_control' must be"),
    ({"messages": [{"role": "system", "content": "x"}]}, "top-level 'system'"),
    (
        {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
        "of type 'document' are not supported",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]},
        "messages[0].content[0].x",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                        }
                    ],
                }
            ]
        },
        "this model takes no image inputs",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t",
                            "content": "x",
                            "is_error": True,
                        }
                    ],
                }
            ]
        },
        "'is_error' true is not supported",
    ),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "not available"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "'nope'"),
    ({"tools": TOOLS, "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
]


@pytest.mark.parametrize(("fields", "fragment"), BAD)
def test_bad_input_is_a_400_in_anthropics_shape(server, model, fields, fragment):
    body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    body = {k: v for k, v in {**body, **fields}.items() if v is not None}
    r = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": TOOLS_KEY})
    assert r.status_code == 400, r.text
    error = r.json()
    assert set(error) == {"type", "error"} and error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert fragment in error["error"]["message"]


def test_unknown_model_and_route_in_anthropics_shape(client, server):
    import anthropic

    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(
            model="claude-nope", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    assert info.value.body["error"]["type"] == "not_found_error"
    r = httpx.post(server.url + "/v1/messages/batches", json={}, headers={"x-api-key": TOOLS_KEY})
    assert r.status_code in (404, 405) and r.json()["type"] == "error"


# ---------------------------------------------------------------- without a server


def test_stop_reasons():
    assert stop_reason("length", None, False) == ("max_tokens", None)
    assert stop_reason("stop", None, False) == ("end_turn", None)  # EOS
    assert stop_reason("stop", 7, False) == ("end_turn", None)  # a stop token
    assert stop_reason("stop", "###", False) == ("stop_sequence", "###")
    assert stop_reason("stop", None, True) == ("tool_use", None)  # a named tool choice
    assert stop_reason("tool_calls", None, True) == ("tool_use", None)
    assert stop_reason("abort", None, False) == (None, None)


def test_a_tool_result_after_text_splits_the_turn():
    req = MessagesRequest(
        model="m",
        max_tokens=1,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "a"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "t",
                        "content": [{"type": "text", "text": "r"}],
                    },
                    {"type": "text", "text": "b"},
                ],
            }
        ],
    )
    chat = to_chat_request(req, "msg_1", takes_images=False)
    assert [(m.role, [p.text for p in m.content]) for m in chat.messages] == [
        ("user", ["a"]),
        ("tool", ["r"]),
        ("user", ["b"]),
    ]
    assert chat.messages[1].tool_call_id == "t" and chat.max_tokens == 1
    with pytest.raises(BadRequestError) as info:
        to_chat_request(
            MessagesRequest(
                model="m",
                max_tokens=1,
                messages=[{"role": "user", "content": [{"type": "tool_use", "id": "x"}]}],
            ),
            "msg_2",
            takes_images=False,
        )
    assert info.value.param == "messages[0].content[0].type"


def test_image_blocks_become_image_parts_for_a_model_that_takes_images():
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
    }
    url = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    req = MessagesRequest(
        model="m",
        max_tokens=1,
        messages=[{"role": "user", "content": [image, url, {"type": "text", "text": "what?"}]}],
    )
    (user,) = to_chat_request(req, "msg_3", takes_images=True).messages
    assert [(p.type, p.image_url.url if p.image_url else p.text) for p in user.content] == [
        ("image_url", "data:image/png;base64,AA=="),
        ("image_url", "https://example.com/a.png"),
        ("text", "what?"),
    ]
    with pytest.raises(BadRequestError) as info:
        to_chat_request(req, "msg_4", takes_images=False)
    assert info.value.param == "messages[0].content[0].type"
