"""Heavy but well-formed requests must not slow the others (issue 11, found by hostile
requests).

- ``request_id`` is bounded: the id travels with every engine step (scheduler, worker
  messages, every output and SSE chunk), so before the bound three requests with 1 MB ids
  slowed a 200-token request beside them from 0.3 s to 14 s. Now an id longer than
  ``MAX_REQUEST_ID_CHARS`` is a 400 naming ``request_id`` before any work, the OpenAPI
  document says ``maxLength``, and the request beside them keeps its pace.
- A large body is structured on a worker thread, not on the event loop.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from server_harness import post_polling_health
from shared_servers import FAKE_512_TEMPLATES, FAKE_512_TEMPLATES_GROUP

from trillm.entrypoints.openai.schemas.protocol import MAX_CHAT_CONTENT_PARTS, MAX_REQUEST_ID_CHARS

# The server is shared with the other modules of its group (tests/support/shared_servers.py).
pytestmark = pytest.mark.xdist_group(FAKE_512_TEMPLATES_GROUP)


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server(FAKE_512_TEMPLATES)


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"prompt": "hi", "max_tokens": 4}


@pytest.mark.parametrize(
    "path,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]
)
def test_request_id_length(server, path, body):
    longest = "r" * MAX_REQUEST_ID_CHARS
    ok = httpx.post(server.url + path, json={**body, "request_id": longest}, timeout=60)
    assert ok.status_code == 200, ok.text
    assert ok.json()["id"] == longest
    too_long = {**body, "request_id": "r" * (MAX_REQUEST_ID_CHARS + 1)}
    r = httpx.post(server.url + path, json=too_long, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "request_id"


def test_openapi_states_the_bound(server):
    spec = httpx.get(server.url + "/openapi.json", timeout=10).json()
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        prop = spec["components"]["schemas"][name]["properties"]["request_id"]
        assert prop["maxLength"] == MAX_REQUEST_ID_CHARS


def test_huge_ids_do_not_slow_others(server):
    def normal() -> float:
        start = time.monotonic()
        body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return time.monotonic() - start

    alone = min(normal() for _ in range(2))
    answers: list[int] = []

    def hostile(i: int) -> None:
        body = {
            "prompt": "x",
            "request_id": f"{i}" + "a" * 1_000_000,
            "max_tokens": 300,
            "ignore_eos": True,
            "stream": True,
        }
        answers.append(
            httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code
        )

    threads = [threading.Thread(target=hostile, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    beside = normal()
    for t in threads:
        t.join()
    assert answers == [400, 400, 400]
    assert beside < max(5 * alone, 3.0), (alone, beside)


def test_large_body_is_structured_off_the_event_loop(server):
    """400,000 text parts in one chat message (12 MB, under the body limit): structuring them
    took ~8 s on the event loop, /health waited as long. Now it runs on a worker thread (and
    parts past MAX_CHAT_CONTENT_PARTS are refused before it: here exactly that many)."""
    parts = [{"type": "text", "text": "x"}] * MAX_CHAT_CONTENT_PARTS
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 2}
    answer, took, worst = post_polling_health(server, "/v1/chat/completions", body)
    status = answer.status_code
    assert status == 400  # far longer than the context
    # Before: /health waited about as long as the whole request.
    assert worst < 0.3 * took, (worst, took)
