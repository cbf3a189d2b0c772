"""POST /v1/responses through a real ``trillm serve`` and the official openai client
(``client.responses.create``): text equal to the same chat completion (greedy), streamed
events in OpenAI's order whose deltas make the final text, function_call items from tools,
tool history and reasoning items, ``text.format``, and the 400s naming each refused field.

The server is the one the tool tests use: the default model with <think> tokens, hermes tool
calls and the qwen3 reasoning parser; its template opens a thinking block when the request
asks for a reasoning effort (as gpt-oss-style templates read ``reasoning_effort``).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_harness import ServerProcess

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- if m.reasoning_content %}(thought: {{ m.reasoning_content }}){%- endif %}"
    "{%- for tc in m.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if reasoning_effort is defined and reasoning_effort != 'none' %}<think>\n"
    "{%- else %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}"
)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from trillm.testing.reasoning_model import build_reasoning_model
    from trillm.testing.tiny_models import DEFAULT_MODEL_DIR

    tmp = tmp_path_factory.mktemp("responses")
    model, _, _ = build_reasoning_model(DEFAULT_MODEL_DIR, tmp / "model")
    template = tmp / "template.jinja"
    template.write_text(TEMPLATE)
    srv = ServerProcess(
        [
            str(model),
            "--chat-template",
            str(template),
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--reasoning-parser",
            "qwen3",
            "--max-model-len",
            "1024",
            "--kv-cache-memory",
            "64MiB",
        ],
        tmp / "server.log",
    ).start()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def chat(client, messages, **kw):
    kw = {"max_tokens": 12, "temperature": 0, **kw}
    return client.chat.completions.create(model=None, messages=messages, **kw)


def respond(client, **kw):
    kw = {"input": ASK, "max_output_tokens": 12, "temperature": 0, **kw}
    return client.responses.create(**kw)


def events(client, **kw):
    return list(respond(client, stream=True, **kw))


# ---------------------------------------------------------------- text


def test_text_equals_the_chat_completion(client):
    r = respond(client, instructions="Be brief.")
    c = chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}])
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == c.choices[0].message.content and r.output_text
    assert [item.type for item in r.output] == ["message"]
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.usage.output_tokens == c.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # max_output_tokens cut it: incomplete, as OpenAI reports it
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.instructions == "Be brief." and r.max_output_tokens == 12 and r.store is False
    # A list of message items (input_text parts, a developer message) is the same chat.
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]},
    ]
    assert respond(client, input=items).output_text == r.output_text


def test_sampling_fields_reach_the_engine(client):
    # top_p 1e-6 keeps only the most likely token: greedy even at temperature 1.
    greedy = respond(client).output_text
    assert respond(client, temperature=1.0, top_p=1e-6).output_text == greedy
    short = respond(client, max_output_tokens=3)
    assert short.usage.output_tokens == 3
    r = respond(client, metadata={"team": "a"}, user="u-1")
    assert r.metadata == {"team": "a"} and r.user == "u-1"


def test_vllm_sampling_extras_as_on_chat(client):
    """vLLM's sampling extras of /v1/responses (top_k, min_p, the penalties, seed) reach the
    engine as the same fields of a chat completion do: the same sampled text."""
    extras = {
        "top_k": 8,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.3,
        "seed": 1234,
    }
    r = respond(client, temperature=1.0, extra_body=extras)
    c = chat(client, [{"role": "user", "content": ASK}], temperature=1.0, extra_body=extras)
    assert r.output_text == c.choices[0].message.content and r.output_text
    other = respond(client, temperature=1.0, extra_body={**extras, "repetition_penalty": 2.0})
    plain = respond(client, temperature=1.0, extra_body={"seed": 1234})
    assert len({r.output_text, other.output_text, plain.output_text}) > 1


def test_stream_events_in_order_and_deltas_make_the_text(client):
    full = respond(client)
    stream = events(client)
    kinds = [e.type for e in stream]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in stream] == list(range(len(stream)))
    text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert text == full.output_text
    assert stream[-4].text == text and stream[-3].part.text == text
    final = stream[-1].response
    assert final.output_text == text and final.usage.output_tokens == 12
    assert stream[0].response.status == "in_progress" and stream[0].response.output == []


# ---------------------------------------------------------------- tools


def test_named_tool_gives_a_function_call_item(client):
    choice = {"type": "function", "name": "get_weather"}
    r = respond(client, tools=[WEATHER], tool_choice=choice, max_output_tokens=120)
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    assert r.output_text == "" and r.status == "completed"  # the JSON ended: a stop
    args = json.loads(calls[0].arguments)
    assert set(args) == {"city"}
    stream = events(client, tools=[WEATHER], tool_choice=choice, max_output_tokens=120)
    deltas = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in stream if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments == calls[0].arguments and done.name == "get_weather"
    added = [e.item.type for e in stream if e.type == "response.output_item.added"]
    assert added == ["function_call"]
    assert stream[-1].type == "response.completed"
    assert stream[-1].response.output[0].arguments == calls[0].arguments


def test_function_call_history_is_the_chat_tool_history(client):
    items = [
        {"role": "user", "content": ASK},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "22 C and sunny"},
    ]
    messages = [
        {"role": "user", "content": ASK},
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
    r = respond(client, input=items, tools=[WEATHER], tool_choice="none")
    c = chat(
        client,
        messages,
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        tool_choice="none",
    )
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.output_text == c.choices[0].message.content


def test_tool_fields_reach_the_template_and_parallel_tool_calls(client):
    plain = {k: v for k, v in WEATHER.items() if k != "description"}
    base = respond(client, tools=[plain], tool_choice="none", max_output_tokens=1)
    described = respond(client, tools=[WEATHER], tool_choice="none", max_output_tokens=1)
    strict = respond(
        client, tools=[{**plain, "strict": True}], tool_choice="none", max_output_tokens=1
    )
    # the template renders each tool as JSON: its description and strict flag are in the prompt
    assert described.usage.input_tokens > base.usage.input_tokens + 3
    assert strict.usage.input_tokens > base.usage.input_tokens
    one = respond(
        client,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
    )
    assert [item.type for item in one.output] == ["function_call"]
    assert one.parallel_tool_calls is False and one.tool_choice == "required"


def test_reasoning_history_is_the_chat_reasoning_content(client):
    items = [
        {"role": "user", "content": "hi"},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "be nice"}],
        },
        {"role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
        {"role": "user", "content": "and?"},
    ]
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "reasoning_content": "be nice"},
        {"role": "user", "content": "and?"},
    ]
    r = respond(client, input=items)
    c = chat(client, messages)
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.output_text == c.choices[0].message.content
    no_thought = respond(client, input=[items[0], *items[2:]])
    assert no_thought.usage.input_tokens < r.usage.input_tokens


def test_vllm_extensions_request_id_cache_salt_priority_timeout(client):
    assert respond(client, extra_body={"request_id": "resp_mine"}).id == "resp_mine"
    salt = {"cache_salt": "s1"}
    respond(client, input=ASK * 3, max_output_tokens=1, extra_body=salt)
    again = respond(client, input=ASK * 3, max_output_tokens=1, extra_body=salt)
    other = respond(client, input=ASK * 3, max_output_tokens=1, extra_body={"cache_salt": "s2"})
    assert again.usage.input_tokens_details.cached_tokens > 0
    assert other.usage.input_tokens_details.cached_tokens == 0
    with pytest.raises(openai.BadRequestError) as info:
        respond(client, extra_body={"priority": 1})  # needs --scheduling-policy priority
    assert info.value.body["param"] == "priority"
    late = respond(client, max_output_tokens=900, extra_body={"timeout": 0.2})
    assert late.status == "incomplete" and late.incomplete_details.reason == "timeout"
    assert late.usage.output_tokens < 900


# ---------------------------------------------------------------- reasoning and formats


def test_reasoning_effort_gives_a_reasoning_item(client):
    r = respond(client, reasoning={"effort": "high"})
    c = chat(
        client,
        [{"role": "user", "content": ASK}],
        extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}},
    )
    thought = c.choices[0].message.model_extra["reasoning_content"]
    assert thought  # 12 tokens inside the open <think> block
    assert r.output[0].type == "reasoning" and r.output[0].content[0].text == thought
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    stream = events(client, reasoning={"effort": "high"})
    deltas = "".join(e.delta for e in stream if e.type == "response.reasoning_text.delta")
    assert deltas == thought and stream[-1].response.output[0].type == "reasoning"
    # effort "none": the template closes the thinking block, the text is content
    assert respond(client, reasoning={"effort": "none"}).output[0].type == "message"


def test_thinking_token_budget_ends_the_reasoning_item(client):
    # vLLM's extension, as on chat: </think> forced after 3 reasoning tokens, then the message
    # (without it the 12 tokens are all reasoning, as above)
    budget = {"thinking_token_budget": 3}
    r = respond(client, reasoning={"effort": "high"}, extra_body=budget)
    kwargs = {"chat_template_kwargs": {"reasoning_effort": "high"}}
    c = chat(client, [{"role": "user", "content": ASK}], extra_body={**kwargs, **budget})
    message = c.choices[0].message
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == message.model_extra["reasoning_content"]
    assert r.output_text == message.content and r.output_text


def test_text_format_json_schema_constrains_the_output(client):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    fmt = {
        "format": {
            "type": "json_schema",
            "name": "obj",
            "schema": schema,
            "description": "an object",
            "strict": True,
        }
    }
    r = respond(client, text=fmt, max_output_tokens=40)
    c = chat(
        client,
        [{"role": "user", "content": ASK}],
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "obj", "schema": schema}},
    )
    assert r.output_text == c.choices[0].message.content
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text)["a"], int)
    # name, description and strict are echoed (the grammar enforces the schema either way)
    echoed = r.text.format
    assert (echoed.type, echoed.name, echoed.description, echoed.strict) == (
        "json_schema",
        "obj",
        "an object",
        True,
    )
    r = respond(client, text={"format": {"type": "json_object"}}, max_output_tokens=40)
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "body,param",
    [
        ({"background": True}, "background"),  # (needs the store: vLLM's 400)
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"truncation": "auto"}, "truncation"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
        ({"reasoning": {"generate_summary": "auto"}}, "reasoning.generate_summary"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice.type"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice.name",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": []}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 5000}, "max_output_tokens"),
        ({"model": "other"}, "model"),
    ],
)
def test_refused_fields_are_named(client, body, param):
    kw = {
        "input": body.pop("input", ASK),
        **({"model": body.pop("model")} if "model" in body else {}),
    }
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as info:
        client.responses.create(**kw, extra_body=body)
    assert info.value.body["param"] == param, info.value.body


def test_without_the_store(server, client):
    """Without VLLM_ENABLE_RESPONSES_API_STORE (vLLM's default): 'store' is ignored, nothing
    is kept, and an earlier response is not found (tests/entrypoints/test_responses_store.py
    has the store)."""
    r = respond(client, max_output_tokens=4, store=True)
    assert r.store is False
    for method, path in (("GET", r.id), ("POST", r.id + "/cancel")):
        got = httpx.request(method, server.base_url + "/responses/" + path, timeout=30)
        assert got.status_code == 404, got.text
        assert got.json()["error"]["message"] == f"Response with id '{r.id}' not found."
    with pytest.raises(openai.NotFoundError) as err:
        respond(client, previous_response_id=r.id)
    assert err.value.body["param"] == "response_id"


def test_openapi_lists_responses_and_the_deployment_routes():
    from openapi_spec_validator import validate

    from trillm.entrypoints.openai.schemas.openapi import build_spec

    spec = build_spec()
    validate(spec)
    for path in ("/v1/responses", "/v1/responses/{response_id}", "/ping", "/invocations", "/load"):
        assert path in spec["paths"], path
    request = spec["components"]["schemas"]["ResponsesRequest"]
    assert request["required"] == ["input"]
    assert request["properties"]["max_output_tokens"]["minimum"] == 1
    body = spec["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"].endswith("/ResponsesRequest")
