"""``cache_salt`` is bounded: each sample of a request carries it, and every prompt block's hash
takes it in.

Before: one 8 MB salt with ``n`` 128 held the server's event loop 4.3 s, and a two-token
request sent beside it waited 3.8 s. Now a salt longer than ``MAX_CACHE_SALT_CHARS`` (1,024)
is a 400 naming the field, on every route that takes it; the longest salt is served. A real
``trillm serve`` (fake runner).
"""

from __future__ import annotations

import openai
import pytest
from shared_servers import FAKE_256, FAKE_256_GROUP

from trillm.entrypoints.openai.schemas.protocol import MAX_CACHE_SALT_CHARS

MODEL = "trillm-default"  # the default model's served name

# The server is shared with the other modules of its group (tests/support/shared_servers.py).
pytestmark = pytest.mark.xdist_group(FAKE_256_GROUP)


@pytest.fixture(scope="module")
def client(shared_server):
    server = shared_server(FAKE_256)
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)


def create(client: openai.OpenAI, route: str, salt: str):
    extra = {"cache_salt": salt}
    if route == "completions":
        return client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body=extra)
    if route == "chat":
        messages = [{"role": "user", "content": "hi"}]
        return client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, extra_body=extra
        )
    return client.responses.create(model=MODEL, input="hi", max_output_tokens=16, extra_body=extra)


@pytest.mark.parametrize("route", ["completions", "chat", "responses"])
def test_a_salt_past_the_bound_is_a_400_naming_it(client, route):
    with pytest.raises(openai.BadRequestError) as refused:
        create(client, route, "s" * (MAX_CACHE_SALT_CHARS + 1))
    error = refused.value.body
    assert error["param"] == "cache_salt", error
    assert f"more than the limit of {MAX_CACHE_SALT_CHARS}" in error["message"], error
    assert create(client, route, "s" * MAX_CACHE_SALT_CHARS).id
