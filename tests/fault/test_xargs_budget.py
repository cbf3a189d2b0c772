"""``vllm_xargs`` is bounded: each sample of a request carries a deep copy of its values.

Before: 1,000,000 list entries (a 2 MB body) with ``n`` 64 took 53 s of the server's event
loop, and a two-token request sent beside it waited 48 s; one 8 MB string with ``n`` 128
took 20 s (13.5 s for the request beside it). Now more than ``MAX_XARGS_VALUES`` (4,096, a
list counting its entries) or ``MAX_XARGS_CHARS`` (65,536 in keys and strings) is a 400
naming the field, on every route that takes it; the most allowed with ``n`` 128 is served at
once. A real ``trillm serve`` (fake runner).
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from shared_servers import FAKE_256, FAKE_256_GROUP

from trillm.entrypoints.openai.endpoints.sampling import MAX_XARGS_CHARS, MAX_XARGS_VALUES

MODEL = "trillm-default"  # the default model's served name

# The server is shared with the other modules of its group (tests/support/shared_servers.py).
pytestmark = pytest.mark.xdist_group(FAKE_256_GROUP)


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server(FAKE_256)


OVER = [
    {"ids": [1] * MAX_XARGS_VALUES, "tag": "x"},  # 4,097 values
    {f"k{i}": [1] * 17 for i in range(256)},  # spread over the most keys: 4,352 values
    {"a": "x" * MAX_XARGS_CHARS},  # 65,537 characters with the key
    {"a": ["x" * 1000] * 66},  # in a list's strings
]


@pytest.mark.parametrize("xargs", OVER, ids=["one-list", "many-keys", "a-string", "strings"])
@pytest.mark.parametrize("route", ["completions", "chat", "responses"])
def test_more_values_than_the_bound_is_a_400_naming_it(server, route, xargs):
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    extra = {"vllm_xargs": xargs}
    with pytest.raises(openai.BadRequestError) as refused:
        if route == "completions":
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body=extra)
        elif route == "chat":
            messages = [{"role": "user", "content": "hi"}]
            client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=2, extra_body=extra
            )
        else:
            client.responses.create(model=MODEL, input="hi", max_output_tokens=2, extra_body=extra)
    error = refused.value.body
    assert error["param"] == "vllm_xargs", error
    assert "more than the limit of" in error["message"], error


def test_the_most_values_with_n_128_are_served_at_once(server):
    xargs = {"ids": list(range(MAX_XARGS_VALUES - 1)), "t": "x" * (MAX_XARGS_CHARS - 4)}
    body = {"prompt": "hi", "max_tokens": 4, "n": 128, "vllm_xargs": xargs}
    started = time.monotonic()
    r = httpx.post(server.base_url + "/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 128
    assert time.monotonic() - started < 10
