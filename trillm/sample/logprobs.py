"""Logprobs of sampled (or actual prompt) tokens plus the top-k alternatives, as tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trillm.messages import LogprobsLists

# Rows of log_softmax computed at once: bounds the [rows, V] float32 temporaries (~256 MB).
_MAX_CHUNK_ELEMENTS = 1 << 26


@dataclass(slots=True)
class LogprobsTensors:
    token_ids: torch.Tensor  # long [m, 1 + k]: column 0 = the target token, then top-1..top-k
    logprobs: torch.Tensor  # float32 [m, 1 + k]
    ranks: torch.Tensor  # long [m]: rank of the target token, 1 = the most likely

    @property
    def num_logprobs(self) -> int:
        return self.token_ids.shape[1] - 1

    def select(self, rows: slice | list[int] | torch.Tensor, num_logprobs: int | None = None):
        """The given rows, keeping the target plus the first ``num_logprobs`` alternatives."""
        cols = slice(None) if num_logprobs is None else slice(0, 1 + num_logprobs)
        return LogprobsTensors(
            token_ids=self.token_ids[rows][:, cols],
            logprobs=self.logprobs[rows][:, cols],
            ranks=self.ranks[rows],
        )

    def cpu(self) -> LogprobsTensors:
        return LogprobsTensors(self.token_ids.cpu(), self.logprobs.cpu(), self.ranks.cpu())

    def tolists(self) -> LogprobsLists:
        return LogprobsLists(
            token_ids=self.token_ids.tolist(),
            logprobs=self.logprobs.tolist(),
            ranks=self.ranks.tolist(),
        )


def compute_topk_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, k: int
) -> LogprobsTensors:
    """log_softmax of logits [m, V] (float32), the target's logprob and rank, and the top k."""
    m, vocab = logits.shape
    chunk = max(1, _MAX_CHUNK_ELEMENTS // max(vocab, 1))
    parts = [
        _topk_logprobs_chunk(logits[i : i + chunk], target_ids[i : i + chunk], k)
        for i in range(0, m, chunk)
    ]
    if len(parts) == 1:
        return parts[0]
    return LogprobsTensors(
        token_ids=torch.cat([p.token_ids for p in parts]),
        logprobs=torch.cat([p.logprobs for p in parts]),
        ranks=torch.cat([p.ranks for p in parts]),
    )


def _topk_logprobs_chunk(logits: torch.Tensor, target_ids: torch.Tensor, k: int):
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [m, V]
    target_ids = target_ids.to(device=logits.device, dtype=torch.long).unsqueeze(1)  # [m, 1]
    target_lp = logprobs.gather(1, target_ids)  # [m, 1]
    # Rank = 1 + tokens strictly more likely than the target (ties share the better rank).
    ranks = (logprobs > target_lp).sum(dim=-1) + 1  # [m]
    if k == 0:
        return LogprobsTensors(target_ids, target_lp, ranks)
    top_lp, top_ids = logprobs.topk(k, dim=-1)  # [m, k] each
    return LogprobsTensors(
        token_ids=torch.cat([target_ids, top_ids], dim=1),
        logprobs=torch.cat([target_lp, top_lp], dim=1),
        ranks=ranks,
    )


def write_chosen_logprobs(
    tensors: LogprobsTensors, logits: torch.Tensor, chosen: dict[int, list[int]]
) -> None:
    """``logprob_token_ids``: columns 1..n of each row in ``chosen`` (row -> its n ids, n no
    more than the tensors' k) become those ids and their logprobs, from the same log_softmax
    of the same logits as the top-k they replace."""
    rows = torch.tensor(list(chosen), dtype=torch.long, device=logits.device)
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)  # [r, V]
    for i, (row, ids) in enumerate(chosen.items()):
        ids_t = torch.tensor(ids, dtype=torch.long, device=logits.device)  # [n]
        tensors.token_ids[row, 1 : 1 + len(ids)] = ids_t
        tensors.logprobs[row, 1 : 1 + len(ids)] = logprobs[i, ids_t]
