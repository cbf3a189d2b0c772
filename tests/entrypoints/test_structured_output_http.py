"""Structured outputs over HTTP: a real ``trillm serve`` on a tiny random model, driven by the
official ``openai`` client. ``response_format`` (json_schema, json_object), ``.parse()`` with a
pydantic model, vLLM's ``structured_outputs`` and the older ``guided_*`` fields; streamed and
not, n > 1, concurrent with unconstrained requests; bad specs are 400s naming the problem."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
import trio
from pydantic import BaseModel, Field
from server_harness import ServerProcess

NAME = "tiny-so"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "rank": {"type": "integer", "minimum": 1, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["old", "new"]}, "maxItems": 2},
    },
    "required": ["city", "rank", "tags"],
}
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
MSGS = [{"role": "user", "content": "Describe a city as JSON."}]


class City(BaseModel):
    city: str = Field(max_length=12)
    rank: int = Field(ge=1, le=99)
    capital: bool


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    log = tmp_path_factory.mktemp("server-so") / "server.log"
    srv = ServerProcess(
        [
            tiny_model_factory("llama"),
            "--served-model-name",
            NAME,
            "--max-model-len",
            "1024",
            "--kv-cache-memory",
            "32MiB",
            "--max-num-seqs",
            "32",
        ],
        log,
    ).start()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)


def json_schema_format(schema=SCHEMA):
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_response_format_json_schema(client, temperature):
    resp = client.chat.completions.create(
        model=NAME,
        messages=MSGS,
        max_tokens=300,
        temperature=temperature,
        n=2,
        seed=5,
        response_format=json_schema_format(),
        extra_body=COMPACT,
    )
    for choice in resp.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_response_format_json_schema_streamed(client):
    stream = client.chat.completions.create(
        model=NAME,
        messages=MSGS,
        max_tokens=300,
        temperature=0.9,
        seed=11,
        stream=True,
        response_format=json_schema_format(),
        extra_body=COMPACT,
    )
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_parse_with_a_pydantic_model(client):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    for temperature in (0.0, 1.0):
        resp = parse(
            model=NAME,
            messages=MSGS,
            response_format=City,
            max_tokens=300,
            temperature=temperature,
            extra_body=COMPACT,
        )
        parsed = resp.choices[0].message.parsed
        assert isinstance(parsed, City) and 1 <= parsed.rank <= 99


def test_json_object(client, server):
    tok_ids = httpx.post(server.url + "/tokenize", json={"model": NAME, "prompt": '"}'}).json()
    # NOTE: any object: strings are unbounded, so '"' and '}' are favoured for the random
    # model to close them (logit_bias applies after the grammar's mask).
    bias = {str(t): 8 for t in tok_ids["tokens"]}
    resp = client.chat.completions.create(
        model=NAME,
        messages=MSGS,
        max_tokens=300,
        temperature=0.7,
        seed=2,
        logit_bias=bias,
        response_format={"type": "json_object"},
        extra_body=COMPACT,
    )
    assert resp.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(resp.choices[0].message.content), dict)


@pytest.mark.parametrize(
    ("body", "check"),
    [
        ({"guided_regex": r"[A-Z]{2}-\d{3}"}, lambda t: re.fullmatch(r"[A-Z]{2}-\d{3}", t)),
        ({"guided_choice": ["alpha", "beta gamma"]}, lambda t: t in ("alpha", "beta gamma")),
        ({"guided_grammar": 'root ::= "<" [a-c]+ ">"'}, lambda t: re.fullmatch("<[a-c]+>", t)),
        (
            {"guided_json": SCHEMA, **COMPACT},
            lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None,
        ),
        (
            {"structured_outputs": {"regex": "(yes|no), [0-9]"}},
            lambda t: re.fullmatch("(yes|no), [0-9]", t),
        ),
        ({"structured_outputs": {"choice": ["x", "y"]}}, lambda t: t in ("x", "y")),
    ],
)
def test_structured_outputs_and_guided_aliases_on_completions(client, body, check):
    resp = client.completions.create(
        model=NAME, prompt="Value:", max_tokens=300, temperature=1.0, n=3, seed=9, extra_body=body
    )
    for choice in resp.choices:
        assert choice.finish_reason == "stop", choice.text
        assert check(choice.text), choice.text
    stream = client.completions.create(
        model=NAME, prompt="Value:", max_tokens=300, temperature=0, stream=True, extra_body=body
    )
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert check(text), text


def test_concurrent_mix_of_constrained_and_plain(server):
    async def main():
        results = []
        async with openai.AsyncOpenAI(
            base_url=server.base_url, api_key="x", max_retries=0, timeout=120
        ) as aclient:

            async def constrained(i):
                r = await aclient.chat.completions.create(
                    model=NAME,
                    messages=MSGS,
                    max_tokens=300,
                    temperature=1.0,
                    seed=i,
                    response_format=json_schema_format(),
                    extra_body=COMPACT,
                )
                results.append(("json", r.choices[0]))

            async def plain(i):
                r = await aclient.completions.create(
                    model=NAME,
                    prompt=f"plain {i}",
                    max_tokens=24,
                    temperature=1.0,
                    seed=i,
                    extra_body={"ignore_eos": True},
                )
                results.append(("plain", r.choices[0]))

            async with trio.open_nursery() as nursery:
                for i in range(8):
                    nursery.start_soon(constrained, i)
                    nursery.start_soon(plain, i)
        return results

    results = trio.run(main)
    assert len(results) == 16
    for kind, choice in results:
        if kind == "json":
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        else:
            assert choice.finish_reason == "length"


def _deep(levels: int) -> str:
    return '{"type": "object", "properties": {"x": ' * levels + '{"type": "string"}' + "}}" * levels


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"structured_outputs": {"regex": "a("}}, "structured_outputs.regex", "Invalid regex"),
        ({"guided_json": {"type": "nope"}}, "structured_outputs.json", 'Unsupported type "nope"'),
        (
            {"structured_outputs": {"grammar": "root ::= x"}},
            "structured_outputs.grammar",
            'Rule "x" is not defined',
        ),
        (
            {"response_format": json_schema_format({"type": "object", "required": 3})},
            "structured_outputs.json",
            "Invalid JSON schema",
        ),
        (
            {"response_format": json_schema_format({"$ref": "#/$defs/missing"})},
            "structured_outputs.json",
            "missing",
        ),
        ({"structured_outputs": {"json": "{nope"}}, "structured_outputs.json", "not valid JSON"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
        (
            {"structured_outputs": {"disable_any_whitespace": True}},
            "structured_outputs",
            "exactly one",
        ),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "exactly one"),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "structured_outputs",
            "exactly one",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema",
            "required",
        ),
        ({"response_format": {"type": "structural_tag"}}, "response_format", "structures"),
    ],
)
def test_bad_specs_are_400s_naming_the_problem(server, extra, param, message):
    body = {"model": NAME, "messages": MSGS, "max_tokens": 5, **extra}
    resp = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and message in error["message"], error


@pytest.mark.parametrize("levels", [400, 600])
def test_deeply_nested_schema_is_a_400(server, levels):
    """Issue 11 defect 7: a schema nested hundreds of levels deep was a 500 (RecursionError)."""
    fmt = '{"type": "json_schema", "json_schema": {"name": "d", "schema": ' + _deep(levels) + "}}"
    head = json.dumps({"model": NAME, "messages": [{"role": "user", "content": "x"}]})
    body = head[:-1] + ', "max_tokens": 5, "response_format": ' + fmt + "}"
    resp = httpx.post(
        server.base_url + "/chat/completions",
        content=body,
        timeout=60,
        headers={"content-type": "application/json"},
    )
    assert resp.status_code == 400, resp.text
    assert "depth" in resp.json()["error"]["message"] or "nests deeper" in resp.text
    assert httpx.get(server.url + "/health").status_code == 200
