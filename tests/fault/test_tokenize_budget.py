"""/tokenize and /detokenize under the limits chat completions has (issue 33, item 8).

Before: /tokenize rendered a chat of any number of messages on the event loop (1.2M messages:
a 400 after 10.8 s, /health waited 1.87 s) and /detokenize decoded any number of ids there
(7M ids: 2.7 s). Now a chat is at most MAX_CHAT_MESSAGES messages (a 400 naming ``messages``
while structuring), a large one renders on a worker thread, and at most
DETOKENIZE_CONTEXTS x max_model_len ids are decoded (a 400 naming ``tokens``), large lists on a
worker thread.
"""

from __future__ import annotations

import time

import httpx
import pytest
from server_harness import ServerProcess, post_polling_health

from trillm.entrypoints.openai.endpoints.tokenization import DETOKENIZE_CONTEXTS
from trillm.entrypoints.openai.schemas.protocol import MAX_CHAT_MESSAGES

MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("tokenize-budget") / "server.log"
    args = ["--runner", "trillm.worker.fake_runner:FakeModelRunner"]
    srv = ServerProcess([*args, "--max-model-len", str(MAX_MODEL_LEN)], log).start()
    yield srv
    assert srv.stop() == 0, srv.log()


def test_a_large_chat_renders_off_the_event_loop(server):
    """The most messages allowed: before, rendering them held /health as long as the
    request took (~5 s here); now /health answers at once meanwhile."""
    messages = [{"role": "user", "content": "hi"}] * MAX_CHAT_MESSAGES
    r, took, worst = post_polling_health(server, "/tokenize", {"messages": messages})
    assert r.status_code == 400, r.text  # rendered, then far longer than the context
    assert r.json()["error"]["param"] == "messages"
    assert "maximum context length" in r.json()["error"]["message"]
    assert worst < 0.3 * took, (worst, took)


def test_too_many_messages_are_refused_before_rendering(server):
    messages = [{"role": "user", "content": ""}] * (MAX_CHAT_MESSAGES + 1)
    start = time.monotonic()
    r = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=300)
    took = time.monotonic() - start
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages"
    assert f"more than the limit of {MAX_CHAT_MESSAGES}" in error["message"]
    assert took < 10, took  # structuring stops at the count; nothing is rendered


def test_a_small_chat_still_tokenizes(server):
    messages = [{"role": "user", "content": "Hello there"}]
    r = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["count"] == len(r.json()["tokens"]) > 0


def test_detokenize_bound(server):
    limit = DETOKENIZE_CONTEXTS * MAX_MODEL_LEN
    ok = httpx.post(server.url + "/detokenize", json={"tokens": [100] * limit}, timeout=60)
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["prompt"]) >= limit // 4
    over = httpx.post(server.url + "/detokenize", json={"tokens": [100] * (limit + 1)}, timeout=60)
    assert over.status_code == 400, over.text
    error = over.json()["error"]
    assert error["param"] == "tokens"
    assert str(limit) in error["message"]


def test_millions_of_ids_are_refused_without_stalling_others(server):
    """3M ids (6 MB): before, decoded on the event loop (~1.3 s, /health waiting as long)
    and answered 200; now a 400 naming ``tokens``, /health answering meanwhile."""
    r, took, worst = post_polling_health(server, "/detokenize", {"tokens": [5] * 3_000_000})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tokens"
    # /health waits at most for the body's JSON decoding, never for the ids' detokenization
    # (before: ~1.3 s); 1 s of floor for a loaded 2-core machine running two test workers.
    assert worst < max(0.5 * took, 1.0), (worst, took)
