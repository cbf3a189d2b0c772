"""M-RoPE (Qwen2-VL, Qwen2.5-VL): three position rows per token (time, height, width).

Each head's D/2 rotary frequencies are cut into ``mrope_section`` (three counts summing to
D/2): the first section turns by the token's time position, the second by its height
position, the third by its width position (transformers' ``recomposition_frequencies``). Text
tokens carry one position thrice, which is plain RoPE. The cos|sin table is the plain one
(``RotaryEmbedding``'s); a step's [3, T] positions pick each token's row per frequency, making
a per-token table that the usual rotation kernel applies (token t reads row t).
"""

from __future__ import annotations

import torch

from trillm.kernels import rotary_torch
from trillm.kernels.dispatch import apply_rotary_
from trillm.model_executor.layers.rotary import RotaryEmbedding


class MRotaryEmbedding(RotaryEmbedding):
    def __init__(
        self,
        head_dim: int,
        rope_theta: float,
        mrope_section: list[int],
        max_positions: int,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(head_dim, rope_theta, None, max_positions, max_positions, device)
        if len(mrope_section) != 3 or sum(mrope_section) != head_dim // 2:
            raise ValueError(
                f"rope_parameters mrope_section {mrope_section} must be three counts summing "
                f"to half the head dimension ({head_dim // 2})."
            )
        counts = torch.tensor(mrope_section, device="cpu")  # not on the loader's meta device
        sections = torch.arange(3, device="cpu").repeat_interleave(counts)
        self.section_of = sections.to(device)  # [D/2]: which position row each frequency reads

    def forward(
        self,
        positions: torch.Tensor,  # [3, T] int64 (t, h, w), or [T]: text only
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
    ) -> None:
        if positions.dim() == 1:
            super().forward(positions, q, k)
            return
        half = self.cos_sin_cache.shape[1] // 2
        index = positions[self.section_of].T  # [T, D/2]: the row each frequency reads
        table = torch.cat(
            [
                self.cos_sin_cache[:, :half].gather(0, index),
                self.cos_sin_cache[:, half:].gather(0, index),
            ],
            dim=-1,
        )  # [T, D]: token t's cos | sin
        rows = torch.arange(positions.shape[1], device=positions.device)
        if self.reference:
            q_rot, k_rot = rotary_torch.apply_rotary(q, k, rows, table)
            q.copy_(q_rot)
            k.copy_(k_rot)
            return
        apply_rotary_(q, k, rows, table)
