"""The Responses API's store (``VLLM_ENABLE_RESPONSES_API_STORE=1``, vLLM's): a response made
with ``store`` (the default) is returned by ``GET /v1/responses/{id}``, streamed or not; a
later request's ``previous_response_id`` continues its conversation as vLLM builds it; cancel
is vLLM's 400 for a finished response; ``background`` runs after the answer and cancel stops
it; every route needs the API key; the store is bounded
(entries and bytes, least recently used dropped first). Without the variable:
tests/entrypoints/test_responses_api.py::test_without_the_store."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from server_harness import ServerProcess
from shared_servers import FAKE_RUNNER

from trillm.entrypoints.openai.endpoints.responses_store import ResponseStore
from trillm.entrypoints.openai.http.errors import NotFoundError
from trillm.entrypoints.openai.schemas.protocol import ChatMessage

KEY = "store-key-81c3"
STORE_ENV = "VLLM_ENABLE_RESPONSES_API_STORE"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("responses-store") / "server.log"
    srv = ServerProcess([*FAKE_RUNNER, "--max-model-len", "512"], log, api_key=KEY)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(STORE_ENV, "1")
        srv.start()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)


def test_a_stored_response_is_returned_by_get(client):
    made = client.responses.create(model=None, input="hi", max_output_tokens=6)  # type: ignore[arg-type]
    assert made.store is True
    got = client.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump()
    # streamed: kept once finished, as the completed event tells it
    stream = client.responses.create(
        model=None,  # type: ignore[arg-type]
        input="hello",
        max_output_tokens=6,
        stream=True,
    )
    last = [event for event in stream][-1]
    assert last.type in ("response.completed", "response.incomplete")
    assert client.responses.retrieve(last.response.id).model_dump() == last.response.model_dump()


def test_store_false_is_not_kept(client):
    made = client.responses.create(model=None, input="hi", max_output_tokens=4, store=False)  # type: ignore[arg-type]
    assert made.store is False
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(made.id)
    assert err.value.body["param"] == "response_id"
    assert err.value.body["message"] == f"Response with id '{made.id}' not found."


def test_previous_response_id_continues_the_conversation(client):
    """The continued prompt is vLLM's: the earlier messages but the system one (instructions
    do not carry over), the earlier output_text as an assistant message, then the input."""
    first = client.responses.create(
        model=None,  # type: ignore[arg-type]
        instructions="Be brief.",
        input="Remember MARKER-729.",
        max_output_tokens=8,
        temperature=0,
    )
    follow = client.responses.create(
        model=None,  # type: ignore[arg-type]
        previous_response_id=first.id,
        input="Which marker?",
        max_output_tokens=4,
    )
    assert follow.previous_response_id == first.id
    history: list = [{"role": "user", "content": "Remember MARKER-729."}]
    if first.output_text:
        history.append({"role": "assistant", "content": first.output_text})
    same = client.responses.create(
        model=None,  # type: ignore[arg-type]
        input=[*history, {"role": "user", "content": "Which marker?"}],
        max_output_tokens=4,
        store=False,
    )
    assert follow.usage and same.usage and first.usage
    assert follow.usage.input_tokens == same.usage.input_tokens > first.usage.input_tokens
    # a chain: the follow-up is stored too, and continues in turn
    third = client.responses.create(
        model=None,  # type: ignore[arg-type]
        previous_response_id=follow.id,
        input="Thanks.",
        max_output_tokens=4,
    )
    assert third.usage and third.usage.input_tokens > follow.usage.input_tokens
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(
            model=None,  # type: ignore[arg-type]
            previous_response_id="resp_nope",
            input="x",
        )
    assert err.value.body["param"] == "response_id"


def test_enable_response_messages_gives_the_raw_prompt_and_output(client):
    """vLLM's extension: the prompt and the output as text and token ids (kept when stored)."""
    made = client.responses.create(
        model=None,  # type: ignore[arg-type]
        input="Hello?",
        max_output_tokens=5,
        extra_body={"enable_response_messages": True},
    )
    extra = made.model_extra or {}
    (prompt,) = extra["input_messages"]
    assert prompt["type"] == "raw_message_tokens" and "Hello?" in prompt["message"]
    assert made.usage and len(prompt["tokens"]) == made.usage.input_tokens
    (output,) = extra["output_messages"]
    assert output["type"] == "raw_message_tokens" and isinstance(output["message"], str)
    assert len(output["tokens"]) == made.usage.output_tokens
    assert (client.responses.retrieve(made.id).model_extra or {})["input_messages"] == [prompt]
    assert "input_messages" not in (
        client.responses.create(
            model=None,  # type: ignore[arg-type]
            input="Hello?",
            max_output_tokens=2,
        ).model_extra
        or {}
    )
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(
            model=None,  # type: ignore[arg-type]
            input="Hello?",
            stream=True,
            extra_body={"enable_response_messages": True},
        )
    assert err.value.body["param"] == "enable_response_messages"


def _wait_until_done(client, rid: str):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        got = client.responses.retrieve(rid)
        if got.status not in ("queued", "in_progress"):
            return got
        time.sleep(0.05)
    raise AssertionError(f"background response {rid} still {got.status}")


def test_background_runs_after_the_answer(client):
    queued = client.responses.create(
        model=None,  # type: ignore[arg-type]
        input="hi",
        max_output_tokens=6,
        background=True,
    )
    assert queued.status == "queued" and queued.background is True and not queued.output
    done = _wait_until_done(client, queued.id)
    assert done.status in ("completed", "incomplete") and done.output
    assert done.usage and done.usage.output_tokens > 0 and done.background is True
    with pytest.raises(openai.BadRequestError) as err:  # finished: vLLM's 400
        client.responses.cancel(queued.id)
    assert err.value.body["message"] == "Cannot cancel a synchronous response."
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(
            model=None,  # type: ignore[arg-type]
            input="hi",
            background=True,
            stream=True,
        )
    assert err.value.body["param"] == "background"


def test_cancel_stops_a_background_response(client):
    for _ in range(3):  # (a try whose output ended before the cancel came is run again)
        queued = client.responses.create(
            model=None,  # type: ignore[arg-type]
            input="Tell me a long story.",
            max_output_tokens=480,
            background=True,
        )
        try:
            cancelled = client.responses.cancel(queued.id)
        except openai.BadRequestError:
            continue
        assert cancelled.status == "cancelled"
        time.sleep(0.5)
        assert client.responses.retrieve(queued.id).status == "cancelled"
        return
    raise AssertionError("every background response ended before its cancel")


def test_cancel_and_the_api_key(server, client):
    made = client.responses.create(model=None, input="hi", max_output_tokens=4)  # type: ignore[arg-type]
    auth = {"Authorization": f"Bearer {KEY}"}
    base = server.base_url + "/responses/"
    r = httpx.post(base + made.id + "/cancel", headers=auth, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "Cannot cancel a synchronous response."
    r = httpx.post(base + "resp_nope/cancel", headers=auth, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"
    r = httpx.get(base + made.id, params={"stream": "true"}, headers=auth, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    for method, path in (("GET", made.id), ("POST", made.id + "/cancel")):
        assert httpx.request(method, base + path, timeout=30).status_code == 401
        bad = {"Authorization": "Bearer wrong"}
        assert httpx.request(method, base + path, headers=bad, timeout=30).status_code == 401


def _response(rid: str, text: str) -> dict:
    return {"id": rid, "output": [{"type": "message", "content": [{"text": text}]}]}


def test_the_store_is_bounded():
    store = ResponseStore(max_entries=3, max_bytes=10_000)
    for i in range(4):
        assert store.keep(_response(f"r{i}", "x"), [ChatMessage(role="user", content="hi")])
    assert len(store) == 3  # the oldest went first
    with pytest.raises(NotFoundError):
        store.get("r0")
    store.get("r1")  # used: now the most recent
    store.keep(_response("r4", "x"), [])
    store.get("r1")
    with pytest.raises(NotFoundError):
        store.get("r2")
    # bytes: a big one pushes out the oldest, as many as it needs; one bigger than the store
    # is not kept
    store = ResponseStore(max_entries=100, max_bytes=10_000)
    for i in range(10):
        store.keep(_response(f"s{i}", "x"), [])
    assert store.keep(_response("big", "é" * 4_300), [ChatMessage(role="user", content="y" * 900)])
    assert store.get("big").nbytes > 9_000  # (é: two bytes in UTF-8)
    assert store.nbytes <= 10_000 and 2 <= len(store) < 11
    store.get("s9")  # the newest small ones stay
    with pytest.raises(NotFoundError):
        store.get("s0")
    assert not store.keep(_response("huge", "z" * 20_000), [])
    with pytest.raises(NotFoundError):
        store.get("huge")
    assert store.nbytes == sum(s.nbytes for s in store._items.values())
