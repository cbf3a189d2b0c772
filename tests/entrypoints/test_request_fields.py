"""Request fields that used to be accepted and ignored over HTTP (issue 12): each now changes
what happens, as vLLM documents it, or is refused with a 400 naming it. A real server on the
embedded default model; greedy runs compared with the same request without the field."""

from __future__ import annotations

import json

import httpx
import pytest
from server_harness import ServerProcess

PROMPT = "And God said, Let there be light"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("request-fields") / "server.log"
    srv = ServerProcess(["--max-model-len", "512"], log).start()
    yield srv
    assert srv.stop() == 0, srv.log()


def complete(srv: ServerProcess, **body) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True, **body}
    r = httpx.post(srv.base_url + "/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def refused(srv: ServerProcess, path: str, body: dict) -> dict:
    r = httpx.post(srv.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_allowed_token_ids_restrict_every_sampled_token(server):
    free = complete(server)["choices"][0]["token_ids"]
    allowed = [t for t in range(200, 230) if t not in free]
    for temperature in (0, 1.0):
        out = complete(server, allowed_token_ids=allowed, temperature=temperature, seed=3)
        ids = out["choices"][0]["token_ids"]
        assert len(ids) == 8 and set(ids) <= set(allowed), ids


def test_bad_words_are_never_generated(server):
    free = complete(server)["choices"][0]
    first = free["token_ids"][0]
    word = httpx.post(server.url + "/detokenize", json={"tokens": [first]}).json()["prompt"]
    out = complete(server, bad_words=[word.strip()])["choices"][0]
    assert out["token_ids"][0] != first, (word, out)
    assert word.strip() not in out["text"].split()


def test_truncate_prompt_tokens_keeps_the_last_tokens(server):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT * 40}).json()["tokens"]
    assert len(ids) > 500  # longer than the context: refused without truncation
    refused(server, "/v1/completions", {"prompt": ids, "max_tokens": 4})
    out = complete(server, prompt=ids, truncate_prompt_tokens=12)
    assert out["usage"]["prompt_tokens"] == 12
    assert out["choices"][0]["prompt_token_ids"] == ids[-12:]
    same = complete(server, prompt=ids[-12:])
    assert out["choices"][0]["token_ids"] == same["choices"][0]["token_ids"]
    # -1: the context length, which leaves no room for output (vLLM answers the same).
    err = refused(server, "/v1/completions", {"prompt": ids, "truncate_prompt_tokens": -1})
    assert "512 input tokens" in err["message"], err


def test_return_tokens_as_token_ids_in_logprobs(server):
    out = complete(server, logprobs=2, return_tokens_as_token_ids=True)["choices"][0]
    ids = out["token_ids"]
    assert out["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
    for top in out["logprobs"]["top_logprobs"]:
        assert all(k.startswith("token_id:") for k in top)
    plain = complete(server, logprobs=2)["choices"][0]
    assert not any(t.startswith("token_id:") for t in plain["logprobs"]["tokens"])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_refused_fields_name_themselves(server, path):
    base = (
        {"prompt": PROMPT}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "Hi"}]}
    )
    cases = [
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"bad_words": [""]}, "bad_words"),
        ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ]
    for changes, param in cases:
        err = refused(server, path, {**base, "max_tokens": 2, **changes})
        assert err["param"] == param, (changes, err)


def test_unknown_fields_are_ignored_with_one_warning(server):
    out = complete(server, not_a_vllm_field=1, stream_options=None)
    assert out["choices"][0]["token_ids"]
    log = server.log()
    assert "present in the request but ignored: not_a_vllm_field" in log


def test_truncate_prompt_tokens_takes_a_text_longer_than_the_context(server):
    text = "And the earth was without form, and void. " * 3000  # ~130k characters
    err = refused(server, "/v1/completions", {"prompt": text, "max_tokens": 2})
    assert "maximum context length" in err["message"]
    out = complete(server, prompt=text, truncate_prompt_tokens=16, max_tokens=2)
    assert out["usage"]["prompt_tokens"] == 16


def test_chat_echo_prepends_the_assistants_last_message(server):
    start = "And God said"
    body = {
        "messages": [
            {"role": "user", "content": "Go on."},
            {"role": "assistant", "content": start},
        ],
        "continue_final_message": True,
        "add_generation_prompt": False,
        "max_tokens": 6,
        "temperature": 0,
    }
    url = server.base_url + "/chat/completions"
    plain = httpx.post(url, json=body, timeout=60).json()["choices"][0]["message"]["content"]
    echoed = httpx.post(url, json={**body, "echo": True}, timeout=60).json()
    assert echoed["choices"][0]["message"]["content"] == start + plain
    streamed = []
    with httpx.stream("POST", url, json={**body, "echo": True, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                streamed.append(delta.get("content") or "")
    assert "".join(streamed) == start + plain
    # A last message that is not the assistant's is not echoed.
    user_last = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    a = httpx.post(url, json=user_last, timeout=60).json()["choices"][0]["message"]["content"]
    b = httpx.post(url, json={**user_last, "echo": True}, timeout=60).json()
    assert b["choices"][0]["message"]["content"] == a


def test_streamed_echo_with_logprobs_sends_the_prompts_first_as_vllm(server):
    """echo + logprobs streamed: the first chunk of each choice is the prompt's text and
    logprobs followed by the first output's (vLLM's shape); the chunks add up to the
    non-streamed answer."""
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "echo": True, "logprobs": 2}
    whole = httpx.post(server.base_url + "/completions", json=body, timeout=60).json()
    expected = whole["choices"][0]
    chunks = []
    url = server.base_url + "/completions"
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks += json.loads(line[6:])["choices"]
    first = chunks[0]
    assert first["text"].startswith(PROMPT) and len(first["text"]) > len(PROMPT)
    prompt_len = whole["usage"]["prompt_tokens"]
    assert len(first["logprobs"]["tokens"]) == prompt_len + 1  # the prompt's, then 1 token
    assert first["logprobs"]["token_logprobs"][0] is None  # nothing predicts the first token
    assert "".join(c["text"] for c in chunks) == expected["text"]
    for key in ("tokens", "top_logprobs", "text_offset"):
        streamed = [v for c in chunks if c["logprobs"] for v in c["logprobs"][key]]
        assert streamed == expected["logprobs"][key], key
    values = [v for c in chunks if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
    assert values[1:] == pytest.approx(expected["logprobs"]["token_logprobs"][1:], abs=1e-5)
