"""The embedding and LM head split over tensor-parallel ranks by vocabulary rows.

Rank r holds rows ``[r * P, r * P + P)`` of the (zero-padded) ``[N * P, H]`` table, P =
ceil(V / N) (``RankShapes``). The embedding looks up the ids it holds, zeros the others and
all-reduces; the head computes its P logits and all-gathers them, so every rank has the whole
``[n, V]`` row (every rank samples the same token from it: see ``ModelRunner``).
With one rank both are plain ``nn.Embedding`` / ``nn.Linear`` lookups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trillm.config import ModelConfig
from trillm.distributed.parallel_state import TensorParallelGroup, get_tp_group
from trillm.distributed.sharding import RankShapes


class VocabParallelEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig, hidden_size: int) -> None:
        super().__init__()
        tp = get_tp_group()
        shapes = RankShapes.of(cfg, tp.rank, tp.world_size, tp.expert_parallel)
        self.weight = nn.Parameter(torch.empty(shapes.vocab_per_rank, hidden_size))  # [P, H]
        self.start, self.end = shapes.vocab_start, shapes.vocab_end
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.start) & (ids < self.end)  # [T]
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        out = F.embedding(local, self.weight)  # [T, H]
        out.masked_fill_(~mine.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


def gather_logits(
    local: torch.Tensor, vocab_size: int, tp: TensorParallelGroup
) -> torch.Tensor:  # [n, P] -> [n, V]
    if tp.world_size == 1:
        return local
    return tp.all_gather_last_dim(local)[:, :vocab_size]
