"""The 400s vLLM's own server tests match for token ids (tests/entrypoints/openai/chat_completion/
test_chat_logit_bias_validation.py and test_chat_stop_token_ids_validation.py in vLLM's
repository, run by benchmarks/peers/vllm_server_tests.py): the message names each offending
token id and the vocabulary size, and every ``logit_bias`` key that is no token id at once.
Checked against ``trillm serve`` with the fake runner.
"""

from __future__ import annotations

import json
from pathlib import Path

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
