"""SiLU-and-multiply, the gated MLP's activation, torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up: [..., 2I], gate then up -> ``silu(gate) * up`` [..., I] (into ``out`` if given).

    Two ops as written: in a low-precision dtype, silu's result is rounded before the multiply.
    """
    gate, up = gate_up.chunk(2, dim=-1)
    if out is None:
        return F.silu(gate) * up
    return torch.mul(F.silu(gate), up, out=out)
