"""/v1/responses input costs what a chat's messages cost (issue 33, found by hostile requests).

Consecutive ``function_call`` items make one assistant turn; the turn's call list was copied
for each call, so 100,000 of them took 24.8 s on the event loop (100,000 plain messages: 1.3 s)
and ``/health`` waited as long. Now the list grows in place, a turn holds at most as many calls
as a chat message's ``tool_calls`` (1,024; more is a 400 naming the item), and a large input
is turned into a chat on a worker thread.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from server_harness import post_polling_health
from shared_servers import FAKE_512_TEMPLATES, FAKE_512_TEMPLATES_GROUP

from trillm.entrypoints.openai.endpoints.responses import MAX_TURN_CALLS

ITEMS = 60_000


# The server is shared with the other modules of its group (tests/support/shared_servers.py).
pytestmark = pytest.mark.xdist_group(FAKE_512_TEMPLATES_GROUP)


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server(FAKE_512_TEMPLATES)


def _call(i: int) -> dict[str, Any]:
    return {"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"}


def _post_watching_health(server, body: dict[str, Any]) -> tuple[httpx.Response, float, float]:
    """POST /v1/responses; returns the answer, its time and the slowest /health meanwhile."""
    return post_polling_health(server, "/v1/responses", body)


def test_consecutive_calls_cost_what_messages_cost(server):
    """60,000 consecutive function_call items: a 400 naming the item past one turn's calls,
    in about the time 60,000 plain messages take (before: ~10x as long, /health as long)."""
    plain = [{"role": "user", "content": "x"}] * ITEMS
    r, messages_took, _ = _post_watching_health(server, {"input": plain, "max_output_tokens": 2})
    assert r.status_code == 400, r.text  # far longer than the context
    calls = [_call(i) for i in range(ITEMS)]
    r, calls_took, worst = _post_watching_health(server, {"input": calls, "max_output_tokens": 2})
    print(f"messages {messages_took:.2f} s, calls {calls_took:.2f} s, /health {worst:.2f} s")
    assert calls_took < 3 * messages_took + 1.0, (calls_took, messages_took)
    assert worst < max(0.5 * calls_took, 1.0), (worst, calls_took)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == f"input[{MAX_TURN_CALLS}]", error
    assert f"At most {MAX_TURN_CALLS} consecutive function_call items" in error["message"]


def test_turns_of_many_calls_are_linear_and_off_the_loop(server):
    """Turns of 1,000 calls, each followed by its outputs: 12,000 and 24,000 items take time
    in proportion (2x, generously < 3.5x), and /health answers meanwhile."""

    def body(turns: int) -> dict[str, Any]:
        items: list[dict[str, Any]] = []
        for t in range(turns):
            items += [_call(t * 1000 + i) for i in range(1000)]
            items += [{"type": "function_call_output", "call_id": f"c{t * 1000}", "output": "ok"}]
        return {"input": items, "max_output_tokens": 2}

    took = []
    for turns in (12, 24):
        r, seconds, worst = _post_watching_health(server, body(turns))
        assert r.status_code == 200, r.text  # the test model's template renders no calls
        assert worst < max(0.5 * seconds, 1.0), (worst, seconds)
        print(f"{turns} turns: {seconds:.2f} s, /health {worst:.2f} s")
        took.append(seconds)
    assert took[1] < 3.5 * took[0], took


def test_a_turn_of_the_most_calls_is_answered(server):
    """A turn of exactly MAX_TURN_CALLS calls is a chat message the chat route would take."""
    items: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    items += [_call(i) for i in range(MAX_TURN_CALLS)]
    items += [{"type": "function_call_output", "call_id": "c0", "output": "ok"}]
    r = httpx.post(
        server.url + "/v1/responses", json={"input": items, "max_output_tokens": 2}, timeout=120
    )
    assert r.status_code == 200, r.text
