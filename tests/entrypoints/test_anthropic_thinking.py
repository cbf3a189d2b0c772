"""Anthropic's ``thinking`` on /v1/messages and /v1/messages/count_tokens, mapped as vLLM maps
it: ``enabled`` with ``budget_tokens`` (>= 1024, below max_tokens) becomes chat's
``thinking_token_budget`` (whose effect on the reasoning section is tested in
test_logprob_ids_thinking_budget.py); ``disabled`` becomes ``reasoning_effort: "none"``;
``adaptive`` pins nothing. Shapes vLLM would not take are a 400 naming the key.

The server is the shared tool server (the qwen3 reasoning parser, a 1024-token context).
"""

from __future__ import annotations

import pytest
from shared_servers import TOOLS_GROUP, TOOLS_KEY, tools_server_args

from trillm.entrypoints.openai.endpoints.anthropic_convert import to_chat_request
from trillm.entrypoints.openai.http.errors import BadRequestError
from trillm.entrypoints.openai.schemas.anthropic import MessagesRequest, check_thinking

pytestmark = pytest.mark.xdist_group(TOOLS_GROUP)

ASK = [{"role": "user", "content": "What is two plus two?"}]


@pytest.fixture(scope="module")
def client(shared_server, tmp_path_factory):
    import anthropic  # the official client (~1.6 CPU-s): imported by the tests that use it

    srv = shared_server(tools_server_args(tmp_path_factory.getbasetemp()))
    return anthropic.Anthropic(base_url=srv.url, api_key=TOOLS_KEY, max_retries=0, timeout=120)


@pytest.mark.parametrize(
    "thinking,budget,effort",
    [
        ({"type": "enabled", "budget_tokens": 1500}, 1500, None),
        ({"type": "enabled", "budget_tokens": 1024, "display": "summarized"}, 1024, None),
        ({"type": "disabled"}, None, "none"),
        ({"type": "adaptive"}, None, None),
        (None, None, None),
    ],
)
def test_thinking_maps_to_chats_fields_as_vllm_maps_it(thinking, budget, effort):
    req = MessagesRequest(model="m", max_tokens=2000, messages=ASK, thinking=thinking)
    check_thinking(req.thinking, req.max_tokens)
    chat = to_chat_request(req, "msg_1", takes_images=False)
    assert (chat.thinking_token_budget, chat.reasoning_effort) == (budget, effort)


BAD = [
    ({"type": "enabled", "budget_tokens": 1023}, 2000, "thinking.budget_tokens"),
    ({"type": "enabled", "budget_tokens": 2000}, 2000, "thinking.budget_tokens"),
    ({"type": "enabled", "budget_tokens": True}, 2000, "thinking.budget_tokens"),
    ({"type": "enabled"}, 2000, "thinking.budget_tokens"),
    ({"type": "adaptive", "display": "omitted"}, 2000, "thinking.display"),
    ({"type": "disabled", "budget_tokens": 1024}, 2000, "thinking.budget_tokens"),
    ({"type": "sometimes"}, 2000, "thinking.type"),
    ({"type": ["enabled"]}, 2000, "thinking.type"),
]


@pytest.mark.parametrize("thinking,max_tokens,param", BAD)
def test_shapes_vllm_would_not_take_are_refused_naming_the_key(thinking, max_tokens, param):
    with pytest.raises(BadRequestError) as info:
        check_thinking(thinking, max_tokens)
    assert info.value.param == param


def test_over_http_a_budget_is_taken_and_a_bad_one_is_a_400(client):
    import anthropic

    model = client.models.list().data[0].id
    # count_tokens has no max_tokens: a budget alone is taken (it was refused before).
    counted = client.messages.count_tokens(
        model=model, messages=ASK, thinking={"type": "enabled", "budget_tokens": 1024}
    )
    plain = client.messages.count_tokens(model=model, messages=ASK)
    assert counted.input_tokens == plain.input_tokens > 0
    greedy = {"extra_body": {"temperature": 0}}  # the client no longer lists it; the API takes it
    disabled = client.messages.create(
        model=model, max_tokens=8, messages=ASK, thinking={"type": "disabled"}, **greedy
    )
    default = client.messages.create(model=model, max_tokens=8, messages=ASK, **greedy)
    assert disabled.content == default.content  # the template's default is no thinking
    with pytest.raises(anthropic.BadRequestError, match="less than max_tokens"):
        client.messages.create(
            model=model,
            max_tokens=8,
            messages=ASK,
            thinking={"type": "enabled", "budget_tokens": 1024},
        )
