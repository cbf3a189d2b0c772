"""What vLLM's own server tests (tests/entrypoints/openai in vLLM's repository) expect of the
OpenAI routes' shapes, checked against ``trillm serve`` with the fake runner: ``logprobs: 0``,
the keys vLLM always sends (null when not asked), and usage in streams (vLLM's
``should_include_usage``, ``--enable-prompt-tokens-details``, ``--enable-force-include-usage``),
``--return-tokens-as-token-ids`` and ``GET /tokenizer_info``.
"""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from shared_servers import FAKE_256, FAKE_256_GROUP, FAKE_256_USAGE, USAGE_KEY

# The default-flags server is shared with the other modules of its group.
pytestmark = pytest.mark.xdist_group(FAKE_256_GROUP)

KEY = USAGE_KEY
# One server for the answer flags (each shown on its own route or field).
FLAGS_ON = FAKE_256_USAGE
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"messages": [{"role": "user", "content": "Hello there"}]}
COMPLETION = {"prompt": "Hello there"}
BODIES = {"completions": COMPLETION, "chat/completions": CHAT}


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server(FAKE_256)


@pytest.fixture(scope="module")
def usage_server(shared_server):
    return shared_server(FLAGS_ON)


def post(srv, route: str, **fields) -> dict:
    body = {**BODIES[route], **fields}
    r = httpx.post(f"{srv.url}/v1/{route}", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream_chunks(srv, route: str, **fields) -> list[dict]:
    body = {**BODIES[route], "stream": True, "max_tokens": 4, **fields}
    r = httpx.post(f"{srv.url}/v1/{route}", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# ---------------------------------------------------------------- logprobs: 0


@pytest.mark.parametrize("echo", [False, True])
def test_logprobs_zero_gives_the_chosen_token(server, echo):
    client = openai.OpenAI(base_url=server.base_url, api_key="none")
    out = client.completions.create(
        model=client.models.list().data[0].id,
        prompt="Hello there",
        max_tokens=3,
        logprobs=0,
        echo=echo,
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert len(lp.tokens) > 3 if echo else len(lp.tokens) == 3
    first = 1 if echo else 0  # an echoed prompt's first token: nothing predicts it
    if echo:
        assert lp.top_logprobs[0] is None and lp.token_logprobs[0] is None
    for token, value, top in zip(
        lp.tokens[first:], lp.token_logprobs[first:], lp.top_logprobs[first:]
    ):
        assert top == {token: value}  # vLLM: the chosen token's entry, never {}


def test_logprobs_n_gives_n_entries_with_the_chosen_one(server):
    # (as ids: two byte tokens would both read '\ufffd' and share one key)
    fields = {"max_tokens": 3, "logprobs": 2, "return_tokens_as_token_ids": True}
    lp = post(server, "completions", **fields)["choices"][0]["logprobs"]
    for token, top in zip(lp["tokens"], lp["top_logprobs"]):
        assert len(top) == 2 and token in top  # (the fake model's choice is its top-1)


# ---------------------------------------------------------------- keys sent as null


def test_unasked_keys_are_null(server):
    completion = post(server, "completions", max_tokens=2)
    choice = completion["choices"][0]
    for key in ("prompt_logprobs", "prompt_token_ids", "token_ids"):
        assert key in choice and choice[key] is None, key
    assert completion["usage"]["prompt_tokens_details"] is None  # no --enable-prompt-...
    chat = post(server, "chat/completions", max_tokens=2)
    assert chat["prompt_logprobs"] is None and chat["prompt_token_ids"] is None
    assert "token_ids" in chat["choices"][0] and chat["choices"][0]["token_ids"] is None
    assert chat["usage"]["prompt_tokens_details"] is None
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello there"}, timeout=30)
    assert "token_strs" in r.json() and r.json()["token_strs"] is None


def test_asked_keys_are_filled(server):
    choice = post(server, "completions", max_tokens=2, return_token_ids=True, prompt_logprobs=1)[
        "choices"
    ][0]
    assert len(choice["token_ids"]) == 2 and choice["prompt_token_ids"]
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) > 1


# ---------------------------------------------------------------- usage in streams


@pytest.mark.parametrize("route", BODIES)
def test_continuous_usage_needs_include_usage(server, route):
    opts = {"include_usage": False, "continuous_usage_stats": True}
    chunks = stream_chunks(server, route, stream_options=opts)
    assert chunks and all("usage" not in c or c["usage"] is None for c in chunks)


@pytest.mark.parametrize("route", BODIES)
def test_continuous_usage_on_every_chunk(server, route):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = stream_chunks(server, route, stream_options=opts)
    *with_choices, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
    assert with_choices  # (chat: the role chunk first, usage with 0 completion tokens)
    for chunk in with_choices:
        usage = chunk["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert with_choices[-1]["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("route", BODIES)
def test_include_usage_alone_gives_one_usage_chunk(server, route):
    chunks = stream_chunks(server, route, stream_options={"include_usage": True})
    assert [c.get("usage") is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]


@pytest.mark.parametrize("route", BODIES)
def test_force_include_usage(usage_server, route):
    """--enable-force-include-usage: usage on every chunk and a usage chunk at the end, with
    no stream_options (vLLM's should_include_usage)."""
    chunks = stream_chunks(usage_server, route)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert all(c["usage"] is not None for c in chunks)


@pytest.mark.parametrize("route", BODIES)
def test_prompt_tokens_details_with_the_flag(usage_server, route):
    long = " ".join(f"w{i}" for i in range(60)) + route  # several full KV blocks
    text = (
        {"prompt": long}
        if route == "completions"
        else {"messages": [{"role": "user", "content": long}]}
    )
    first = post(usage_server, route, max_tokens=2, **text)["usage"]
    again = post(usage_server, route, max_tokens=2, **text)["usage"]
    # chat's details have created_cache_tokens too (vLLM's), completions' only cached_tokens
    written = {"created_cache_tokens": first["prompt_tokens"] // 16 * 16}
    assert first["prompt_tokens_details"] == {
        "cached_tokens": 0,
        **(written if route == "chat/completions" else {}),
    }
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < again["prompt_tokens"]


# ---------------------------------------------------------------- token ids, tokenizer info


def test_return_tokens_as_token_ids_flag(usage_server):
    lp = post(usage_server, "completions", max_tokens=3, logprobs=1, return_token_ids=True)
    choice = lp["choices"][0]
    names = [f"token_id:{i}" for i in choice["token_ids"]]
    assert choice["logprobs"]["tokens"] == names
    assert [next(iter(top)) for top in choice["logprobs"]["top_logprobs"]] == names
    chat = post(
        usage_server,
        "chat/completions",
        max_tokens=3,
        logprobs=True,
        top_logprobs=1,
        return_token_ids=True,
    )["choices"][0]
    content = chat["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{i}" for i in chat["token_ids"]]
    assert [c["top_logprobs"][0]["token"] for c in content] == [c["token"] for c in content]
    # A request's own field wins over the flag.
    mine = post(
        usage_server, "completions", max_tokens=3, logprobs=1, return_tokens_as_token_ids=False
    )["choices"][0]["logprobs"]["tokens"]
    assert not any(t.startswith("token_id:") for t in mine)


def test_tokenizer_info(usage_server, server):
    assert httpx.get(server.url + "/tokenizer_info").status_code == 404  # without the flag
    assert httpx.get(usage_server.url + "/tokenizer_info").status_code == 401  # the key
    r = httpx.get(usage_server.url + "/tokenizer_info", headers=AUTH)
    assert r.status_code == 200, r.text
    info = r.json()
    assert isinstance(info["tokenizer_class"], str) and info["tokenizer_class"]
    assert "vocab_file" not in info and "merges_file" not in info
    tok = httpx.post(usage_server.url + "/tokenize", json={"prompt": "Hi"}, headers=AUTH).json()
    assert info.get("model_max_length") is None or info["model_max_length"] > 0
    assert tok["count"] > 0


# ---------------------------------------------------------------- /v1/chat/completions/batch


def batch(srv, **fields) -> httpx.Response:
    convs = [[{"role": "user", "content": "Hello there"}], [{"role": "user", "content": "Bye"}]]
    body = {"messages": convs, "max_tokens": 3, "ignore_eos": True, **fields}
    return httpx.post(srv.url + "/v1/chat/completions/batch", json=body, timeout=60)


def test_chat_batch_answers_each_conversation(server):
    r = batch(server, request_id="conform-batch")
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and [c["index"] for c in out["choices"]] == [0, 1]
    singles = []
    for i, text in enumerate(["Hello there", "Bye"]):
        messages = [{"role": "user", "content": text}]
        one = post(
            server,
            "chat/completions",
            messages=messages,
            max_tokens=3,
            ignore_eos=True,
            request_id=f"conform-batch_{i}",
        )
        singles.append(one)
        assert out["choices"][i]["message"] == one["choices"][0]["message"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert out["usage"][key] == sum(s["usage"][key] for s in singles)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"stream": True}, "stream"),
        ({"n": 2}, "n"),
        ({"messages": [{"role": "user", "content": "flat"}]}, "messages"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ],
)
def test_chat_batch_refusals(server, fields, param):
    r = batch(server, **fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# ---------------------------------------------------------------- validation as vLLM's


def test_lax_booleans_as_pydantic(server):
    out = post(server, "chat/completions", max_tokens=2, logprobs="true", top_logprobs=1)
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and len(content[0]["top_logprobs"]) == 1
    assert (
        post(server, "chat/completions", max_tokens=2, logprobs=0)["choices"][0]["logprobs"] is None
    )


def test_top_logprobs_minus_one_is_the_vocabulary(server):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={**CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": -1},
        timeout=60,
    )
    assert r.status_code == 400, r.text  # the vocabulary passes --max-logprobs (20)
    error = r.json()["error"]
    assert error["param"] == "top_logprobs" and "whole vocabulary" in error["message"]
    assert post(server, "chat/completions", max_tokens=2, top_logprobs=0)["choices"]


def test_out_of_vocabulary_wording(server):
    r = httpx.post(
        server.url + "/v1/completions", json={"prompt": [1, 10**9], "max_tokens": 2}, timeout=60
    )
    assert r.status_code == 400 and "out of vocabulary" in r.json()["error"]["message"], r.text


# ---------------------------------------------------------------- ORCA load report


def load_report(srv, route: str, fmt: str | None, **fields) -> str | None:
    headers = {} if fmt is None else {"endpoint-load-metrics-format": fmt}
    body = {**BODIES[route], "max_tokens": 2, **fields}
    r = httpx.post(f"{srv.url}/v1/{route}", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.headers.get("endpoint-load-metrics")


@pytest.mark.parametrize("route", BODIES)
def test_orca_load_report_header(server, route):
    text = load_report(server, route, "TEXT")
    names = re.fullmatch(
        r"TEXT named_metrics\.kv_cache_usage_perc=([0-9.e-]+), "
        r"named_metrics\.num_requests_waiting=([0-9.]+)",
        text or "",
    )
    assert names, text
    assert 0.0 <= float(names[1]) <= 1.0
    report = load_report(server, route, "json")
    assert report is not None and report.startswith("JSON ")
    assert set(json.loads(report[5:])["named_metrics"]) == {
        "kv_cache_usage_perc",
        "num_requests_waiting",
    }
    assert load_report(server, route, None) is None  # not asked
    assert load_report(server, route, "BIN") is None  # (vLLM: TEXT and JSON only)
    assert load_report(server, route, "TEXT", stream=True) is None  # a stream: none


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**64])
def test_seed_past_64_bits_is_too_big_not_a_float(server, seed):
    body = {"prompt": "Hi", "max_tokens": 1, "seed": seed}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "seed" and "must be a 64-bit integer" in error["message"]
    assert "e+" not in error["message"]  # never shown as the float JSON parsing made of it
    # pydantic's error type for the bound, which vLLM's own test_long_seed matches
    bound = "greater_than_equal" if seed < 0 else "less_than_equal"
    assert f"({bound})." in error["message"]
    assert post(server, "completions", max_tokens=1, seed=2**63 - 1)["choices"]


# ---------------------------------------------------------------- waiting by reason


def test_waiting_by_reason_splits_the_waiting():
    from trillm.entrypoints.openai.metrics.prometheus import waiting_by_reason
    from trillm.messages import SchedulerStats

    stats = SchedulerStats(num_waiting_reqs=5, num_deferred_waiting_reqs=2)
    fam = waiting_by_reason([(["m", "0"], stats)])
    assert {s.labels["reason"]: s.value for s in fam.samples} == {"capacity": 3, "deferred": 2}


def test_waiting_by_reason_on_metrics(server):
    text = httpx.get(server.url + "/metrics", timeout=30).text
    found = re.findall(r'vllm:num_requests_waiting_by_reason\{[^}]*reason="(\w+)"\} (\S+)', text)
    assert sorted(reason for reason, _ in found) == ["capacity", "deferred"]
