"""An error answer is bounded whatever the client sent (third attack round).

Before, on a real ``trillm serve`` (fake runner): refusals that quote the value they refuse
quoted it whole: a 4 MB ``tool_choice``, ``response_format.type``, ``reasoning_effort``, content
part ``type``, Responses ``tools[0].type`` or ``truncation``, or Anthropic ``role``, came back
as a 4 MB error (three 4 MB ``logit_bias`` keys: 12 MB), an amplifier for anyone who can send
a body. Now a message is cut at ``MAX_ERROR_MESSAGE_CHARS`` (4,096; its param at 256), saying
how long it was, on OpenAI's and Anthropic's shapes alike. And a ``prompt`` sent as an object
was a 500 (the prompt-count check indexed it as a list); now a 400 naming ``prompt``.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from shared_servers import FAKE_256, FAKE_256_GROUP

from trillm.entrypoints.openai.http.errors import MAX_ERROR_MESSAGE_CHARS

MODEL = "trillm-default"
BIG = "z" * 4_000_000
MESSAGES = [{"role": "user", "content": "hi"}]
# Each answer's message, with the note on its length, fits in this.
MOST = MAX_ERROR_MESSAGE_CHARS + 64

pytestmark = pytest.mark.xdist_group(FAKE_256_GROUP)


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server(FAKE_256)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)


def _refused(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as refused:
        call()
    return refused.value


@pytest.mark.parametrize(
    ("param", "extra"),
    [
        ("tool_choice", {"tool_choice": BIG}),
        ("response_format.type", {"response_format": {"type": BIG}}),
        ("reasoning_effort", {"reasoning_effort": BIG}),
        (
            "messages[0].content[0].type",
            {"messages": [{"role": "user", "content": [{"type": BIG}]}]},
        ),
    ],
)
def test_a_chat_refusal_quotes_a_huge_value_only_in_part(client, param, extra):
    body = {"messages": MESSAGES, **extra}
    error = _refused(
        lambda: client.chat.completions.create(
            model=MODEL, messages=body.pop("messages"), max_tokens=2, extra_body=body
        )
    )
    message = error.body["message"]
    assert len(error.response.content) < MOST + 200, len(error.response.content)
    assert len(message) <= MOST and "characters in all)" in message, message[-200:]
    assert error.body["param"].startswith(param.split(".")[0]), error.body


def test_many_huge_logit_bias_keys_are_quoted_only_in_part(client):
    bias = {f"{BIG}{i}": 1 for i in range(3)}
    error = _refused(
        lambda: client.completions.create(
            model=MODEL, prompt="hi", max_tokens=2, extra_body={"logit_bias": bias}
        )
    )
    assert error.body["param"] == "logit_bias"
    assert len(error.response.content) < MOST + 200, len(error.response.content)


def test_responses_refusals_quote_a_huge_value_only_in_part(client):
    for extra in ({"tools": [{"type": BIG}]}, {"truncation": BIG}):
        error = _refused(
            lambda extra=extra: client.responses.create(model=MODEL, input="hi", extra_body=extra)
        )
        assert len(error.response.content) < MOST + 200, (extra.keys(), len(error.response.content))


def test_anthropic_refusal_quotes_a_huge_value_only_in_part(server):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": BIG, "content": "hi"}]}
    answer = httpx.post(server.url + "/v1/messages", json=body, timeout=60)
    assert answer.status_code == 400, answer.text[:300]
    assert answer.json()["type"] == "error"
    assert len(answer.content) < MOST + 200, len(answer.content)


def test_a_prompt_sent_as_an_object_is_a_400_naming_it(client):
    error = _refused(
        lambda: client.completions.create(model=MODEL, prompt="x", extra_body={"prompt": {"a": 1}})
    )
    assert error.body["param"] == "prompt", error.body
    assert "an array of arrays of integers" in error.body["message"], error.body
