"""vLLM's -1 for ``prompt_logprobs`` / ``logprobs`` (the whole vocabulary) on a real ``trillm
serve`` with ``--max-logprobs -1`` (no cap but the vocabulary), driven by the official
``openai`` client; ``--max-logprob-entries`` still bounds what one request may ask for."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from server_harness import ServerProcess

NAME = "tiny-llama"
ROWS = 24  # prompt positions whose whole-vocabulary rows fit --max-logprob-entries


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def vocab(model_path):
    return json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def client(model_path, vocab, tmp_path_factory):
    log = tmp_path_factory.mktemp("whole-vocab") / "server.log"
    srv = ServerProcess(
        [
            model_path,
            "--served-model-name",
            NAME,
            "--max-model-len",
            "256",
            "--kv-cache-memory",
            "16MiB",
            "--max-logprobs",
            "-1",
            "--max-logprob-entries",
            str(ROWS * (vocab + 1)),
        ],
        log,
    ).start()
    yield openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)
    assert srv.stop() == 0, srv.log()


def _chat(client, content: str, **body):
    return client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": content}],
        max_tokens=1,
        temperature=0,
        extra_body=body,
    )


def test_prompt_logprobs_minus_one_is_every_token_at_every_position(client, vocab):
    whole = extra(_chat(client, "Beijing is the capital of", prompt_logprobs=-1), "prompt_logprobs")
    five = extra(_chat(client, "Beijing is the capital of", prompt_logprobs=5), "prompt_logprobs")
    assert whole[0] is None and len(whole) == len(five) > 1
    for row, top in zip(whole[1:], five[1:]):
        assert len(row) == vocab  # (the prompt's own token is among them)
        ranked = sorted(row.items(), key=lambda kv: kv[1]["rank"])
        assert [int(t) for t, _ in ranked[:5]] == [int(t) for t in top if top[t]["rank"] <= 5]


def test_completion_logprobs_minus_one_is_the_whole_vocabulary(client, vocab):
    out = client.completions.create(
        model=NAME,
        prompt="hello",
        max_tokens=1,
        logprobs=-1,
        extra_body={"return_tokens_as_token_ids": True},  # distinct keys for every id
    )
    assert len(out.choices[0].logprobs.top_logprobs[0]) == vocab


def test_whole_vocabulary_rows_stay_within_max_logprob_entries(client):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, "word " * (2 * ROWS), prompt_logprobs=-1)
    assert info.value.body["param"] == "prompt_logprobs"
    assert "--max-logprob-entries" in info.value.body["message"]


def test_below_minus_one_is_refused_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, "hi", prompt_logprobs=-2)
    assert info.value.body["param"] == "prompt_logprobs"


def extra(completion, key):
    return (completion.model_extra or {})[key]
