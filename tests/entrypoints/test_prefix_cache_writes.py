"""Prompt tokens written to the prefix cache, reported as vLLM reports them, read with the
official clients from ``trillm serve`` (fake runner, --enable-prompt-tokens-details, blocks of
16 tokens): chat's ``usage.prompt_tokens_details.created_cache_tokens``, Responses'
``usage.input_tokens_details.cache_write_tokens``, Anthropic's
``usage.cache_creation_input_tokens`` (out of ``input_tokens``), answered and streamed. vLLM's
count: on a request's first output, the prompt tokens of its full blocks in the prefix cache
less the ones it read from there; 0 with prefix caching off.
"""

from __future__ import annotations

import pytest
from shared_servers import FAKE_256_GROUP, FAKE_256_USAGE, USAGE_KEY

pytestmark = pytest.mark.xdist_group(FAKE_256_GROUP)

BLOCK = 16


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server(FAKE_256_USAGE)


@pytest.fixture(scope="module")
def uncached_server(shared_server):
    return shared_server([*FAKE_256_USAGE, "--no-enable-prefix-caching"])


def long_text(tag: str) -> str:
    return tag + " " + " ".join(f"w{i}" for i in range(60))  # several full KV blocks


def openai_client(srv):
    import openai

    return openai.OpenAI(base_url=srv.url + "/v1", api_key=USAGE_KEY, max_retries=0, timeout=60)


def chat_details(client, content: str, stream: bool = False) -> tuple[int, dict]:
    kw = dict(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": content}],
        max_tokens=2,
    )
    if stream:
        chunks = list(client.chat.completions.create(**kw, stream=True))
        usage = chunks[-1].usage.model_dump()
    else:
        usage = client.chat.completions.create(**kw).usage.model_dump()
    return usage["prompt_tokens"], usage["prompt_tokens_details"]


def test_chat_reports_the_prompt_tokens_written_to_the_cache(server):
    client = openai_client(server)
    text = long_text("chat")
    prompt, cold = chat_details(client, text)
    assert prompt > 3 * BLOCK
    assert cold["cached_tokens"] == 0
    assert cold["created_cache_tokens"] == prompt // BLOCK * BLOCK  # every full block
    _, warm = chat_details(client, text)
    assert warm["cached_tokens"] > 0  # read back: written again only past the hit
    assert warm["cached_tokens"] + warm["created_cache_tokens"] == cold["created_cache_tokens"]
    assert warm["created_cache_tokens"] < BLOCK
    _, streamed = chat_details(client, text, stream=True)  # the stream's usage chunk
    assert streamed["created_cache_tokens"] == warm["created_cache_tokens"]
    assert streamed["cached_tokens"] == warm["cached_tokens"]


def responses_details(client, text: str, stream: bool = False) -> tuple[int, dict]:
    kw = dict(model=client.models.list().data[0].id, input=text, max_output_tokens=16)
    if stream:
        events = list(client.responses.create(**kw, stream=True))
        usage = events[-1].response.usage.model_dump()
    else:
        usage = client.responses.create(**kw).usage.model_dump()
    return usage["input_tokens"], usage["input_tokens_details"]


def test_responses_report_the_cache_write_tokens(server):
    client = openai_client(server)
    text = long_text("responses")
    prompt, cold = responses_details(client, text)
    assert cold["cached_tokens"] == 0
    assert cold["cache_write_tokens"] == prompt // BLOCK * BLOCK
    _, warm = responses_details(client, text, stream=True)
    assert warm["cached_tokens"] > 0
    assert warm["cached_tokens"] + warm["cache_write_tokens"] == cold["cache_write_tokens"]


def test_messages_report_cache_creation_input_tokens(server):
    import anthropic

    model = openai_client(server).models.list().data[0].id
    client = anthropic.Anthropic(base_url=server.url, api_key=USAGE_KEY, max_retries=0)
    kw = dict(model=model, max_tokens=2, messages=[{"role": "user", "content": long_text("m")}])
    cold = client.messages.create(**kw).usage
    assert cold.cache_read_input_tokens == 0 and cold.cache_creation_input_tokens > 3 * BLOCK
    prompt = cold.input_tokens + cold.cache_creation_input_tokens
    assert cold.cache_creation_input_tokens == prompt // BLOCK * BLOCK
    with client.messages.stream(**kw) as stream:
        warm = stream.get_final_message().usage
    assert warm.cache_read_input_tokens > 0 and warm.cache_creation_input_tokens < BLOCK
    assert (
        warm.input_tokens + warm.cache_read_input_tokens + warm.cache_creation_input_tokens
        == prompt
    )


def test_nothing_written_without_prefix_caching(uncached_server):
    """vLLM with prefix caching off: no block enters the cache, both counts 0."""
    import anthropic

    client = openai_client(uncached_server)
    for _ in range(2):
        _, details = chat_details(client, long_text("off"))
        assert (details["cached_tokens"], details["created_cache_tokens"]) == (0, 0)
    _, details = responses_details(client, long_text("off"))
    assert (details["cached_tokens"], details["cache_write_tokens"]) == (0, 0)
    model = client.models.list().data[0].id
    msgs = anthropic.Anthropic(base_url=uncached_server.url, api_key=USAGE_KEY, max_retries=0)
    usage = msgs.messages.create(
        model=model, max_tokens=2, messages=[{"role": "user", "content": long_text("off")}]
    ).usage
    assert (usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (0, 0)
    assert usage.input_tokens > 3 * BLOCK
