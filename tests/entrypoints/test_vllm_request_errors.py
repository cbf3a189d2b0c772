"""The 400s vLLM's own server tests match (tests/entrypoints/openai in vLLM's repository, run by
benchmarks/peers/vllm_server_tests.py): for token ids (chat_completion/
test_chat_logit_bias_validation.py, test_chat_stop_token_ids_validation.py) the message names
each offending token id and the vocabulary size, and every ``logit_bias`` key that is no token
id at once; a completion without prompt or prompt_embeds gets vLLM's words
(completion/test_prompt_validation.py). Checked against ``trillm serve`` with the fake runner.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from shared_servers import FAKE_256, FAKE_256_GROUP

from trillm.default_model import ensure_default_model

pytestmark = pytest.mark.xdist_group(FAKE_256_GROUP)

MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def client(shared_server):
    server = shared_server(FAKE_256)
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def vocab_size() -> int:
    """The default model's (the fake runner serves its config)."""
    config = Path(ensure_default_model()) / "config.json"
    return int(json.loads(config.read_text())["vocab_size"])


def bad_request(client, **fields) -> str:
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(
            model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=2, **fields
        )
    return str(excinfo.value)


@pytest.mark.parametrize(
    "fields",
    [
        {"logit_bias": {"1": 1.0, "99999": 1.0}},
        {"extra_body": {"stop_token_ids": [3, 99999]}},
        {"extra_body": {"allowed_token_ids": [99999]}},
    ],
    ids=["logit_bias", "stop_token_ids", "allowed_token_ids"],
)
def test_out_of_vocab_ids_are_named_with_the_vocab_size(client, vocab_size, fields):
    message = bad_request(client, **fields)
    assert "99999" in message and str(vocab_size) in message


def test_every_logit_bias_key_that_is_no_token_id_is_named(client):
    message = bad_request(client, logit_bias={"bad1": 50.0, "7": 1.0, "bad2": 20.0})
    assert "bad1" in message and "bad2" in message and "logit_bias" in message


@pytest.mark.parametrize("body", [{"prompt_embeds": []}, {"prompt": ""}, {}])
def test_no_prompt_is_refused_in_vllms_words(shared_server, body):
    # (a server without --enable-prompt-embeds: the rule comes before that refusal, as in vLLM)
    server = shared_server(FAKE_256)
    r = httpx.post(f"{server.url}/v1/completions", json={"max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt"
    assert error["message"] == "Either prompt or prompt_embeds must be provided and non-empty."
