"""A grammar that cannot accept a first token is a 400, never a 200 that the engine aborts.

Before: ``{"allOf": [{"$ref": "#"}], "type": "object"}`` (a schema that refers to itself before
any text) compiled, reached the engine, and its first mask allowed no token: 200 with empty
text and ``finish_reason: "abort"`` ("token 0 is outside its grammar"); a regex or EBNF
grammar matching nothing did the same. Now the first mask, filled on the grammar thread after
compiling, must allow a token (after the JSON grammars' control-character mask), else a 400
naming the field. A grammar that accepts only the empty output (only EOS) is served.
A real ``trillm serve`` (fake runner: it samples inside the grammar's bitmask).
"""

from __future__ import annotations

import httpx
import pytest
from shared_servers import FAKE_256, FAKE_256_GROUP

SELF_REFERENCE = {"allOf": [{"$ref": "#"}], "type": "object"}
NOTHING = "[^\\x00-\\U0010FFFF]"  # no character at all


# The server is shared with the other modules of its group (tests/support/shared_servers.py).
pytestmark = pytest.mark.xdist_group(FAKE_256_GROUP)


@pytest.fixture(scope="module")
def client(shared_server):
    with httpx.Client(base_url=shared_server(FAKE_256).url, timeout=60) as c:
        yield c


def json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


@pytest.mark.parametrize(
    ("field", "param"),
    [
        ({"response_format": json_format(SELF_REFERENCE)}, "structured_outputs.json"),
        ({"guided_json": SELF_REFERENCE}, "structured_outputs.json"),
        ({"guided_regex": NOTHING}, "structured_outputs.regex"),
        ({"structured_outputs": {"regex": NOTHING}}, "structured_outputs.regex"),
        ({"guided_grammar": f"root ::= {NOTHING}"}, "structured_outputs.grammar"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_grammar_without_a_first_token_is_refused(client, field, param, stream):
    body = {"prompt": "x", "max_tokens": 8, "stream": stream, **field}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert "cannot be satisfied: no token can start" in error["message"], error


def test_chat_is_refused_too(client):
    r = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8,
            "response_format": json_format(SELF_REFERENCE),
        },
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "structured_outputs.json", r.text


def test_other_impossible_schemas_are_refused_by_the_compiler(client):
    # These held before: xgrammar itself refuses them (kept so).
    for schema in ({"$ref": "#"}, {"type": "string", "enum": []}):
        r = client.post(
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 8, "response_format": json_format(schema)},
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "structured_outputs.json", r.text


@pytest.mark.parametrize(
    "field",
    [
        {"guided_regex": "a+"},
        {"response_format": json_format({"type": "object"})},
        {"response_format": json_format({"type": "string", "maxLength": 0})},
        {"guided_choice": ["yes", "no"]},
        {"guided_grammar": 'root ::= "x" | "y"'},
        {"guided_grammar": 'root ::= ""'},  # only the empty output: only EOS, still served
    ],
)
def test_satisfiable_grammars_are_served(client, field):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 8, **field})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text
