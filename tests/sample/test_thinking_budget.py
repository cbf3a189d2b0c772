"""The worker side of ``thinking_token_budget`` and ``logprob_token_ids`` in the sampler:
where a reasoning section starts (prompt or output), what counts against the budget, the
forced end tag (one token or several) overriding every other processor, a new section's fresh
budget, a preempted request's state rebuilt from its tokens; and the chosen ids' logprobs
written from the same log_softmax as the top-k, beside rows that asked for the top-k."""

from __future__ import annotations

import pytest
import torch
from logits import CPU, random_logits

from trillm.sample.sampler import Sampler, SamplingState
from trillm.sample.thinking_budget import ThinkingBudget
from trillm.sampling_params import SamplingParams

START, END = [7], [8, 9]  # a one-token start tag, a two-token end tag
VOCAB = 32


def forced_run(budget: ThinkingBudget, tokens: list[int]) -> list[int | None]:
    """The forced token before each of ``tokens`` (a forced one replaces the given one)."""
    seen = []
    for token in tokens:
        forced = budget.forced()
        seen.append(forced)
        budget.append(token if forced is None else forced)
    return seen


def test_a_section_opened_in_the_prompt_counts_its_prompt_tokens():
    budget = ThinkingBudget(3, START, END, prompt_ids=[1, 7, 2])  # one token after <think>
    assert forced_run(budget, [3, 4, 5, 6, 1]) == [None, None, 8, 9, None]
    assert not budget.thinking


def test_no_section_no_forcing_until_the_output_opens_one_with_a_fresh_budget():
    budget = ThinkingBudget(1, START, END, prompt_ids=[1, 7, 8, 9, 2])  # closed in the prompt
    # 7 opens: one token, then 8 9 forced; a second 7 opens a new section with the same budget
    seen = forced_run(budget, [3, 7, 4, 5, 5, 7, 6, 5, 5])
    assert seen == [None, None, None, 8, 9, None, None, 8, 9]


def test_a_natural_end_closes_the_section_without_forcing():
    budget = ThinkingBudget(5, START, END, prompt_ids=[7])
    assert forced_run(budget, [3, 8, 9, 4, 4, 4, 4, 4, 4]) == [None] * 9
    assert not budget.thinking


@pytest.mark.parametrize("budget", [0, 2])
def test_the_sampler_forces_the_end_over_other_processors(budget):
    # The end tag is banned by allowed_token_ids and biased down: forcing still wins.
    params = SamplingParams(
        temperature=0.8,
        seed=1,
        thinking_token_budget=budget,
        allowed_token_ids=[1, 2, 3],
        logit_bias={8: -100.0},
    )
    params.thinking_tag_ids = [START, END]
    state = SamplingState(2, VOCAB, CPU)
    state.add_request(0, params, prompt_token_ids=[5, 7], output_token_ids=[])
    state.add_request(1, SamplingParams(temperature=0.0), prompt_token_ids=[7], output_token_ids=[])
    sampler, slots = Sampler(), torch.tensor([0, 1])
    out: list[int] = []
    for step in range(budget + 4):
        tokens = sampler(random_logits(2, VOCAB, seed=step), state, slots).sampled_token_ids
        state.append_tokens([0, 1], tokens.tolist())
        out.append(int(tokens[0]))
        assert int(tokens[1]) == int(random_logits(2, VOCAB, seed=step)[1].argmax())  # untouched
    assert all(t in (1, 2, 3) for t in out[:budget])
    assert out[budget : budget + 2] == END
    assert all(t in (1, 2, 3) for t in out[budget + 2 :])


def test_a_preempted_request_resumes_its_count_from_its_tokens():
    params = SamplingParams(temperature=0.0, thinking_token_budget=3)
    params.thinking_tag_ids = [START, END]
    state = SamplingState(1, VOCAB, CPU)
    state.add_request(0, params, prompt_token_ids=[7], output_token_ids=[1, 2])
    logits = random_logits(1, VOCAB, seed=3)
    logits[0, 8] = -50.0  # the model would not end by itself
    picks = []
    for _ in range(3):
        token = int(Sampler()(logits, state, torch.tensor([0])).sampled_token_ids[0])
        state.append_token(0, token)
        picks.append(token)
    assert picks == [int(logits[0].argmax()), 8, 9]


def test_logprob_token_ids_are_the_log_softmax_of_the_same_logits():
    chosen = SamplingParams(temperature=0.0, logprob_token_ids=[4, 0, 31])
    top = SamplingParams(temperature=0.0, logprobs=5)
    state = SamplingState(2, VOCAB, CPU)
    state.add_request(0, chosen, prompt_token_ids=[1], output_token_ids=[])
    state.add_request(1, top, prompt_token_ids=[1], output_token_ids=[])
    logits = random_logits(2, VOCAB, seed=9)
    out = Sampler()(logits, state, torch.tensor([0, 1]))
    reference = torch.log_softmax(logits, dim=-1)
    lp = out.logprobs
    assert lp is not None and lp.token_ids.shape == (2, 6)  # k = the largest of 3 and 5
    sampled = int(out.sampled_token_ids[0])
    assert lp.token_ids[0, :4].tolist() == [sampled, 4, 0, 31]
    assert torch.equal(lp.logprobs[0, :4], reference[0, [sampled, 4, 0, 31]])
    top5 = reference[1].topk(5)
    assert lp.token_ids[1, 1:].tolist() == top5.indices.tolist()  # the other row's top-k
    assert torch.equal(lp.logprobs[1, 1:], top5.values)
