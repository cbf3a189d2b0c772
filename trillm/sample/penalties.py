"""Repetition, frequency and presence penalties (OpenAI / HF semantics, vLLM's order)."""

from __future__ import annotations

import torch


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """Penalised logits.

    logits: float32 [n, V]; output_counts: int [n, V] (times each token was generated);
    prompt_mask: bool [n, V] or None (None: no row has a repetition penalty);
    repetition, frequency, presence: float32 [n].
    """
    present = output_counts > 0  # [n, V]
    if prompt_mask is not None:
        logits = _apply_repetition(logits, present | prompt_mask, repetition)
    counts = output_counts.to(logits.dtype)
    logits = logits - frequency.unsqueeze(1) * counts
    return logits - presence.unsqueeze(1) * present.to(logits.dtype)


def _apply_repetition(
    logits: torch.Tensor, seen: torch.Tensor, repetition: torch.Tensor
) -> torch.Tensor:
    """Seen tokens: positive logits divided by the penalty, negative ones multiplied by it."""
    rep = repetition.unsqueeze(1)  # [n, 1]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    return torch.where(seen, penalised, logits)
