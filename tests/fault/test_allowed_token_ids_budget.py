"""``allowed_token_ids`` is bounded: each of a request's sequences carries and packs the whole
list (n times for n samples), so its length is a client-set cost of every sequence.

Before: the list had no bound but the 16 MiB body: 2,000,000 ids (10 MB) with ``n`` 128 took
80 s of the server's event loop (264 s while ``SamplingParams.clone`` deep-copied the list per
sample), and a two-token request sent beside it waited as long. Now a list longer than
``MAX_ALLOWED_TOKEN_IDS`` (4,096, logit_bias's bound) is a 400 naming the field, and the
longest allowed list with ``n`` 128 is served at once. A real ``trillm serve`` (fake runner).
"""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from shared_servers import FAKE_256, FAKE_256_GROUP

from trillm.entrypoints.openai.schemas.protocol import MAX_ALLOWED_TOKEN_IDS

VOCAB = 4096  # the default model's vocabulary

# The server is shared with the other modules of its group (tests/support/shared_servers.py).
pytestmark = pytest.mark.xdist_group(FAKE_256_GROUP)


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server(FAKE_256)


def ids(count: int) -> list[int]:
    return [i % VOCAB for i in range(count)]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_list_past_the_bound_is_a_400_naming_it(server, route):
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    extra = {"allowed_token_ids": ids(MAX_ALLOWED_TOKEN_IDS + 1)}
    with pytest.raises(openai.BadRequestError) as refused:
        if route == "completions":
            client.completions.create(model="x", prompt="hi", max_tokens=2, extra_body=extra)
        else:
            messages = [{"role": "user", "content": "hi"}]
            client.chat.completions.create(
                model="x", messages=messages, max_tokens=2, extra_body=extra
            )
    error = refused.value.body
    assert error["param"] == "allowed_token_ids", error
    assert f"more than the limit of {MAX_ALLOWED_TOKEN_IDS}" in error["message"], error


def test_the_longest_list_with_n_128_is_served_at_once(server):
    allowed = list(range(0, VOCAB, 2))[:MAX_ALLOWED_TOKEN_IDS]  # the even ids
    body = {"prompt": "hi", "max_tokens": 4, "n": 128, "allowed_token_ids": allowed}
    started = time.monotonic()
    r = httpx.post(server.base_url + "/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert time.monotonic() - started < 10
    assert len(r.json()["choices"]) == 128


def test_a_huge_list_does_not_hold_a_request_beside_it(server):
    """1,000,000 ids with n 16: refused while a two-token request beside it is answered
    promptly (before: ~10 s of the event loop went to the list's copies and packing)."""
    answer: dict[str, object] = {}

    def attack() -> None:
        body = {"prompt": "hi", "max_tokens": 8, "n": 16, "allowed_token_ids": ids(1_000_000)}
        answer["r"] = httpx.post(server.base_url + "/completions", json=body, timeout=300)

    thread = threading.Thread(target=attack)
    thread.start()
    waits = []
    with httpx.Client(base_url=server.base_url, timeout=300) as client:
        while thread.is_alive():
            started = time.monotonic()
            client.post("/completions", json={"prompt": "hi", "max_tokens": 2})
            waits.append(time.monotonic() - started)
    thread.join()
    r = answer["r"]
    assert isinstance(r, httpx.Response) and r.status_code == 400, r
    assert r.json()["error"]["param"] == "allowed_token_ids"
    assert waits and max(waits) < 2.0, waits
