"""Two answers vLLM's own server tests (tests/entrypoints/serve/tokenize/test_tokenization.py)
expect of ``/tokenize`` and ``/tokenizer_info``: a chat's ``tools`` rendered by the chat
template, as chat completions render them, and a tokenizer whose tokenizer_config.json holds
transformers' "no limit" model_max_length (10**30, past 64 bits) answered, not a 500."""

from __future__ import annotations

import json

import httpx
import pytest
from shared_servers import TOOLS_GROUP, TOOLS_KEY, TOOLS_TEMPLATE, tools_server_args

from trillm.entrypoints.openai.http.bodies import json_bytes

pytestmark = pytest.mark.xdist_group(TOOLS_GROUP)

AUTH = {"Authorization": f"Bearer {TOOLS_KEY}"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"location": {"type": "string"}}},
        },
    }
]
CHAT = [{"role": "user", "content": "What's the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server_args(tmp_path_factory) -> list[str]:
    return tools_server_args(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def server(shared_server, server_args):
    return shared_server(server_args)


def tokenize(server, **fields) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json=fields, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_tokenize_renders_the_tools(server, server_args, add_generation_prompt):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(server_args[0])
    text = tokenizer.apply_chat_template(
        CHAT,
        tools=TOOLS,
        chat_template=TOOLS_TEMPLATE,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
    )
    assert "get_weather" in text
    fields = {"messages": CHAT, "add_generation_prompt": add_generation_prompt}
    tokens = tokenize(server, **fields, tools=TOOLS)
    assert tokens == tokenizer.encode(text, add_special_tokens=False)
    assert len(tokens) > len(tokenize(server, **fields))


def test_integers_past_64_bits_are_written_exactly():
    body = {"model_max_length": 1000000000000000019884624838656, "name": "é", "n": 1}
    assert json.loads(json_bytes(body)) == body
    assert json_bytes({"n": 1}) == b'{"n":1}'  # orjson's bytes where it can
