"""``use_beam_search`` over HTTP with the official ``openai`` client (vLLM's way to ask:
``extra_body``): the choices are the beams ``LLM.beam_search`` returns for the same prompt
and parameters (which tests/engine/test_beam_search.py holds equal to transformers'), best
first, on completions and chat, JSON and streamed; and what cannot combine with it refused
by name."""

from __future__ import annotations

import httpx
import openai
import pytest
from beam_reference import eos_prone_checkpoint
from server_harness import ServerProcess

from trillm import LLM, BeamSearchParams
from trillm.testing.tiny_models import EOS_IDS

NAME = "beam"
PROMPTS = ["In the beginning", "Copyright holders may not"]
ARGS = ["--max-model-len", "256", "--kv-cache-memory", "8MiB"]
ARGS += ["--distributed-executor-backend", "uni", "--served-model-name", NAME]


@pytest.fixture(scope="module")
def model_path(tiny_model_factory, tmp_path_factory):
    return eos_prone_checkpoint(tiny_model_factory("llama"), tmp_path_factory.mktemp("eos"))


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("beam-http") / "server.log"
    srv = ServerProcess([model_path, *ARGS], log).start()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(model_path):
    engine = LLM(
        model_path, max_model_len=256, kv_cache_memory="8MiB", distributed_executor_backend="uni"
    )  # as the server (ARGS): no worker process to start
    yield engine
    engine.shutdown()


def extra(obj, key):
    return (obj.model_extra or {})[key]


def expected_choices(llm, prompt_ids, params):
    """(token ids, text, finish_reason) of each beam, best first, as choices show them."""
    tok = llm.get_tokenizer()
    out = llm.beam_search([{"prompt_token_ids": prompt_ids}], params)[0]
    choices = []
    for seq in out.sequences:
        output = seq.tokens[len(prompt_ids) :]
        ended = output[-1] in EOS_IDS
        text = tok.decode(output[:-1] if ended else output, skip_special_tokens=True)
        choices.append((output, text, "stop" if ended else "length"))
    return choices


@pytest.mark.parametrize(
    ("n", "penalty", "early_stopping"), [(4, 1.0, False), (3, 0.5, True), (1, 1.0, False)]
)
def test_completion_choices_are_the_beams(client, llm, n, penalty, early_stopping):
    beam = {"use_beam_search": True, "length_penalty": penalty, "early_stopping": early_stopping}
    out = client.completions.create(
        model=NAME,
        prompt=PROMPTS,
        n=n,
        max_tokens=10,
        extra_body={**beam, "return_token_ids": True},
    )
    assert [c.index for c in out.choices] == list(range(n * len(PROMPTS)))
    tok = llm.get_tokenizer()
    params = BeamSearchParams(n, 10, length_penalty=penalty, early_stopping=early_stopping)
    for i, prompt in enumerate(PROMPTS):
        want = expected_choices(llm, tok.encode(prompt), params)
        got = [
            (extra(c, "token_ids"), c.text, c.finish_reason)
            for c in out.choices[i * n : (i + 1) * n]
        ]
        assert got == want
    assert out.usage.completion_tokens == sum(len(extra(c, "token_ids")) for c in out.choices)


def test_chat_choices_are_the_beams_json_and_streamed(client, llm):
    messages = [{"role": "user", "content": "Say something"}]
    beam = {"use_beam_search": True, "return_token_ids": True}
    out = client.chat.completions.create(
        model=NAME, messages=messages, n=3, max_tokens=8, extra_body=beam
    )
    prompt_ids = extra(out, "prompt_token_ids")
    want = expected_choices(llm, prompt_ids, BeamSearchParams(3, 8))
    got = [(extra(c, "token_ids"), c.message.content, c.finish_reason) for c in out.choices]
    assert got == want
    stream = client.chat.completions.create(
        model=NAME, messages=messages, n=3, max_tokens=8, stream=True, extra_body=beam
    )
    texts, reasons = ["", "", ""], [None, None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert list(zip(texts, reasons, strict=True)) == [(t, r) for _, t, r in want]


def test_stop_strings_end_beams(client, llm):
    body = {"use_beam_search": True, "ignore_eos": True}
    free = client.completions.create(
        model=NAME, prompt=PROMPTS[0], n=2, max_tokens=8, extra_body=body
    )
    stop = free.choices[0].text[2:5]
    for keep in (False, True):
        out = client.completions.create(
            model=NAME,
            prompt=PROMPTS[0],
            n=2,
            max_tokens=8,
            stop=[stop],
            extra_body={**body, "include_stop_str_in_output": keep},
        )
        params = BeamSearchParams(
            2, 8, ignore_eos=True, stop=[stop], include_stop_str_in_output=keep
        )
        want = llm.beam_search([PROMPTS[0]], params)[0].sequences
        assert [c.text for c in out.choices] == [s.text[len(PROMPTS[0]) :] for s in want]
        assert any(extra(c, "stop_reason") == stop for c in out.choices)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_what_cannot_combine_is_refused_by_name(server, path):
    base = (
        {"prompt": PROMPTS[0]}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "Hi"}]}
    )
    beam = {"use_beam_search": True, "n": 2}
    logprobs = {"logprobs": 2} if path == "/v1/completions" else {"logprobs": True}
    cases = [
        ({**beam, "temperature": 0.7}, "temperature"),
        ({**beam, "top_p": 0.5}, "top_p"),
        ({**beam, "repetition_penalty": 1.2}, "repetition_penalty"),
        ({**beam, "spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
        ({**beam, **logprobs}, "logprobs"),
        ({**beam, "response_format": {"type": "json_object"}}, "response_format"),
        ({**beam, "length_penalty": -1e308}, "length_penalty"),  # 2 ** -1e308 == 0
        ({**beam, "n": 7}, "n"),  # 7 beams x 3 candidates: over --max-logprobs (20)
        ({"length_penalty": 0.5}, "length_penalty"),
        ({"early_stopping": True}, "early_stopping"),
    ]
    for changes, param in cases:
        r = httpx.post(server.url + path, json={**base, "max_tokens": 4, **changes}, timeout=60)
        assert r.status_code == 400, (changes, r.text)
        assert r.json()["error"]["param"] == param, (changes, r.text)
