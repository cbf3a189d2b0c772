"""Honour or refuse, measured against vLLM's own list: every request field of vLLM's
OpenAI-compatible protocol (chat, completions, responses, embeddings, pooling, score, rerank,
tokenize, messages) and every ``VLLM_*`` variable a deployment commonly sets, as
``tests/support/field_coverage/vllm_fields.json`` lists them (generated from vLLM's source; its
``source`` says which release), is honoured (a test shows its effect), refused (a 400 naming
the field / a start-up error naming the variable), or ignored where vLLM ignores it too.

Fields outside vLLM's list keep vLLM's behaviour: ignored with a warning. The server is the
shared fake-runner server: every refusal is decided before the model runs.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import attrs
import httpx
import pytest
from field_coverage.vllm_list import (
    ENV_EFFECTS,
    IGNORED_AS_IN_VLLM,
    REFUSE_UNDECLARED,
    SCHEMAS,
    VLLM,
    asking_value,
)
from field_coverage_table import COVERAGE, NO_EFFECT_BY_DESIGN
from shared_servers import FAKE_512_TEMPLATES, FAKE_512_TEMPLATES_GROUP

from trillm import envs, vllm_env
from trillm.entrypoints.openai.schemas.vllm_refused import REFUSED, refusal

pytestmark = pytest.mark.xdist_group(FAKE_512_TEMPLATES_GROUP)
REPO = Path(__file__).resolve().parents[2]
ENDPOINTS = VLLM["endpoints"]
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server(FAKE_512_TEMPLATES)


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


def schema(endpoint: str) -> type:
    module, name = SCHEMAS[endpoint]
    cls: type = getattr(
        importlib.import_module(f"trillm.entrypoints.openai.schemas.{module}"), name
    )
    return cls


def declared(endpoint: str) -> set[str]:
    return {f.name for f in attrs.fields(schema(endpoint))}


def refused_fields(endpoint: str) -> list[str]:
    """vLLM's fields this route does not declare and refuses when they ask for something."""
    fields = ENDPOINTS[endpoint]["fields"]
    table = REFUSED.get(SCHEMAS[endpoint][1], {})
    if endpoint in REFUSE_UNDECLARED:
        return sorted(set(fields) - declared(endpoint))
    return sorted(f for f in fields if f not in declared(endpoint) and f in table)


def minimal_body(endpoint: str, model: str) -> dict:
    return {
        "chat": {"messages": HI, "max_tokens": 1},
        "completions": {"prompt": "hi", "max_tokens": 1},
        "responses": {"input": "hi", "max_output_tokens": 1},
        "embeddings": {"input": "hi"},
        "pooling": {"input": "hi"},
        "score": {"text_1": "a", "text_2": "b"},
        "rerank": {"query": "a", "documents": ["b"]},
        "tokenize": {"prompt": "hi"},
        "detokenize": {"tokens": [1]},
        "messages": {"model": model, "messages": HI, "max_tokens": 1},
        "count_tokens": {"model": model, "messages": HI},
    }[endpoint]


def post(server, endpoint: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + ENDPOINTS[endpoint]["route"], json=body, timeout=60)


# ---------------------------------------------------------------- the list itself


def test_the_list_is_vllms_and_names_where_it_came_from():
    source = VLLM["source"]
    assert source["package"].startswith("vllm ") and len(source["wheel_sha256"]) == 64
    assert set(ENDPOINTS) == set(SCHEMAS)
    chat = ENDPOINTS["chat"]["fields"]
    # inherited fields resolved (the embeddings' pooling mixin), defaults kept
    assert {"messages", "reasoning_effort", "logprob_token_ids"} <= set(chat)
    assert ENDPOINTS["embeddings"]["fields"]["truncate_prompt_tokens"] is None
    assert ENDPOINTS["chat"]["fields"]["add_special_tokens"] is False
    assert len(VLLM["env"]) >= 40 and all(n.startswith("VLLM_") for n in VLLM["env"])


def test_every_vllm_field_is_honoured_refused_or_ignored_as_vllm_ignores_it():
    unmapped = []
    for endpoint, spec in ENDPOINTS.items():
        name = SCHEMAS[endpoint][1]
        for field in spec["fields"]:
            if field in declared(endpoint):
                key = f"{name}.{field}"
                ok = key in COVERAGE or key in NO_EFFECT_BY_DESIGN
            else:
                ok = (
                    endpoint in REFUSE_UNDECLARED
                    or field in REFUSED.get(name, {})
                    or (endpoint, field) in IGNORED_AS_IN_VLLM
                )
            if not ok:
                unmapped.append(f"{endpoint}: {field}")
    assert not unmapped, (
        "vLLM request fields that are neither honoured (mapped in the field coverage table), "
        "refused (trillm/entrypoints/openai/schemas/vllm_refused.py) nor ignored as vLLM "
        "ignores them (field_coverage/vllm_list.py):\n  " + "\n  ".join(unmapped)
    )


def test_the_tables_name_only_vllm_fields_trillm_does_not_declare():
    by_schema = {SCHEMAS[e][1]: e for e in ENDPOINTS}
    for name, table in REFUSED.items():
        endpoint = by_schema[name]
        stale = set(table) - set(ENDPOINTS[endpoint]["fields"])
        assert not stale, (name, "not vLLM's fields", stale)
        assert not set(table) & declared(endpoint), (name, "declared and refused")
    for endpoint, field in IGNORED_AS_IN_VLLM:
        assert field in ENDPOINTS[endpoint]["fields"] and field not in declared(endpoint)
        assert field not in REFUSED.get(SCHEMAS[endpoint][1], {})


def test_vllms_default_asks_for_nothing():
    for endpoint, spec in ENDPOINTS.items():
        for field in REFUSED.get(SCHEMAS[endpoint][1], {}):
            default = spec["fields"][field]
            assert refusal(SCHEMAS[endpoint][1], field, None) is None, (endpoint, field)
            if not isinstance(default, dict) and default != "<required>":
                assert refusal(SCHEMAS[endpoint][1], field, default) is None, (endpoint, field)
            assert refusal(SCHEMAS[endpoint][1], field, asking_value(default)), (endpoint, field)


# ---------------------------------------------------------------- over HTTP


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_each_refused_field_is_a_400_naming_it(server, model, endpoint):
    fields = ENDPOINTS[endpoint]["fields"]
    base = minimal_body(endpoint, model)
    for field in refused_fields(endpoint):
        r = post(server, endpoint, {**base, field: asking_value(fields[field])})
        assert r.status_code == 400, (endpoint, field, r.text)
        error = r.json().get("error") or r.json()
        message = error.get("message", "")
        assert f"'{field}'" in message, (endpoint, field, error)
    assert post(server, endpoint, base).status_code in (200, 400)  # the control: the body


@pytest.mark.parametrize("endpoint", ["chat", "completions", "tokenize"])
def test_refused_fields_at_vllms_default_change_nothing(server, endpoint):
    """Sent null or at vLLM's default, a refused field asks for nothing: the same answer."""
    fields = ENDPOINTS[endpoint]["fields"]
    base = minimal_body(endpoint, "")
    if endpoint != "tokenize":
        base.update(return_token_ids=True, temperature=0)
    plain = post(server, endpoint, base)
    assert plain.status_code == 200, plain.text
    for value_of in (lambda f: None, lambda f: fields[f]):
        extra = {
            f: value_of(f)
            for f in refused_fields(endpoint)
            if not isinstance(fields[f], dict) and fields[f] != "<required>"
        }
        assert extra, endpoint
        r = post(server, endpoint, {**base, **extra})
        assert r.status_code == 200, r.text
        assert prompt_of(r.json()) == prompt_of(plain.json())


def prompt_of(answer: dict) -> object:
    """What the request asked the engine: the prompt's ids (/tokenize: its tokens)."""
    if "choices" not in answer:
        return answer["tokens"]
    return answer.get("prompt_token_ids") or answer["choices"][0]["prompt_token_ids"]


def test_a_field_outside_vllms_list_is_ignored_with_a_warning(server):
    body = {**minimal_body("completions", ""), "not_a_vllm_field_e41": 1}
    assert post(server, "completions", body).status_code == 200
    assert "not_a_vllm_field_e41" in server.log()


def test_reasoning_effort_reaches_the_template_as_vllm_renders_it(server):
    template = (
        "{{ messages[0].content }}|{{ reasoning_effort }}|"
        "{{ enable_thinking if enable_thinking is defined else 'unset' }}"
    )

    def rendered(**fields) -> str:
        body = {**minimal_body("chat", ""), "chat_template": template, "return_token_ids": True}
        r = post(server, "chat", {**body, **fields})
        assert r.status_code == 200, r.text
        ids = r.json()["prompt_token_ids"]
        return httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]

    assert rendered() == "hi||unset"
    assert rendered(reasoning_effort="low") == "hi|low|True"
    assert rendered(reasoning_effort="none") == "hi|none|False"
    kwargs = {"enable_thinking": False, "reasoning_effort": "high"}
    # the request's effort over chat_template_kwargs' own; their enable_thinking kept
    assert rendered(reasoning_effort="low", chat_template_kwargs=kwargs) == "hi|low|False"
    r = post(server, "chat", {**minimal_body("chat", ""), "reasoning_effort": "huge"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stream_interval_gives_chunks_of_that_many_tokens(server, endpoint):
    """Every chunk but the first and the last carries at least stream_interval tokens (a
    slow reader only makes them larger); without it each carries one token or so."""
    body = {
        **minimal_body(endpoint, ""),
        "max_tokens": 13,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_interval": 4,
    }
    sizes = []
    with httpx.stream("POST", server.url + ENDPOINTS[endpoint]["route"], json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0].get("token_ids"):
                    sizes.append(len(choices[0]["token_ids"]))
    assert sum(sizes) == 13 and len(sizes) <= 5, sizes
    assert all(size >= 4 for size in sizes[1:-1]), sizes
    r = post(server, endpoint, {**minimal_body(endpoint, ""), "stream_interval": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_interval"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_truncation_side_picks_the_end_that_is_kept(server, endpoint):
    text = "And God said, Let there be light: and there was light."
    base = {**minimal_body(endpoint, ""), "return_token_ids": True}
    base.update(
        {"prompt": text} if endpoint == "completions" else {"messages": [HI[0] | {"content": text}]}
    )
    whole = prompt_of(post(server, endpoint, base).json())
    assert len(whole) > 10
    for side, kept in ((None, whole[-5:]), ("left", whole[-5:]), ("right", whole[:5])):
        body = {**base, "truncate_prompt_tokens": 5, "truncation_side": side}
        r = post(server, endpoint, body)
        assert r.status_code == 200, r.text
        assert prompt_of(r.json()) == kept, side
    r = post(server, endpoint, {**base, "truncate_prompt_tokens": 5, "truncation_side": "middle"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncation_side"


@pytest.mark.parametrize("endpoint", ["chat", "tokenize"])
def test_mm_processor_kwargs_on_a_text_only_model_is_a_400_naming_it(server, model, endpoint):
    # (vLLM: the text-only model has no multimodal processor to give the kwargs to)
    body = {**minimal_body(endpoint, model), "mm_processor_kwargs": {"do_resize": False}}
    if endpoint == "tokenize":
        body = {"model": model, "messages": HI, "mm_processor_kwargs": {"do_resize": False}}
    r = post(server, endpoint, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "mm_processor_kwargs"
    assert post(server, endpoint, {**body, "mm_processor_kwargs": None}).status_code == 200


# ---------------------------------------------------------------- VLLM_* variables


def test_every_listed_variable_is_read_refused_or_without_effect():
    read = {name for var in envs.ALL for name in var.names}
    kinds = {
        name: [
            kind
            for kind, names in (
                ("read", read),
                ("refused", vllm_env.REFUSED),
                ("no effect", vllm_env.NO_EFFECT),
            )
            if name in names
        ]
        for name in VLLM["env"]
    }
    wrong = {name: found for name, found in kinds.items() if len(found) != 1}
    assert not wrong, f"each variable must be exactly one of read / refused / no effect: {wrong}"
    assert set(ENV_EFFECTS) == {n for n in VLLM["env"] if n in read}
    for reason in [*vllm_env.NO_EFFECT.values(), *(r.reason for r in vllm_env.REFUSED.values())]:
        assert len(reason) > 25, reason
    assert set(vllm_env.REFUSED) | set(vllm_env.NO_EFFECT) <= set(VLLM["env"])


@pytest.mark.parametrize("name", sorted(ENV_EFFECTS))
def test_each_read_variable_has_a_test_of_its_effect(name):
    for node_id in ENV_EFFECTS[name]:
        path, _, function = node_id.partition("::")
        source = (REPO / path).read_text()
        assert f"def {function}(" in source, node_id
        assert name.removeprefix("VLLM_").lower() in source.lower(), node_id


# A value that asks for something, for each refused variable; vLLM's default asks nothing.
ASKING = {
    "VLLM_USE_MODELSCOPE": ("True", "0"),
    "VLLM_LOG_STATS_INTERVAL": ("2", "10"),
    "VLLM_TRACE_FUNCTION": ("1", "0"),
    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": ("30", "5"),
    "VLLM_CPU_KVCACHE_SPACE": ("8", "0"),
}


@pytest.mark.parametrize("name", sorted(vllm_env.REFUSED))
def test_a_refused_variable_stops_the_start_naming_it(monkeypatch, name):
    asks, default = ASKING.get(name, ("1", ""))
    monkeypatch.setenv(name, default)
    envs.check_all()  # vLLM's default (or empty) asks for nothing
    monkeypatch.setenv(name, asks)
    with pytest.raises(ValueError, match=f"{name}={asks!r} is not supported"):
        envs.check_all()


def test_trillm_serve_exits_2_naming_a_refused_variable():
    env = {**os.environ, "VLLM_PLUGINS": "lora_filesystem_resolver", "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-m", "trillm", "serve"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "VLLM_PLUGINS='lora_filesystem_resolver' is not supported" in out.stderr
