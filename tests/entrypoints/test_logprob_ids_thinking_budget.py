"""vLLM's ``logprob_token_ids`` and ``thinking_token_budget`` through a real ``trillm serve``
and the official ``openai`` client (``extra_body``).

- ``logprob_token_ids``: at every sampled position the sampled token and the listed ids, with
  the logprobs transformers gives them (log_softmax of the same model's logits), in vLLM's
  shape on completions and chat, streamed and not; refused by name without ``logprobs``, over
  MAX_LOGPROB_TOKEN_IDS ids or outside the vocabulary.
- ``thinking_token_budget``: with the qwen3 reasoning parser and thinking on (the template
  opens ``<think>`` in the prompt), ``</think>`` is forced once the section holds the budget's
  tokens; what comes after is transformers' greedy continuation of the forced text.

The server is the shared tool server (tests/support/shared_servers.py): the default model with
<think> tokens, the qwen3 reasoning parser. Refusals without a reasoning parser:
test_thinking_budget_refusals.py.
"""

from __future__ import annotations

import openai
import pytest
import torch
from hf_reference import hf_greedy, load_hf_model
from shared_servers import TOOLS_GROUP, TOOLS_KEY, tools_server_args

from trillm.sampling_extras import MAX_LOGPROB_TOKEN_IDS

pytestmark = pytest.mark.xdist_group(TOOLS_GROUP)

IDS = [11, 220, 1000, 42]  # the ids to score (any ids of the vocabulary)
THINK = {"chat_template_kwargs": {"enable_thinking": True}}
ASK = [{"role": "user", "content": "What is two plus two?"}]


@pytest.fixture(scope="module")
def server_args(tmp_path_factory):
    return tools_server_args(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def client(shared_server, server_args):
    srv = shared_server(server_args)
    return openai.OpenAI(base_url=srv.base_url, api_key=TOOLS_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_dir(server_args) -> str:
    return server_args[0]


def hf_logprobs(model_dir: str, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' log_softmax at each output position: [len(output), V]."""
    model = load_hf_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)


def token_id(key: str) -> int:
    assert key.startswith("token_id:"), key
    return int(key.removeprefix("token_id:"))


def check_positions(positions: list[dict[int, float]], tokens: list[int], reference) -> float:
    """Each position lists the sampled token then IDS, with transformers' values; -> the
    largest |difference|."""
    worst = 0.0
    assert len(positions) == len(tokens) > 0
    for pos, (entry, sampled) in enumerate(zip(positions, tokens)):
        assert list(entry) == [sampled, *[t for t in IDS if t != sampled]], pos
        for tid, value in entry.items():
            worst = max(worst, abs(value - reference[pos, tid].item()))
    assert worst < 1e-4, worst
    return worst


# ---------------------------------------------------------------- logprob_token_ids


def test_completion_logprob_token_ids_equal_transformers(client, model_dir):
    extra = {"logprob_token_ids": IDS, "return_token_ids": True, "return_tokens_as_token_ids": True}
    r = client.completions.create(
        model=None, prompt="The sky is", max_tokens=6, temperature=0, logprobs=0, extra_body=extra
    )
    choice = r.choices[0]
    prompt, tokens = choice.prompt_token_ids, choice.token_ids
    lp = choice.logprobs
    positions = [{token_id(k): v for k, v in top.items()} for top in lp.top_logprobs]
    check_positions(positions, tokens, hf_logprobs(model_dir, prompt, tokens))
    assert [token_id(t) for t in lp.tokens] == tokens
    assert lp.token_logprobs == [p[t] for p, t in zip(positions, tokens)]
    # Streamed: the same positions, chunk by chunk.
    streamed: list[dict[int, float]] = []
    for chunk in client.completions.create(
        model=None,
        prompt="The sky is",
        max_tokens=6,
        temperature=0,
        logprobs=0,
        stream=True,
        extra_body=extra,
    ):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tops = chunk.choices[0].logprobs.top_logprobs
            streamed += [{token_id(k): v for k, v in top.items()} for top in tops]
    check_positions(streamed, tokens, hf_logprobs(model_dir, prompt, tokens))


def chat_positions(content) -> tuple[list[int], list[dict[int, float]]]:
    tokens = [token_id(c.token) for c in content]
    return tokens, [{token_id(t.token): t.logprob for t in c.top_logprobs} for c in content]


def test_chat_logprob_token_ids_equal_transformers_streamed_and_not(client, model_dir):
    # top_logprobs is overruled by the ids, as in vLLM
    kw = dict(model=None, messages=ASK, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    extra = {"logprob_token_ids": IDS, "return_token_ids": True, "return_tokens_as_token_ids": True}
    r = client.chat.completions.create(**kw, extra_body=extra)
    tokens, positions = chat_positions(r.choices[0].logprobs.content)
    assert tokens == r.choices[0].token_ids
    reference = hf_logprobs(model_dir, r.prompt_token_ids, tokens)
    worst = check_positions(positions, tokens, reference)
    print(f"max |logprob diff| vs transformers: {worst:.2e}")
    streamed: list = []
    for chunk in client.chat.completions.create(**kw, stream=True, extra_body=extra):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    # (the same values up to the prefix cache's reuse of the first request's prompt)
    streamed_tokens, streamed_positions = chat_positions(streamed)
    assert streamed_tokens == tokens
    check_positions(streamed_positions, tokens, reference)


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"logprob_token_ids": IDS}, "needs 'logprobs'"),
        ({"logprobs": True, "logprob_token_ids": [0] * (MAX_LOGPROB_TOKEN_IDS + 1)}, "limit"),
        ({"logprobs": True, "logprob_token_ids": [1, 10**9]}, "outside the vocabulary"),
    ],
)
def test_logprob_token_ids_refusals_name_the_field(client, extra, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=None, messages=ASK, max_tokens=1, extra_body=extra)
    error = info.value.body
    assert error["param"] == "logprob_token_ids" and words in error["message"], error


# ---------------------------------------------------------------- thinking_token_budget


def think_ids(model_dir: str) -> tuple[int, int]:
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(model_dir).get_vocab()
    return vocab["<think>"], vocab["</think>"]


def budgeted(client, budget: int | None, stream: bool = False):
    extra = {**THINK, "return_token_ids": True, "ignore_eos": True}
    if budget is not None:
        extra["thinking_token_budget"] = budget
    return client.chat.completions.create(
        model=None, messages=ASK, max_tokens=12, temperature=0, stream=stream, extra_body=extra
    )


@pytest.mark.parametrize("budget", [0, 4])
def test_thinking_budget_forces_the_end_of_reasoning(client, model_dir, budget):
    start, end = think_ids(model_dir)
    free = budgeted(client, None).choices[0]
    r = budgeted(client, budget)
    prompt, tokens = r.prompt_token_ids, r.choices[0].token_ids
    assert end not in free.token_ids  # the model does not end its reasoning by itself
    # Thinking tokens: the prompt's after its last <think> (none here), then the output's.
    in_prompt = prompt[::-1].index(start)
    at = max(budget - in_prompt, 0)
    assert tokens[:at] == free.token_ids[:at] and tokens[at] == end
    assert end not in tokens[at + 1 :]
    # The answer goes on unforced: transformers' greedy continuation of the forced text.
    forced = prompt + tokens[: at + 1]
    assert tokens[at + 1 :] == hf_greedy(model_dir, forced, len(tokens) - at - 1)
    message = r.choices[0].message
    assert message.content and message.content == decode(model_dir, tokens[at + 1 :])
    # Streamed: the same tokens.
    streamed = [
        t
        for c in budgeted(client, budget, stream=True)
        if c.choices
        for t in (c.choices[0].model_extra or {}).get("token_ids") or []
    ]
    assert streamed == tokens


def decode(model_dir: str, tokens: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).decode(tokens)


def test_thinking_budget_of_minus_one_is_no_budget_and_a_bool_is_refused(client):
    free = budgeted(client, None).choices[0].token_ids
    assert budgeted(client, -1).choices[0].token_ids == free
    for bad in (True, -2, 1.5):
        with pytest.raises(openai.BadRequestError) as info:
            budgeted(client, bad)
        assert info.value.body["param"] == "thinking_token_budget", info.value.body
