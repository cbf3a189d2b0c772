"""Per-row min-p, top-k and top-p filters, vectorised over the batch (one sort per batch)."""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """In place: drop tokens whose probability is below min_p [n] times the row's top one."""
    probs = torch.softmax(logits, dim=-1)  # [n, V]
    top = probs.amax(dim=-1, keepdim=True)  # [n, 1]
    logits.masked_fill_(probs < min_p.unsqueeze(1) * top, _NEG_INF)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> None:
    """In place: keep each row's top_k [n] tokens (top_k >= V keeps all).

    ``max_top_k`` bounds the enabled k's (rows with k >= V excepted), so one ``topk`` call
    replaces a full sort. Tokens tied with the k-th logit are kept.
    """
    vocab = logits.shape[1]
    kmax = min(max_top_k, vocab)
    top_values = logits.topk(kmax, dim=-1).values  # [n, kmax], descending
    k_index = (top_k.clamp(1, kmax) - 1).unsqueeze(1)  # [n, 1]
    threshold = top_values.gather(1, k_index)  # [n, 1]
    threshold.masked_fill_((top_k >= vocab).unsqueeze(1), _NEG_INF)
    logits.masked_fill_(logits < threshold, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """Top-k then top-p, per row: top_k long [n] (>= V disables) or None, top_p float32 [n].

    Top-p keeps the smallest set of most likely tokens whose mass reaches p (after top-k);
    p = 1 keeps everything.
    """
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)  # [n, V] ascending
    if top_k is not None:
        positions = torch.arange(vocab, device=logits.device).unsqueeze(0)  # [1, V]
        first_kept = (vocab - top_k.clamp(1, vocab)).unsqueeze(1)  # [n, 1]
        sorted_logits.masked_fill_(positions < first_kept, _NEG_INF)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [n, V], ascending mass
    # Drop the least likely tokens while their total mass stays within 1 - p.
    drop = cumulative <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False  # NOTE: the most likely token always survives
    sorted_logits.masked_fill_(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
