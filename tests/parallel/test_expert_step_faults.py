"""The forward-end agreement of -dp N -ep (trillm/distributed/expert_step_faults.py) on one
rank, the other ranks' numbers given: which of this core's tokens went to experts that
failed (only the layers they failed in), which requests they are, and the step's output
without them; a failing tensor-parallel peer fails the whole step. The end-to-end cases are
in test_expert_parallel_dp_faults.py."""

from __future__ import annotations

import numpy as np
import torch

from trillm.distributed import expert_step_faults as esf
from trillm.messages import ModelRunnerOutput


class Group:
    """A rank of ``world_size`` whose all-reduce adds the others' rows given."""

    def __init__(self, rank: int, world_size: int, others: torch.Tensor | None = None) -> None:
        self.rank, self.world_size, self.others = rank, world_size, others

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t.add_(self.others)


def agree(monkeypatch, others: list[list[int]], tp_size: int = 1) -> esf.StepVerdict:
    ep = Group(0, len(others), torch.tensor(others, dtype=torch.int32))
    monkeypatch.setattr(esf, "get_ep_group", lambda: ep)
    monkeypatch.setattr(esf, "get_tp_group", lambda: Group(0, tp_size))
    return esf.agree_step(False, "cpu")


def routed_forward() -> None:
    """Three tokens of this core over two MoE layers, two experts per rank."""
    esf.start_forward()
    esf.faults.note_routed(torch.tensor([[0, 1], [2, 3], [1, 3]]), 2)  # rank 1: tokens 1, 2
    esf.faults.layer += 1
    esf.faults.note_routed(torch.tensor([[2, 1], [0, 0], [0, 1]]), 2)  # rank 1: token 0
    esf.faults.layer += 1


def test_only_the_tokens_routed_to_the_failed_experts_in_their_layer(monkeypatch):
    routed_forward()
    verdict = agree(monkeypatch, [[0, 0, 0], [esf.FAILED, 1, 1]])  # rank 1: layer 1 only
    assert verdict.reason is None
    assert verdict.tokens is not None and verdict.tokens.tolist() == [False, True, True]
    assert "Expert-parallel rank 1 (engine core 1, rank 0) failed in MoE layer 1" in verdict.why
    routed_forward()
    verdict = agree(monkeypatch, [[0, 0, 0], [esf.FAILED, 2, 2]])  # layer 2 only
    assert verdict.tokens is not None and verdict.tokens.tolist() == [True, False, False]
    routed_forward()
    assert agree(monkeypatch, [[0, 0, 0], [esf.FAILED, 0, 0]]) == esf.StepVerdict()


def test_a_failing_peer_of_this_core_fails_the_whole_step(monkeypatch):
    routed_forward()
    verdict = agree(monkeypatch, [[0, 0, 0], [esf.FAILED, 0, 0]], tp_size=2)
    assert verdict.reason is not None and "a tensor-parallel rank of this engine core" in (
        verdict.reason
    )


def test_the_tokens_requests_fail_alone():
    verdict = esf.StepVerdict(tokens=torch.tensor([False, True, True]), why="lost")
    lost = esf.requests_of(verdict, ["x", "y"], np.array([0, 1, 3]))
    assert lost == {"y": "lost"}
    assert esf.requests_of(verdict, ["x", "y", "z"], np.array([0, 1, 2, 3])) == {
        "y": "lost",
        "z": "lost",
    }
    # Cannot tell (another count of tokens, or of requests): the step fails.
    assert esf.requests_of(verdict, ["x", "y"], np.array([0, 1, 2])) is None
    assert esf.requests_of(verdict, ["x"], np.array([0, 1, 3])) is None
    assert esf.requests_of(esf.StepVerdict(why="none"), ["x"], np.array([0, 3])) is None
    out = ModelRunnerOutput(7, ["x", "y"], [[5], [6]], logprobs={"y": None})  # type: ignore[dict-item]
    out = esf.without_requests(out, lost)
    assert out.sampled_token_ids == [[5], []]
    assert out.failed == {"y": "lost"} and "y" not in out.logprobs
