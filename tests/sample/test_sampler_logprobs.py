"""Logprobs of the batched sampler: of the raw logits (before any processor), with the sampled
token's rank and the top k, and the chunked top-k computation against the whole one."""

from __future__ import annotations

import torch
from logits import CPU, random_logits

from trillm.messages import LogprobsLists
from trillm.sample import logprobs as logprobs_module
from trillm.sample.logprobs import LogprobsTensors, compute_topk_logprobs
from trillm.sample.sampler import Sampler, SamplingState
from trillm.sampling_params import SamplingParams


def test_logprobs_are_of_the_raw_logits_with_ranks_and_top_k():
    vocab, n = 30, 6
    logits = random_logits(n, vocab, seed=8)
    state = SamplingState(n, vocab, CPU)
    for slot in range(n):
        params = SamplingParams(
            logprobs=3 if slot == 2 else 1,
            repetition_penalty=1.5,
            temperature=1.0 if slot % 2 else 0.0,
        )
        state.add_request(slot, params, list(range(10)), [])
    assert state.max_num_logprobs == 3
    out = Sampler()(logits, state, torch.arange(n), None)
    lp = out.logprobs
    assert lp is not None and lp.num_logprobs == 3
    raw = torch.log_softmax(logits, dim=-1)
    for row in range(n):
        token = out.sampled_token_ids[row].item()
        assert lp.token_ids[row, 0].item() == token
        torch.testing.assert_close(lp.logprobs[row, 0], raw[row, token])
        rank = 1 + sorted(raw[row].tolist(), reverse=True).index(raw[row, token].item())
        assert lp.ranks[row].item() == rank
        top_values, top_ids = raw[row].sort(descending=True)
        assert lp.token_ids[row, 1:].tolist() == top_ids[:3].tolist()
        torch.testing.assert_close(lp.logprobs[row, 1:], top_values[:3])
    lists = lp.select([2], num_logprobs=1).tolists()
    assert isinstance(lists, LogprobsLists)
    assert len(lists.token_ids) == 1 and len(lists.token_ids[0]) == 2
    assert isinstance(lists.logprobs[0][0], float) and isinstance(lists.ranks[0], int)


def test_compute_topk_logprobs_chunks_give_the_same_answer(monkeypatch):
    logits = random_logits(37, 50, seed=9)
    targets = torch.randint(0, 50, (37,), generator=torch.Generator().manual_seed(1))
    whole = compute_topk_logprobs(logits, targets, 4)
    monkeypatch.setattr(logprobs_module, "_MAX_CHUNK_ELEMENTS", 50 * 5)
    chunked = compute_topk_logprobs(logits, targets, 4)
    for a, b in zip(
        (whole.token_ids, whole.logprobs, whole.ranks),
        (chunked.token_ids, chunked.logprobs, chunked.ranks),
    ):
        assert torch.equal(a, b)
    only_target = compute_topk_logprobs(logits, targets, 0)
    assert only_target.token_ids.shape == (37, 1)
    assert isinstance(only_target, LogprobsTensors)
