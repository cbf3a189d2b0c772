"""Greedy rows' argmax (trillm.sample.sampler.row_argmax): CPU float32 logits go through numpy's
argmax, which must pick what torch's argmax picks, row for row: the first of tied maxima, a NaN
as the maximum (its first), +inf, an all -inf row, and strided rows."""

from __future__ import annotations

import pytest
import torch

from trillm.sample.sampler import Sampler, SamplingState, row_argmax
from trillm.sampling_params import SamplingParams

NAN, INF = float("nan"), float("inf")


def _edge_rows(vocab: int) -> torch.Tensor:
    x = torch.randn(8, vocab, generator=torch.Generator().manual_seed(0))
    x[0, [5, 7, vocab - 1]] = 100.0  # ties: the first
    x[1, [9, 3]] = NAN  # NaN beats every number: the first NaN
    x[2] = -INF
    x[3, [11, 12]] = INF
    x[4] = 0.0  # every entry tied
    x[5, vocab - 1] = 50.0  # the last column
    x[6, 0] = 50.0  # the first column
    x[7, [2, 4]] = torch.tensor([NAN, INF])
    return x


@pytest.mark.parametrize("vocab", [13, 49152])
def test_row_argmax_matches_torch_argmax(vocab):
    x = _edge_rows(vocab)
    got = row_argmax(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, x.argmax(dim=-1))
    assert got[:4].tolist() == [5, 3, 0, 11]
    strided = x.t().contiguous().t()  # the same values, column-major
    assert torch.equal(row_argmax(strided), x.argmax(dim=-1))
    assert torch.equal(row_argmax(x[:0]), x[:0].argmax(dim=-1))
    one = torch.tensor([[NAN], [-INF], [2.0]])  # a one-token vocabulary
    assert row_argmax(one).tolist() == [0, 0, 0]


def test_other_dtypes_keep_torchs_argmax():
    x = _edge_rows(33).to(torch.bfloat16)
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))


def test_greedy_sampler_takes_the_first_of_tied_maxima():
    vocab = 64
    state = SamplingState(2, vocab, torch.device("cpu"))
    for slot in (0, 1):
        state.add_request(
            slot, SamplingParams(temperature=0.0), prompt_token_ids=[], output_token_ids=[]
        )
    logits = torch.zeros(2, vocab)
    logits[0, [40, 7, 63]] = 3.0
    logits[1, 20] = NAN
    out = Sampler()(logits, state, torch.tensor([0, 1]), None)
    assert out.sampled_token_ids.tolist() == [7, 20]
