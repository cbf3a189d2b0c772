"""Weights and the reference for the int8-activation quantized GEMM's tests (tests/native)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from trillm.kernels import linear_q_cpu
from trillm.testing.gguf_models import random_kquant_blocks


def quantized_weight(type_name: str, n: int, k: int, seed: int) -> linear_q_cpu.QuantizedWeight:
    """A random [n, k] weight: Q4_0 / Q4_1 / Q8_0 quantized from normal values (Q4_1 with a
    nonzero minimum), Q4_K random blocks, Q4_G AWQ-style groups of 32 (odd seeds) or of k."""
    rng = np.random.default_rng(seed)
    if type_name == "Q4_G":
        groups = k // 32 if seed % 2 else 1
        q = rng.integers(0, 16, (n, k)).astype(np.uint8)
        s = (rng.random((n, groups)) * 0.1 + 0.01).astype(np.float16)
        z = rng.integers(0, 16, (n, groups)).astype(np.uint8)
        return linear_q_cpu.QuantizedWeight.from_groups(q, s, z)
    if type_name == "Q4_K":
        raw = random_kquant_blocks("Q4_K", n, k, seed)
        return linear_q_cpu.QuantizedWeight(raw, linear_q_cpu.Q4_K, n, k)
    qtype = GGMLQuantizationType[type_name]
    w = rng.standard_normal((n, k)).astype(np.float32)
    if qtype == GGMLQuantizationType.Q4_1:
        w += rng.uniform(-1, 1, (n, 1)).astype(np.float32)
    return linear_q_cpu.QuantizedWeight(quants.quantize(w, qtype), int(qtype), n, k)


def int8_reference(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The rounded activations (``quantize_activations``) times the dequantized weight, in fp64."""
    xq = linear_q_cpu.quantize_activations(x.float()).double()
    b = None if bias is None else bias.double()
    return F.linear(xq, linear_q_cpu.dequantize(weight).double(), b).float()
