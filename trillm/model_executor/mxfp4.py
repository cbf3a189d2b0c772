"""MXFP4 expert weights (gpt-oss checkpoints, ``quantization_config.quant_method == "mxfp4"``)
dequantized at load.

The checkpoint stores each expert tensor as two entries: ``<name>_blocks`` [E, rows, G, 16]
uint8, two e2m1 (fp4) values a byte, low nibble first, 32 values per group; and
``<name>_scales`` [E, rows, G] uint8, each group's power of two as an e8m0 exponent (bias
127). ``rows`` are the output features, ``G * 32`` the input ones, so the dequantized tensor
is transposed to transformers' ``[E, in, out]`` layout (``gate_up_proj`` [E, H, 2I],
``down_proj`` [E, I, H]), as transformers' own dequantization does.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

BLOCKS, SCALES = "_blocks", "_scales"
GROUP = 32  # fp4 values sharing one scale
BITS_PER_WEIGHT = 4.25  # 4 bits a value plus an 8-bit scale per group of 32
# e2m1: sign, 2 exponent bits, 1 mantissa bit; index = the nibble.
_FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
_SCALE_BIAS = 127


def dequantize(
    blocks: torch.Tensor,  # [E, rows, G, 16] uint8
    scales: torch.Tensor,  # [E, rows, G] uint8
    dtype: torch.dtype,
) -> torch.Tensor:  # [E, G * 32, rows]
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError("MXFP4 blocks and scales must be uint8 tensors.")
    if blocks.dim() != 4 or blocks.shape[-1] != GROUP // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
            f"([E, rows, G, {GROUP // 2}] and [E, rows, G])."
        )
    lut = torch.tensor(_FP4_VALUES, dtype=torch.float32)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)
    exponents = scales.to(torch.int32) - _SCALE_BIAS  # [E, rows, G]
    values = torch.ldexp(values.flatten(-2), exponents[..., None])  # [E, rows, G, 32], exact
    num_experts, rows = blocks.shape[:2]
    return values.reshape(num_experts, rows, -1).transpose(1, 2).to(dtype).contiguous()


def warn_dequantized(num_weights: int, dtype: torch.dtype) -> None:
    """Say what dequantizing costs: the experts' bytes in ``dtype`` against 4.25 bits each."""
    stored = num_weights * BITS_PER_WEIGHT / 8
    loaded = num_weights * torch.empty((), dtype=dtype).element_size()
    logger.warning(
        "MXFP4 expert weights are dequantized to %s at load (no 4-bit kernel yet): %s in memory "
        "instead of %s (%.1fx).",
        str(dtype).removeprefix("torch."),
        _size(loaded),
        _size(stored),
        loaded / stored,
    )


def _size(num_bytes: float) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if num_bytes >= 1 << shift:
            return f"{num_bytes / (1 << shift):.2f} {unit}"
    return f"{num_bytes / 1024:.1f} KiB"
