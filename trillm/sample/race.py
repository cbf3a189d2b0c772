"""Sampling by the exponential race, with per-request seeds that do not depend on the batch.

argmax(p_i / q_i) with q_i ~ Exp(1) i.i.d. picks token i with probability p_i, and needs no
host sync (unlike ``torch.multinomial``). A seeded request draws its q from a generator seeded by
(seed, number of output tokens so far) only, so it samples the same tokens whatever else is in
the batch, whichever slot it sits in, and after a preemption resumes the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_MASK64 = (1 << 64) - 1
# Smallest positive float32: a q of exactly 0 would turn p / q into inf or nan.
_TINY = torch.finfo(torch.float32).tiny


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def hash_mix(seed: int, step: int) -> int:
    """A 64-bit generator seed from a request seed and its output position."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64))


class SeededNoise:
    """Draws the exponential noise q [n, V]: one batched draw, then seeded rows overwritten."""

    def __init__(self) -> None:
        self._generators: dict[torch.device, torch.Generator] = {}

    def draw(
        self,
        probs: torch.Tensor,
        seeded_rows: Sequence[int],
        seeds: Sequence[int],
        steps: Sequence[int],
    ) -> torch.Tensor:
        q = torch.empty_like(probs).exponential_()  # [n, V] from the global generator
        if seeded_rows:
            gen = self._generator(probs.device)
            for row, seed, step in zip(seeded_rows, seeds, steps):
                gen.manual_seed(hash_mix(seed, step))
                q[row].exponential_(generator=gen)
        return q.clamp_min_(_TINY)

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            self._generators[device] = gen
        return gen


def exponential_race(probs: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """probs [n, V], q [n, V] ~ Exp(1) -> sampled token ids long [n]."""
    return (probs / q).argmax(dim=-1)
