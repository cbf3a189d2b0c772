"""The last pipeline stage's sampled tokens, shared with every rank (pipeline parallelism).

Only the last stage computes logits and samples; every other rank's batch must still append
the same tokens (stage 0 embeds them next step; every stage counts them to find the rows that
sample). The last stage's tensor-parallel rank 0 broadcasts one ``[n, 1 + d]`` int64 tensor:
row i holds request i's new tokens (``d``: the most drafts a request verified this step),
padded with -1; a request that sampled nothing (a partial prefill, a failed row) is all -1.
Every rank knows ``n`` and ``d`` from the step itself, so no shape travels.
"""

from __future__ import annotations

import torch

from trillm.distributed.pipeline import PipelineGroup
from trillm.sample.state import SamplingState
from trillm.worker.input_batch import InputBatch


def _width(drafts: dict[str, list[int]]) -> int:
    return 1 + max((len(d) for d in drafts.values()), default=0)


def broadcast_sampled(
    pp: PipelineGroup,
    sampled: list[list[int]],
    drafts: dict[str, list[int]],
    device: torch.device,  # NCCL sends device tensors only
) -> None:
    """On the last stage: send each request's new tokens to every rank."""
    if not sampled:
        return
    table = torch.full((len(sampled), _width(drafts)), -1, dtype=torch.int64)  # [n, 1 + d]
    for i, tokens in enumerate(sampled):
        table[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
    pp.broadcast_from_last(table.to(device))


def receive_sampled(
    pp: PipelineGroup,
    req_ids: list[str],
    drafts: dict[str, list[int]],
    batch: InputBatch,
    state: SamplingState,
    device: torch.device,
) -> list[list[int]]:
    """On the other stages: the last stage's tokens per request (batch order), appended to
    this rank's batch and sampling state as the last stage appended them."""
    if not req_ids:
        return []
    table = torch.empty((len(req_ids), _width(drafts)), dtype=torch.int64, device=device)
    rows = pp.broadcast_from_last(table).tolist()
    sampled = [[t for t in row if t >= 0] for row in rows]
    slots: list[int] = []
    tokens: list[int] = []
    for req_id, new in zip(req_ids, sampled):
        if new:
            slot = batch.slot_of(req_id)
            batch.append_tokens(slot, new)
            slots += [slot] * len(new)
            tokens += new
    state.append_tokens(slots, tokens)
    return sampled
