"""``prompt_embeds`` on /v1/completions with the official openai client (vLLM's
``--enable-prompt-embeds``; ``extra_body={"prompt_embeds": base64 of torch.save(tensor)}``):
greedy-equal to the same ids sent as a token prompt (tokens and logprobs), several at once
before the prompts, streamed; every bad input a 400 naming its field; a server without the
flag refuses naming the flag."""

from __future__ import annotations

import base64
import io
import os

import httpx
import openai
import pytest
import torch
from hf_reference import load_hf_model
from server_harness import ServerProcess
from shared_servers import FAKE_256, FAKE_256_GROUP

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.xdist_group(FAKE_256_GROUP)]

NAME = "tiny-embeds"
MAX_NEW = 6


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from trillm.testing.tiny_models import build_tiny_model

    return str(build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama-embeds-http")))


@pytest.fixture(scope="module")
def server(path, tmp_path_factory):
    log = tmp_path_factory.mktemp("server-embeds") / "server.log"
    args = [path, "--served-model-name", NAME, "--max-model-len", "64", "--enable-prompt-embeds"]
    args += ["--kv-cache-memory", "4MiB", "--max-num-batched-tokens", "16"]
    srv = ServerProcess([*args, "--distributed-executor-backend", "uni"], log).start()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(
        base_url=server.base_url, api_key="unused", max_retries=0, timeout=120
    ) as client:
        yield client


def ids_of(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 4000, (n,), generator=g).tolist()


def encoded(value: object) -> str:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def embeds_b64(path: str, ids: list[int], dtype: torch.dtype = torch.float32) -> str:
    with torch.no_grad():
        rows = load_hf_model(path).get_input_embeddings()(torch.tensor(ids))
    return encoded(rows.to(dtype).clone())


def complete(client, prompt, **extra):
    return client.completions.create(
        model=NAME,
        prompt=prompt,
        max_tokens=MAX_NEW,
        temperature=0.0,
        logprobs=2,
        extra_body={"return_token_ids": True, "ignore_eos": True, **extra},
    )


def test_embeds_equal_the_token_prompt(client, path):
    ids = ids_of(23, 1)  # prefilled in chunks of 16
    by_tokens = complete(client, ids).choices[0]
    out = complete(client, "", prompt_embeds=embeds_b64(path, ids))
    by_embeds = out.choices[0]
    assert by_embeds.token_ids == by_tokens.token_ids and len(by_embeds.token_ids) == MAX_NEW
    assert by_embeds.text == by_tokens.text
    diffs = [
        abs(a - b)
        for a, b in zip(
            by_embeds.logprobs.token_logprobs, by_tokens.logprobs.token_logprobs, strict=True
        )
    ]
    assert max(diffs) < 1e-4, diffs
    assert out.usage.prompt_tokens == 23


def test_several_embeds_come_before_the_prompts_and_stream(client, path):
    a, b = ids_of(7, 2), ids_of(30, 3)
    out = complete(
        client, [a], prompt_embeds=[embeds_b64(path, a), embeds_b64(path, b, torch.float16)]
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert (
        out.choices[0].token_ids
        == out.choices[2].token_ids
        == complete(client, a).choices[0].token_ids
    )
    assert len(out.choices[1].token_ids) == MAX_NEW
    stream = client.completions.create(
        model=NAME,
        prompt="",
        max_tokens=MAX_NEW,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True, "prompt_embeds": embeds_b64(path, a)},
    )
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text == out.choices[0].text


class _CallsGetpid:
    def __reduce__(self):
        return (os.getpid, ())


def _bad_cases(path: str) -> dict[str, tuple[dict, str, str]]:
    ok = embeds_b64(path, ids_of(4, 5))
    raw = io.BytesIO()
    torch.save({"rows": _CallsGetpid()}, raw)  # a pickled call weights_only refuses
    return {
        "not base64": ({"prompt_embeds": "@@@"}, "prompt_embeds", "not valid base64"),
        "not torch data": (
            {"prompt_embeds": base64.b64encode(b"hello").decode()},
            "prompt_embeds",
            "not a tensor saved by torch.save",
        ),
        "a pickled call": (
            {"prompt_embeds": base64.b64encode(raw.getvalue()).decode()},
            "prompt_embeds",
            "not a tensor saved by torch.save",
        ),
        "a dict of tensors": (
            {"prompt_embeds": encoded({"x": torch.zeros(2, 64)})},
            "prompt_embeds",
            "dense torch tensor",
        ),
        "ints": (
            {"prompt_embeds": encoded(torch.zeros(2, 64, dtype=torch.int32))},
            "prompt_embeds",
            "float32, bfloat16 or float16",
        ),
        "a wrong width": (
            {"prompt_embeds": encoded(torch.zeros(2, 32))},
            "prompt_embeds",
            "shape [num_tokens, 64]",
        ),
        "NaN": (
            {"prompt_embeds": encoded(torch.full((2, 64), float("nan")))},
            "prompt_embeds",
            "NaN or infinite",
        ),
        "too long a text": (
            {"prompt_embeds": "A" * 200_000},
            "prompt_embeds",
            "base64 characters, more than [64, 64]",
        ),
        "no prompt at all": ({}, "prompt", "Either prompt or prompt_embeds must be provided"),
        "an empty list": ({"prompt_embeds": []}, "prompt", "must be provided and non-empty"),
        "an empty list beside a prompt": (
            {"prompt": "Hi", "prompt_embeds": []},
            "prompt_embeds",
            "must not be empty",
        ),
        "echo": ({"prompt_embeds": ok, "echo": True}, "echo", "not supported with prompt_embeds"),
        "prompt_logprobs": (
            {"prompt_embeds": ok, "prompt_logprobs": 1},
            "prompt_logprobs",
            "not supported with prompt_embeds",
        ),
        "beam search": (
            {"prompt_embeds": ok, "use_beam_search": True, "n": 2},
            "use_beam_search",
            "does not take prompt_embeds",
        ),
    }


def test_bad_inputs_are_400s_naming_the_field(server, path):
    for case, (body, param, words) in _bad_cases(path).items():
        r = httpx.post(
            server.base_url + "/completions",
            json={"model": NAME, "max_tokens": 2, **body},
            timeout=60,
        )
        assert r.status_code == 400, (case, r.text)
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], (case, error)


def test_a_server_without_the_flag_refuses_naming_it(shared_server, path):
    srv = shared_server(FAKE_256)
    r = httpx.post(
        srv.base_url + "/completions",
        json={"prompt_embeds": embeds_b64(path, [5, 6]), "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 400
    assert "--enable-prompt-embeds" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "prompt_embeds"
