"""A grammar too expensive to enforce must not stall other requests (issue 11, found by hostile
requests beside schemathesis): the engine fills each constrained request's token bitmask on
its event loop, and xgrammar's cost per token grows cubically with nested ambiguous regexes
(``(a*)*`` repeated 2,000 times: ~25 s per token). Before the fix one such ``guided_regex``
left /health unanswered for 60 s and a plain completion waiting 46 s.

Now a grammar whose first mask costs more than ``MAX_FILL_CPU_S`` of CPU is refused with a
400 (measured on the grammar thread, off the loop), and one cheap at its start but slow later
is ended (finish ``abort``) after its first slow mask. Meanwhile /health and a plain request
answer at once. The fake runner serves (it samples inside the bitmask it is sent).
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from server_harness import ServerProcess
from shared_servers import FAKE_256, FAKE_256_GROUP

from trillm.structured_output.compiler import MAX_FILL_CPU_S

# The server is shared with the other modules of its group (tests/support/shared_servers.py).
pytestmark = pytest.mark.xdist_group(FAKE_256_GROUP)


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server(FAKE_256)


def others_are_served(srv: ServerProcess, busy: threading.Thread) -> list[float]:
    """While ``busy`` runs: /health and a plain completion, each timed."""
    times = []
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        while busy.is_alive():
            start = time.monotonic()
            assert client.get("/health").status_code == 200
            r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
            assert r.status_code == 200, r.text
            times.append(time.monotonic() - start)
            time.sleep(0.1)
    return times


def run_beside(srv: ServerProcess, body: dict) -> tuple[httpx.Response, list[float]]:
    result: list[httpx.Response] = []
    busy = threading.Thread(
        target=lambda: result.append(
            httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
        )
    )
    busy.start()
    time.sleep(0.2)
    times = others_are_served(srv, busy)
    busy.join()
    return result[0], times


def test_expensive_grammar_is_refused(server):
    body = {"prompt": "x", "max_tokens": 8, "guided_regex": "(a*)*" * 1000}
    r, times = run_beside(server, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "too expensive" in error["message"] and error["param"].startswith(
        "structured_outputs"
    ), error
    assert times and max(times) < 5, times


def test_grammar_slow_after_its_start_is_ended(server):
    # One literal first: the first mask is cheap, every later one costs ~0.15 s of CPU.
    body = {
        "prompt": "x",
        "max_tokens": 40,
        "guided_regex": "x" + "(a*)*" * 400,
        "ignore_eos": True,
    }
    r, times = run_beside(server, body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "abort", choice
    assert r.json()["usage"]["completion_tokens"] <= 3, r.json()["usage"]
    assert max(times, default=0) < 5, times


def test_ordinary_grammars_pass_the_cost_check(server):
    for extra in (
        {"guided_regex": r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}"},
        {"guided_choice": [f"option {i}" for i in range(500)]},
        {"response_format": {"type": "json_object"}},
    ):
        r = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": "x", "max_tokens": 8, **extra},
            timeout=60,
        )
        assert r.status_code == 200, (extra, r.text)
    assert MAX_FILL_CPU_S >= 0.01
