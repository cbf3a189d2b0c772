"""``--skip-tokenizer-init`` (vLLM's flag): no tokenizer is loaded; prompts are token ids, the
outputs carry token ids and empty text, and what needs the tokenizer is refused by name."""

from __future__ import annotations

import openai
import pytest
from hf_reference import hf_greedy
from server_harness import ServerProcess

from trillm import LLM, SamplingParams

IDS = [9, 41, 77, 120, 5, 63, 200, 31]
ARGS = ["--max-model-len", "256", "--kv-cache-memory", "16MiB"]


@pytest.fixture(scope="module")
def servers(tiny_model_factory, tmp_path_factory):
    model = tiny_model_factory("qwen2")
    logs = tmp_path_factory.mktemp("skip-tokenizer-init")
    plain = ServerProcess([model, *ARGS], logs / "plain.log").start()
    try:
        skip = ServerProcess([model, *ARGS, "--skip-tokenizer-init"], logs / "skip.log").start()
    except BaseException:
        plain.stop()
        raise
    yield model, plain, skip
    assert skip.stop() == 0, skip.log()
    assert plain.stop() == 0, plain.log()


def _client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=120)


def test_token_id_prompts_give_the_plain_servers_tokens_and_empty_text(servers):
    model, plain, skip = servers
    body = dict(model=model, prompt=IDS, max_tokens=12, temperature=0, echo=True)
    extra = {"return_token_ids": True, "ignore_eos": True}
    want = _client(plain).completions.create(**body, extra_body=extra).choices[0]
    got = _client(skip).completions.create(**body, extra_body=extra).choices[0]
    assert got.token_ids == want.token_ids == hf_greedy(model, IDS, 12)
    assert got.prompt_token_ids == IDS
    assert want.text and got.text == ""
    assert got.finish_reason == "length"
    # logprobs still come, as token ids
    got = _client(skip).completions.create(
        **{**body, "echo": False},
        logprobs=2,
        extra_body={**extra, "return_tokens_as_token_ids": True},
    )
    tokens = got.choices[0].logprobs.tokens
    assert tokens == [f"token_id:{t}" for t in want.token_ids]


def test_logprob_entries_carry_no_text(servers):
    """As vLLM: prompt_logprobs' ``decoded_token`` is null; logprobs by text are refused."""
    model, plain, skip = servers
    body = dict(model=model, prompt=IDS, max_tokens=2, extra_body={"prompt_logprobs": 1})
    want = _client(plain).completions.create(**body).choices[0].prompt_logprobs
    got = _client(skip).completions.create(**body).choices[0].prompt_logprobs
    assert got[0] is None and want[0] is None
    # the same entries (ids, ranks), with no text where the plain server decodes one
    assert [list(p) for p in got[1:]] == [list(p) for p in want[1:]]
    assert all(isinstance(e["decoded_token"], str) for p in want[1:] for e in p.values())
    assert all(e["decoded_token"] is None for p in got[1:] for e in p.values())
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            _client(skip).completions.create(
                model=model, prompt=IDS, max_tokens=2, logprobs=1, stream=stream
            )
        assert "skip-tokenizer-init" in err.value.message
        assert "return_tokens_as_token_ids" in err.value.message
        assert err.value.body["param"] == "logprobs"


@pytest.mark.parametrize(
    ("request_kwargs", "param"),
    [
        ({"prompt": "Hello there"}, "prompt"),
        ({"prompt": IDS, "stop": ["x"]}, "stop"),
        ({"prompt": IDS, "extra_body": {"bad_words": ["x"]}}, "bad_words"),
        ({"prompt": IDS, "extra_body": {"structured_outputs": {"regex": "a+"}}}, None),
        # the echoed prompt's text (vLLM: 400); with return_token_ids the ids come instead
        ({"prompt": IDS, "echo": True}, "echo"),
        ({"prompt": IDS, "echo": True, "stream": True}, "echo"),
    ],
)
def test_what_needs_the_tokenizer_is_refused_by_name(servers, request_kwargs, param):
    model, _, skip = servers
    with pytest.raises(openai.BadRequestError) as err:
        _client(skip).completions.create(model=model, max_tokens=4, **request_kwargs)
    assert "skip-tokenizer-init" in err.value.message
    if param is not None:
        assert err.value.body["param"] == param


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/tokenize", {"prompt": "hi"}),
        ("/detokenize", {"tokens": IDS}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 4}),
        ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_tokenizer_routes_are_refused_by_name(servers, path, body):
    import httpx

    model, _, skip = servers
    got = httpx.post(skip.url + path, json={"model": model, **body}, timeout=60)
    assert got.status_code == 400, got.text
    assert "skip-tokenizer-init" in got.json()["error"]["message"]


def test_chat_is_refused_by_name(servers):
    model, _, skip = servers
    with pytest.raises(openai.BadRequestError) as err:
        _client(skip).chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert "skip-tokenizer-init" in err.value.message


def test_llm_generate_takes_token_ids(tiny_model_factory):
    path = tiny_model_factory("qwen2")
    llm = LLM(
        path,
        max_model_len=256,
        kv_cache_memory="8MiB",
        distributed_executor_backend="uni",
        skip_tokenizer_init=True,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        out = llm.generate({"prompt_token_ids": IDS}, params, use_tqdm=False)[0]
        assert out.prompt_token_ids == IDS
        assert out.outputs[0].token_ids == hf_greedy(path, IDS, 10)
        assert out.outputs[0].text == ""
        # logprob entries as vLLM's without a tokenizer: decoded_token None
        lp_params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, prompt_logprobs=1)
        out = llm.generate({"prompt_token_ids": IDS}, lp_params, use_tqdm=False)[0]
        entries = [*out.outputs[0].logprobs, *out.prompt_logprobs[1:]]
        assert len(entries) == 3 + len(IDS) - 1
        assert all(lp.decoded_token is None for e in entries for lp in e.values())
        with pytest.raises(ValueError, match="skip-tokenizer-init"):
            llm.generate("Hello", params, use_tqdm=False)
    finally:
        llm.shutdown()
