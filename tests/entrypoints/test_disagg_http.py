"""Prefill/decode disaggregation over HTTP with the official ``openai`` client: a prefill
instance (kv_producer) and a decode instance (kv_consumer) of the SharedStorageConnector
behind ``trillm.entrypoints.disagg_proxy``. The proxy's answers equal one instance's; the
decode instance computes none of the prompt tokens the prefill instance stored (its
``vllm:external_prefix_cache_hits``), and a truncated file is recomputed, not read."""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest
from kv_connectors import (
    PAIR_PROMPTS,
    SERVE_ARGS,
    assert_pair_answers_as_one_instance,
    assert_recomputed,
    client,
    complete,
    disagg_pair,
    shared_storage_kv,
)
from server_harness import run_trillm


@pytest.fixture(scope="module")
def pair(tiny_model_factory, tmp_path_factory):
    """(prefill server, decode server, proxy URL, storage folder)."""
    logs = tmp_path_factory.mktemp("disagg")
    folder = str(logs / "kv")
    prefill_kv = json.dumps(shared_storage_kv("kv_producer", folder))
    decode_kv = json.dumps(shared_storage_kv("kv_consumer", folder))
    with disagg_pair(tiny_model_factory("qwen2"), logs, prefill_kv, decode_kv) as servers:
        yield *servers, folder


def test_the_pair_answers_as_one_instance_and_decode_computes_no_stored_token(pair):
    prefill, decode, proxy, folder = pair
    assert_pair_answers_as_one_instance(prefill, decode, proxy)
    assert len(os.listdir(folder)) == len(PAIR_PROMPTS)


def test_a_streamed_chat_through_the_pair_equals_one_instance(pair):
    prefill, _, proxy, _ = pair
    messages = [{"role": "user", "content": "The license grants every holder " * 6}]
    kwargs = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0.0}
    stream = client(proxy).chat.completions.create(stream=True, **kwargs)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    alone = client(prefill.url).chat.completions.create(**kwargs)
    assert text == alone.choices[0].message.content


def test_a_truncated_file_is_recomputed_by_the_decode_instance(pair):
    prefill, decode, _, folder = pair
    prompt = list(range(300, 350))
    before = set(os.listdir(folder))
    alone = complete(prefill.url, prompt)  # stored; the decode instance never saw it
    (name,) = set(os.listdir(folder)) - before
    with open(os.path.join(folder, name), "r+b") as f:
        f.truncate(os.path.getsize(f.name) // 2)
    assert_recomputed(decode, prompt, alone)
    assert "is truncated or not this model's: recomputing" in decode.log()


def test_kv_transfer_params_are_refused_by_name(pair):
    _, decode, _, _ = pair
    with pytest.raises(openai.BadRequestError, match="kv_transfer_params"):
        client(decode.url).completions.create(
            model="tiny",
            prompt="x",
            max_tokens=1,
            extra_body={"kv_transfer_params": {"do_remote_decode": True}},
        )


def test_other_connectors_stop_serve_naming_them(tiny_model_factory, tmp_path):
    config = json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})
    out = run_trillm(
        ["serve", tiny_model_factory("qwen2"), *SERVE_ARGS, "--kv-transfer-config", config],
        tmp_path / "log",
    )
    assert out.returncode != 0
    assert "'LMCacheConnectorV1' is not implemented" in out.output


@pytest.mark.parametrize(
    ("content", "kind", "status"),
    [
        (b"[1, 2]", "application/json", 400),  # before: 500 (the proxy failed on a list)
        (b'"text"', "application/json", 400),
        (b"{not json", "application/json", 400),  # before: quart's HTML 400
        (b'{"prompt": "x"}', "text/plain", 400),  # as the instances: OpenAI answers 400
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_body_that_is_not_a_json_object_is_a_4xx_in_openais_shape(
    pair, content, kind, status, path
):
    _, _, proxy, _ = pair
    r = httpx.post(proxy + path, content=content, headers={"Content-Type": kind}, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == status, r.text
