"""vLLM's ``prompt_logprobs_temperature`` through a real ``trillm serve`` and the official
``openai`` client (``extra_body``): the prompt logprobs are the log_softmax of the prompt
rows' logits divided by it, as transformers computes them from the same model; absent (or 1)
they are those of the logits as they are. vLLM's own test of the field
(test_prompt_logprobs_temperature_increases_argmax_prob_completion) checks that a lower
temperature raises the greedy token's probability; so does this file, then the refusals of a
value that is not a positive number, by name.

The server is the shared tool server (tests/support/shared_servers.py).
"""

from __future__ import annotations

import math

import openai
import pytest
import torch
from hf_reference import load_hf_model
from shared_servers import TOOLS_GROUP, TOOLS_KEY, tools_server_args

from trillm.sampling_params import SamplingParams, SamplingParamsError
from trillm.worker.step_sampling import scale_logits

pytestmark = pytest.mark.xdist_group(TOOLS_GROUP)

PROMPT = "The quick brown fox jumps over the lazy dog and"
K = 3  # prompt_logprobs: the top 3 at each position, besides the prompt's own token


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


def hf_prompt_logprobs(model_dir: str, prompt: list[int], temperature: float) -> torch.Tensor:
    """transformers' log_softmax of the logits / temperature at each prompt row: [P - 1, V]
    (row p scores prompt token p + 1)."""
    model = load_hf_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits[:-1] / temperature, dim=-1)


def completion(client, temperature: float | None, prompt=PROMPT, k: int = K):
    extra: dict = {"prompt_logprobs": k, "return_token_ids": True}
    if temperature is not None:
        extra["prompt_logprobs_temperature"] = temperature
    return client.completions.create(
        model=None, prompt=prompt, max_tokens=1, temperature=0, extra_body=extra
    )


def positions(prompt_logprobs) -> list[dict[int, float]]:
    """vLLM's shape (``[null, {token_id: {logprob, rank, decoded_token}}, ...]``) as
    ``{token_id: logprob}`` per scored position."""
    assert prompt_logprobs[0] is None
    return [{int(t): v["logprob"] for t, v in entry.items()} for entry in prompt_logprobs[1:]]


def check_against(rows: list[dict[int, float]], prompt: list[int], reference) -> float:
    """Each position holds the prompt's token and the reference's top K, with its values;
    -> the largest |difference|."""
    assert len(rows) == len(prompt) - 1 > 0
    worst = 0.0
    for p, entry in enumerate(rows):
        top = reference[p].topk(K).indices.tolist()
        assert set(entry) == {prompt[p + 1], *top}, (p, entry, top)
        for tid, value in entry.items():
            worst = max(worst, abs(value - reference[p, tid].item()))
    return worst


@pytest.mark.parametrize("temperature", [0.1, 0.5, 2.0, 5.0])
def test_prompt_logprobs_equal_transformers_at_the_temperature(client, model_dir, temperature):
    choice = completion(client, temperature).choices[0]
    prompt = choice.prompt_token_ids
    rows = positions(choice.prompt_logprobs)
    worst = check_against(rows, prompt, hf_prompt_logprobs(model_dir, prompt, temperature))
    # (a temperature of 0.1 makes the logprobs, and float32's rounding in them, 10x larger)
    assert worst < 1e-4 / min(temperature, 1.0), worst
    unscaled = positions(completion(client, None).choices[0].prompt_logprobs)
    assert rows != unscaled  # the field has an effect at every temperature here


def test_absent_or_one_is_the_logits_as_they_are(client, model_dir):
    choice = completion(client, None).choices[0]
    prompt = choice.prompt_token_ids
    rows = positions(choice.prompt_logprobs)
    assert check_against(rows, prompt, hf_prompt_logprobs(model_dir, prompt, 1.0)) < 1e-4
    assert positions(completion(client, 1.0).choices[0].prompt_logprobs) == rows


def test_a_lower_temperature_raises_the_greedy_tokens_probability(client):
    """vLLM's test, on token ids: the greedy token appended to the prompt is scored more
    likely at 0.1 than at 1 than at 5 (prompt_logprobs 0: the prompt's token only)."""
    seed = [11, 12, 13, 14, 15]
    greedy = client.completions.create(
        model=None, prompt=seed, max_tokens=1, temperature=0, extra_body={"return_token_ids": True}
    )
    prompt = seed + greedy.choices[0].token_ids

    def last_prob(temperature: float) -> float:
        entry = completion(client, temperature, prompt, k=0).choices[0].prompt_logprobs[-1]
        assert list(entry) == [str(prompt[-1])]
        return math.exp(entry[str(prompt[-1])]["logprob"])

    low, default, high = last_prob(0.1), last_prob(1.0), last_prob(5.0)
    assert low > default > high, (low, default, high)


def test_chat_prompt_logprobs_follow_the_temperature(client, model_dir):
    r = client.chat.completions.create(
        model=None,
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=1,
        temperature=0,
        extra_body={
            "prompt_logprobs": K,
            "prompt_logprobs_temperature": 0.5,
            "return_token_ids": True,
        },
    )
    prompt = r.prompt_token_ids
    rows = positions(r.prompt_logprobs)
    assert check_against(rows, prompt, hf_prompt_logprobs(model_dir, prompt, 0.5)) < 2e-4


@pytest.mark.parametrize("value", [0, -1.5, "hot", True])
def test_a_value_that_is_not_a_positive_number_is_refused_by_name(client, value):
    with pytest.raises(openai.BadRequestError) as info:
        completion(client, value)
    error = info.value.body
    assert error["param"] == "prompt_logprobs_temperature", error


def test_a_tiny_temperature_gives_finite_logprobs():
    """Dividing by 1e-38 overflows float32; the rows are shifted by their largest value
    first and held within float32, so the largest logit gets 0 and the rest stay finite."""
    logits = torch.tensor([[2.0, 1.0, -3.0, float("-inf")], [0.5, 0.5, 0.0, 1.0]])
    scale_logits(logits, 1e-38)
    logprobs = torch.log_softmax(logits, dim=-1)
    assert torch.isfinite(logprobs).all(), logprobs
    assert logprobs[0, 0] == 0.0 and logprobs[1, 3] == 0.0
    assert (logprobs[0, 1:] < -1e30).all()
    # The two tied largest values share the mass (log 1/2 each) at any temperature.
    pair = torch.tensor([[3.0, 3.0, 1.0]])
    scale_logits(pair, 1e-38)
    assert torch.allclose(torch.log_softmax(pair, -1)[0, :2], torch.tensor([math.log(0.5)] * 2))


def test_sampling_params_keep_a_positive_finite_prompt_logprobs_temperature():
    """SamplingParams (also the offline LLM's): 1 is no scaling (None), a positive finite
    number is kept as a float, the rest (NaN and the infinities too, which JSON cannot carry)
    raise naming the field."""
    assert SamplingParams(prompt_logprobs_temperature=1.0).prompt_logprobs_temperature is None
    assert SamplingParams(prompt_logprobs_temperature=2).prompt_logprobs_temperature == 2.0
    assert SamplingParams().prompt_logprobs_temperature is None
    for bad in (0.0, -0.5, math.nan, math.inf, -math.inf, 1e39, True, "2"):
        with pytest.raises(SamplingParamsError) as info:
            SamplingParams(prompt_logprobs_temperature=bad)
        assert info.value.param == "prompt_logprobs_temperature", bad
