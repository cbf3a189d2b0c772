"""A request body's JSON is parsed with the garbage collector paused (third attack round).

Before: ``orjson.loads`` ran on the event loop with the collector on, and a 15 MB body of
5,000,000 empty lists (in a field the server ignores, or in ``prompt``) set off collection
after collection while it built them: a real ``trillm serve`` (fake runner) left ``/health``
unanswered for 4.0-5.2 s per such request (8.5 s for the parse alone on the loaded test host,
1.4 s of it the parse itself). A JSON document's values form no cycle, so the collector has
nothing to find among them: now no collection runs during a parse, and the same request held
/health 2.5 s (the parse, and the objects' later trip through the generations and release).
"""

from __future__ import annotations

import gc

import orjson
import pytest

from trillm.entrypoints.openai.http.bodies import parse_json


@pytest.fixture(autouse=True)
def collector_on():
    """The collector on, as in the server; left as it was found."""
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def _collections_during(parse) -> int:
    seen = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(count)
    try:
        parse()
    finally:
        gc.callbacks.remove(count)
    return len(seen)


def test_no_collection_runs_while_a_body_of_many_containers_is_parsed():
    raw = b'{"x":[' + b",".join([b"[]"] * 300_000) + b"]}"
    # The document as the server received it before: collections, full ones among them.
    assert _collections_during(lambda: orjson.loads(raw)) > 10
    assert _collections_during(lambda: parse_json(raw)) == 0
    assert gc.isenabled()  # on again after it


def test_the_collector_is_on_again_after_a_body_that_is_not_json():
    with pytest.raises(orjson.JSONDecodeError):
        parse_json(b'{"x": [' + b"[]," * 1000)
    assert gc.isenabled()
    gc.disable()
    try:
        parse_json(b"{}")
        assert not gc.isenabled()  # a caller's pause is not ended by it
    finally:
        gc.enable()
