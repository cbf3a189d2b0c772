"""A chat's content parts are bounded in all, before they are structured (third attack round).

Before: the messages of a chat were bounded (``MAX_CHAT_MESSAGES``) but not their content
parts: one message of 500,000 text parts (a 9 MB body) cost 11-31 s of a worker thread's CPU
(structuring, rendering, tokenizing) before its context-length refusal, and a request beside it
waited 0.5-1.7 s. Now the parts of all messages together (with an Anthropic block's own
``content`` list) are at most ``MAX_CHAT_CONTENT_PARTS``, counted on the raw JSON: more is a
400 naming the message's ``content``, on chat completions (official ``openai`` client),
``/tokenize``, ``/v1/responses`` ``input`` and ``/v1/messages``. A real ``trillm serve``
(fake runner).
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest
from server_harness import post_polling_health
from shared_servers import FAKE_512_TEMPLATES, FAKE_512_TEMPLATES_GROUP

from trillm.entrypoints.openai.http.errors import BadRequestError
from trillm.entrypoints.openai.schemas.protocol import MAX_CHAT_CONTENT_PARTS
from trillm.entrypoints.openai.schemas.structuring import _check_parts

MODEL = "trillm-default"  # the default model's served name
OVER = MAX_CHAT_CONTENT_PARTS + 1

# The server is shared with the other modules of its group (tests/support/shared_servers.py).
pytestmark = pytest.mark.xdist_group(FAKE_512_TEMPLATES_GROUP)


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server(FAKE_512_TEMPLATES)


def _parts(n: int, kind: str = "text") -> list[dict[str, Any]]:
    return [{"type": kind, "text": ""}] * n


def _assert_refused(error: dict[str, Any], param: str) -> None:
    assert error["param"] == param, error
    assert f"more than {MAX_CHAT_CONTENT_PARTS} content parts in all" in error["message"], error


def test_chat_parts_past_the_bound_are_refused_at_once(server):
    """One message of MAX_CHAT_CONTENT_PARTS + 1 parts, and the same spread over two messages:
    a 400 naming the content where the count passes the bound, /health answering meanwhile,
    and a chat beside it served."""
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)
    for messages, param in (
        ([{"role": "user", "content": _parts(OVER)}], "messages[0].content"),
        (
            [
                {"role": "user", "content": _parts(OVER // 2)},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": _parts(OVER - OVER // 2)},
            ],
            "messages[2].content",
        ),
    ):
        start = time.monotonic()
        with pytest.raises(openai.BadRequestError) as refused:
            # NOTE: as extra_body: the client's own typing of 100,000 parts takes it ~35 s
            client.chat.completions.create(
                model=MODEL, messages=[], max_tokens=2, extra_body={"messages": messages}
            )
        took = time.monotonic() - start
        _assert_refused(refused.value.body, param)
        print(f"{param}: refused in {took:.2f} s")
        assert took < 5, took
    body = {"messages": [{"role": "user", "content": _parts(OVER)}], "max_tokens": 2}
    r, took, worst = post_polling_health(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert worst < 1.0, (worst, took)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": _parts(3)}], max_tokens=2
    )
    assert reply.choices


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"messages": [{"role": "user", "content": _parts(OVER)}]}, None),
        (
            "/v1/responses",
            {
                "input": [{"role": "user", "content": _parts(OVER, "input_text")}],
                "max_output_tokens": 2,
            },
            "input[0].content",
        ),
        (
            "/v1/messages",
            {
                "model": MODEL,
                "max_tokens": 2,
                "messages": [{"role": "user", "content": _parts(OVER)}],
            },
            None,
        ),
        (  # Anthropic's tool result blocks carry their own content list: counted too
            "/v1/messages",
            {
                "model": MODEL,
                "max_tokens": 2,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "t", "content": _parts(OVER)}
                        ],
                    }
                ],
            },
            None,
        ),
    ],
    ids=["tokenize", "responses", "anthropic", "anthropic-tool-result"],
)
def test_the_other_chat_routes_share_the_bound(server, path, body, param):
    start = time.monotonic()
    r = httpx.post(server.url + path, json=body, timeout=120)
    took = time.monotonic() - start
    assert r.status_code == 400, r.text
    answer = r.json()
    error = answer["error"] if "error" in answer and "param" in answer["error"] else answer
    if param is None:  # Anthropic's error shape carries no param; the message names it
        assert "messages[0].content" in r.text, r.text
        assert f"more than {MAX_CHAT_CONTENT_PARTS} content parts" in r.text, r.text
    else:
        _assert_refused(error, param)
    assert took < 5, took


def test_the_count_is_of_all_messages_and_reaches_the_bound():
    """Exactly the bound passes; one more is refused; strings, non-dict messages and parts
    without a list content count nothing."""
    messages: list[Any] = [
        {"role": "system", "content": "a string"},
        "not a message",
        {"role": "user", "content": _parts(2)},
        {"role": "user", "content": [{"type": "tool_result", "content": _parts(1)}]},
    ]
    _check_parts(messages, 4, "messages")  # 2 + 1 block + 1 inside it
    with pytest.raises(BadRequestError) as refused:
        _check_parts(messages, 3, "messages")
    assert refused.value.param == "messages[3].content"
