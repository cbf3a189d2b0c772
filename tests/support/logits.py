"""Random logits for the sampler tests (seeded, so every run draws the same)."""

from __future__ import annotations

import torch

CPU = torch.device("cpu")


def random_logits(n: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=gen) * scale
