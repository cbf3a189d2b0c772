"""A structured-output spec's compile cost is bounded before xgrammar sees it (third attack round).

Before (measured on this file's server, fake runner, RSS of the server's processes): a 1 MB
``guided_regex`` was refused only by the 30 s compile limit (30.3 s; the compile went on in the
background, into a 252 MiB grammar), then a schema of 50,000 properties too (35.2 s; it went on
compiling); the RSS grew 341 -> 822 -> 1,115 MiB and stayed, and a 2-token completion beside
them waited up to 1.1 s / 4.2 s. Now the
spec's size is checked first (``trillm/structured_output/spec.py``: regex / grammar / choice
characters, a schema's JSON values and one object's properties), and past a bound it is a 400
naming the field at once, on a real ``trillm serve`` (fake runner), through the official
``openai`` client; a plain request beside it is served, and the server's memory stays.
"""

from __future__ import annotations

import time

import openai
import pytest
from server_harness import rss_mib
from shared_servers import FAKE_256, FAKE_256_GROUP

from trillm.structured_output.spec import (
    MAX_GRAMMAR_CHARS,
    MAX_REGEX_CHARS,
    MAX_SCHEMA_NODES,
    MAX_SCHEMA_PROPERTIES,
    MAX_SCHEMA_TOTAL_PROPERTIES,
)

MODEL = "trillm-default"  # the default model's served name

# The server is shared with the other modules of its group (tests/support/shared_servers.py).
pytestmark = pytest.mark.xdist_group(FAKE_256_GROUP)


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server(FAKE_256)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)


def _schema(properties: int) -> dict:
    return {
        "type": "object",
        "properties": {f"p{i}": {"type": "string"} for i in range(properties)},
    }


def _refused(call) -> tuple[dict, float]:
    start = time.monotonic()
    with pytest.raises(openai.BadRequestError) as refused:
        call()
    return refused.value.body, time.monotonic() - start


def _plain_is_served(client: openai.OpenAI) -> float:
    start = time.monotonic()
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
    return time.monotonic() - start


def test_a_megabyte_regex_is_refused_before_compiling(server, client):
    """1 MB of regex, as vLLM's guided_regex and as structured_outputs.regex: a 400 naming the
    field in well under a second's compile (before: 30 s, then the 30 s compile limit's 400)."""
    rss_before = rss_mib(server.proc.pid)
    for field, extra in (
        ("guided_regex", {"guided_regex": "a" * 1_000_000}),
        ("structured_outputs.regex", {"structured_outputs": {"regex": "[a-z]" * 200_000}}),
    ):
        error, took = _refused(
            lambda extra=extra: client.completions.create(
                model=MODEL, prompt="x", max_tokens=2, extra_body=extra
            )
        )
        assert error["param"] == field, error
        assert f"more than the limit of {MAX_REGEX_CHARS}" in error["message"], error
        assert took < 10, took
    assert _plain_is_served(client) < 10
    grew = rss_mib(server.proc.pid) - rss_before
    print(f"regex refusals: last {took:.2f} s, server RSS +{grew:.0f} MiB")
    assert grew < 100, grew


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        (_schema(50_000), f"more than the {MAX_SCHEMA_PROPERTIES} one object may have"),
        (  # objects of fewer properties each, more in all
            {"type": "object", "properties": {f"o{j}": _schema(250) for j in range(10)}},
            f"more than {MAX_SCHEMA_TOTAL_PROPERTIES} properties in all",
        ),
        (  # many small objects: the count of JSON values
            {"type": "array", "items": {"anyOf": [_schema(1) for _ in range(MAX_SCHEMA_NODES)]}},
            f"more than {MAX_SCHEMA_NODES} JSON values",
        ),
    ],
    ids=["50000-properties", "2500-in-all", "values"],
)
def test_a_huge_json_schema_is_refused_before_compiling(server, client, schema, words):
    rss_before = rss_mib(server.proc.pid)
    error, took = _refused(
        lambda: client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
        )
    )
    assert error["param"] == "response_format.json_schema.schema", error
    assert words in error["message"], error
    assert took < 10, took
    assert _plain_is_served(client) < 10
    grew = rss_mib(server.proc.pid) - rss_before
    print(f"schema refusal {took:.2f} s, server RSS +{grew:.0f} MiB")
    assert grew < 100, grew


def test_specs_at_the_bounds_are_served(client):
    """The bounds are not lower than they say: a regex of MAX_REGEX_CHARS, an object of
    MAX_SCHEMA_PROPERTIES properties; a grammar one past its bound is refused by name."""
    served = client.completions.create(
        model=MODEL, prompt="x", max_tokens=2, extra_body={"guided_regex": "a" * MAX_REGEX_CHARS}
    )
    assert served.choices[0].text == "aa", served
    served = client.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=2,
        extra_body={"guided_json": _schema(MAX_SCHEMA_PROPERTIES)},
    )
    assert served.choices
    grammar = 'root ::= "a"' + " " * MAX_GRAMMAR_CHARS
    error, _ = _refused(
        lambda: client.completions.create(
            model=MODEL, prompt="x", max_tokens=2, extra_body={"guided_grammar": grammar}
        )
    )
    assert error["param"] == "guided_grammar", error
    assert f"more than the limit of {MAX_GRAMMAR_CHARS}" in error["message"], error
