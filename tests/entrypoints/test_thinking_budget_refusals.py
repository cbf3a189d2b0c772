"""``thinking_token_budget`` refused by name where it cannot be kept: a server without
``--reasoning-parser`` (nothing marks the reasoning), and with beam search; the same request
without the field, or with vLLM's "no budget" (-1), is served. The working budget:
test_logprob_ids_thinking_budget.py."""

from __future__ import annotations

import openai
import pytest
from shared_servers import FAKE_256, FAKE_256_GROUP

pytestmark = pytest.mark.xdist_group(FAKE_256_GROUP)

ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client(shared_server):
    srv = shared_server(FAKE_256)
    return openai.OpenAI(base_url=srv.base_url, api_key="-", max_retries=0, timeout=60)


def refusal(create, **kw) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        create(model=None, max_tokens=2, **kw)
    return info.value.body


def test_without_a_reasoning_parser_the_budget_is_refused_by_name(client):
    for create, body in (
        (client.chat.completions.create, {"messages": ASK}),
        (client.completions.create, {"prompt": "hi"}),
    ):
        error = refusal(create, extra_body={"thinking_token_budget": 4}, **body)
        assert error["param"] == "thinking_token_budget", error
        assert "--reasoning-parser" in error["message"], error
        served = create(model=None, max_tokens=2, extra_body={"thinking_token_budget": -1}, **body)
        assert served.choices


def test_beam_search_refuses_the_budget_and_the_logprob_ids(client):
    for field, value in (("thinking_token_budget", 2), ("logprob_token_ids", [1])):
        extra = {"use_beam_search": True, field: value, "logprobs": 1}
        error = refusal(client.completions.create, prompt="hi", n=2, extra_body=extra)
        assert error["param"] == field and "beam search" in error["message"], error
