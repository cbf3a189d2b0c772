"""Rotary position embedding (neox / HF ``rotate_half`` style), torch reference."""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos, sin: [T, R/2] fp32 with R = rotary_dim <= D (the tail passes through)
    half = cos.shape[-1]
    x32 = x.float()
    x1, x2 = x32[..., :half], x32[..., half : 2 * half]
    c, s = cos[:, None, :], sin[:, None, :]
    if x.dtype == torch.bfloat16:
        # HF's bf16 rotary: cos/sin cast to bf16, each product rounded, then the sum
        def r(t: torch.Tensor) -> torch.Tensor:
            return t.to(x.dtype).float()

        c, s = r(c), r(s)
        first, second = r(x1 * c) - r(x2 * s), r(x2 * c) + r(x1 * s)
    else:
        first, second = x1 * c - x2 * s, x2 * c + x1 * s
    rotated = torch.cat([first, second, x32[..., 2 * half :]], dim=-1)
    return rotated.to(x.dtype)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] by their positions [T]; new tensors (fp32 math).

    ``cos_sin_cache``: [max_pos, rotary_dim], cos in the first half of the last dim, sin in the
    second; dims ``rotary_dim .. D`` of each head are left unrotated.
    """
    cos, sin = cos_sin_cache.index_select(0, positions.long()).float().chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def build_cos_sin_cache(inv_freq: torch.Tensor, max_pos: int) -> torch.Tensor:
    """inv_freq: [R/2] -> cos_sin_cache [max_pos, R] fp32 (cos half, then sin half)."""
    t = torch.arange(max_pos, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(t, inv_freq.float())  # [max_pos, R/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)
