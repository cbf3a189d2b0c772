"""Kernels, installed as ``trillm.kernels``: a torch reference and a Triton kernel per op.

Layout: one op per file per backend -- ``<op>_torch.py`` is the obviously-correct reference
(CPU or GPU), ``<op>_triton.py`` the Triton kernel with the same contract; tests compare them.

- ``rms_norm``: RMSNorm and the fused residual-add variant (HF Llama numerics, fp32 math).
- ``rotary``: neox / HF ``rotate_half`` rotary embedding from a [max_pos, rotary_dim] cos|sin
  cache.
- ``reshape_and_cache``: write a step's K/V rows into the paged cache at their slots.
- ``paged_attention``: causal attention of a flattened mixed batch (prefill chunks at any
  offset, decode rows) over the paged cache, GQA aware, with split-KV for small decode steps.
  ``paged_attention_cpu`` wraps the native CPU kernel (``ext/cpu_attention.cpp``) with the same
  contract.

The functions below are what model code calls: they run the Triton kernel for CUDA tensors
when triton is importable and the torch reference otherwise. Triton is optional: importing this
package never imports it; the Triton modules are imported on first CUDA use. (The attention
kernels are called through ``trillm.attention``'s backends, not from here.)
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from . import rms_norm_torch, rotary_torch
from .rotary_torch import build_cos_sin_cache

__all__ = [
    "apply_rotary",
    "build_cos_sin_cache",
    "fused_add_rms_norm",
    "rms_norm",
    "triton_available",
]


@functools.cache
def triton_available() -> bool:
    """Whether the ``triton`` package can be imported here (it is optional on CPU)."""
    return importlib.util.find_spec("triton") is not None


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and triton_available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H], weight: [H] -> [..., H] in x's dtype (normalised in fp32, like HF Llama)."""
    if _use_triton(x):
        from . import rms_norm_triton

        return rms_norm_triton.rms_norm(x, weight, eps)
    return rms_norm_torch.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., H] -> (rms_norm(x + residual) [..., H], x + residual [..., H]).

    Out of place: neither input is modified."""
    if _use_triton(x):
        from . import rms_norm_triton

        return rms_norm_triton.fused_add_rms_norm(x, residual, weight, eps)
    return rms_norm_torch.fused_add_rms_norm(x, residual, weight, eps)


def apply_rotary(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int
    cos_sin_cache: torch.Tensor,  # [max_pos, rotary_dim], cos half then sin half
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox / HF ``rotate_half`` rotary embedding; returns rotated copies of q and k (fp32 math,
    cast back to their dtype). Dims ``rotary_dim .. D`` pass through unrotated."""
    if _use_triton(q):
        from . import rotary_triton

        return rotary_triton.apply_rotary(q, k, positions, cos_sin_cache)
    return rotary_torch.apply_rotary(q, k, positions, cos_sin_cache)
