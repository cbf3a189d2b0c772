"""What model code calls from the kernels: per op, dispatch to the Triton kernel, the native
CPU kernel or the torch reference.

The repository's ``kernels/`` folder is installed as ``trillm.kernels`` (setup.py's
``package_dir``). It has no ``__init__.py`` on purpose: a folder named ``kernels`` in the
checkout's root, which is on sys.path when Python starts there, is then only a namespace
portion, so it can never shadow the PyPI package ``kernels`` (which transformers probes for);
import its modules by their full names, ``trillm.kernels.<module>``.

Layout: one op per file per backend -- ``<op>_torch.py`` is the obviously-correct reference
(CPU or GPU), ``<op>_triton.py`` the Triton kernel and ``<op>_cpu.py`` the wrapper of a native
CPU kernel (``ext/cpu_attention.cpp``, ``ext/cpu_ops.cpp``), with the same contract; tests
compare them.

- ``rms_norm``: RMSNorm and the fused residual-add variant (HF Llama numerics, fp32 math).
- ``rotary``: neox / HF ``rotate_half`` rotary embedding from a [max_pos, rotary_dim] cos|sin
  cache.
- ``activation``: ``silu(gate) * up`` of the gated MLP (CPU kernel and torch reference only).
- ``linear_cpu``: fp32 GEMM with weights packed once, for the CPU linear layers (its reference
  is ``torch.nn.functional.linear``; ``trillm/model_executor/layers/linear.py`` routes them).
- ``reshape_and_cache``: write a step's K/V rows into the paged cache at their slots
  (``reshape_and_cache_cpu`` wraps the native CPU kernel of ``ext/cpu_ops.cpp``).
- ``lora``: batched LoRA, Punica-style shrink / expand with a per-token adapter slot
  (``add_lora_``; ``lora_cpu`` wraps the native kernel of ``ext/cpu_lora.cpp``).
- ``paged_attention``: causal attention of a flattened mixed batch (prefill chunks at any
  offset, decode rows) over the paged cache, GQA aware, with split-KV for small decode steps.
  ``paged_attention_cpu`` wraps the native CPU kernel (``ext/cpu_attention.cpp``) with the same
  contract.

Every native call goes through ``recording.call`` (``recording.attention`` for a paged-attention
plan), so that a step program (``trillm/worker/step_program.py``) can record a forward's kernel
calls and replay them.

The functions of this module are what model code calls: they run the Triton kernel for CUDA
tensors when triton is importable, the native kernel for CPU tensors when it is built (and
``TRILLM_NO_EXTENSIONS`` is unset) and handles them, and the torch reference otherwise -- also
when autograd would record the op (the native kernels are not differentiable). Triton is
optional: importing this module never imports it; the Triton modules are imported on first
CUDA use. (The attention kernels are called through ``trillm.attention``'s backends, not from
here.)
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from trillm.kernels import (
    activation_cpu,
    activation_torch,
    lora_cpu,
    lora_torch,
    rms_norm_cpu,
    rms_norm_torch,
    rotary_cpu,
    rotary_torch,
)
from trillm.kernels.rotary_torch import build_cos_sin_cache

__all__ = [
    "add_lora_",
    "apply_rotary",
    "apply_rotary_",
    "build_cos_sin_cache",
    "fused_add_rms_norm",
    "fused_add_rms_norm_",
    "rms_norm",
    "silu_and_mul",
    "triton_available",
]


@functools.cache
def triton_available() -> bool:
    """Whether the ``triton`` package can be imported here (it is optional on CPU)."""
    return importlib.util.find_spec("triton") is not None


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and triton_available()


def _records_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd would record an op on these tensors (never under the runner's
    ``inference_mode``)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _native_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    tensors = (x, weight) if residual is None else (x, weight, residual)
    return (
        rms_norm_cpu.available()
        and rms_norm_cpu.supports(x, weight, residual)
        and not _records_grad(*tensors)
    )


def _native_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> bool:
    return (
        rotary_cpu.available()
        and rotary_cpu.supports(q, k, positions, cos_sin_cache)
        and not _records_grad(q, k)
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H], weight: [H] -> [..., H] in x's dtype (normalised in fp32, like HF Llama)."""
    if _use_triton(x):
        from trillm.kernels import rms_norm_triton

        return rms_norm_triton.rms_norm(x, weight, eps)
    if _native_rms_norm(x, weight, None):
        return rms_norm_cpu.rms_norm(x, weight, eps)
    return rms_norm_torch.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., H] -> (rms_norm(x + residual) [..., H], x + residual [..., H]).

    Out of place: neither input is modified."""
    if _use_triton(x):
        from trillm.kernels import rms_norm_triton

        return rms_norm_triton.fused_add_rms_norm(x, residual, weight, eps)
    if _native_rms_norm(x, weight, residual):
        out, new_residual = x.clone(), residual.clone()
        rms_norm_cpu.fused_add_rms_norm_(out, new_residual, weight, eps)
        return out, new_residual
    return rms_norm_torch.fused_add_rms_norm(x, residual, weight, eps)


def fused_add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """In place: ``residual = x + residual``, then ``x = rms_norm(residual)``; returns x.

    x, residual: [..., H], same shape and dtype. The values of ``fused_add_rms_norm``."""
    if _native_rms_norm(x, weight, residual):
        rms_norm_cpu.fused_add_rms_norm_(x, residual, weight, eps)
    else:
        out, new_residual = fused_add_rms_norm(x, residual, weight, eps)
        residual.copy_(new_residual)
        x.copy_(out)
    return x


def apply_rotary(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int
    cos_sin_cache: torch.Tensor,  # [max_pos, rotary_dim], cos half then sin half
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox / HF ``rotate_half`` rotary embedding; returns rotated copies of q and k (fp32 math,
    cast back to their dtype). Dims ``rotary_dim .. D`` pass through unrotated."""
    if _use_triton(q):
        from trillm.kernels import rotary_triton

        return rotary_triton.apply_rotary(q, k, positions, cos_sin_cache)
    if _native_rotary(q, k, positions, cos_sin_cache):
        q_out, k_out = q.clone(), k.clone()
        rotary_cpu.apply_rotary_(q_out, k_out, positions, cos_sin_cache)
        return q_out, k_out
    return rotary_torch.apply_rotary(q, k, positions, cos_sin_cache)


def apply_rotary_(
    q: torch.Tensor,  # [T, Hq, D], may be a strided view (of a fused qkv buffer)
    k: torch.Tensor,  # [T, Hkv, D], likewise
    positions: torch.Tensor,  # [T] int
    cos_sin_cache: torch.Tensor,  # [max_pos, rotary_dim], cos half then sin half
) -> None:
    """``apply_rotary`` in place: q and k are overwritten with their rotated values."""
    if _use_triton(q):
        from trillm.kernels import rotary_triton

        rotary_triton.apply_rotary_(q, k, positions, cos_sin_cache)
    elif _native_rotary(q, k, positions, cos_sin_cache):
        rotary_cpu.apply_rotary_(q, k, positions, cos_sin_cache)
    else:
        q_rot, k_rot = rotary_torch.apply_rotary(q, k, positions, cos_sin_cache)
        q.copy_(q_rot)
        k.copy_(k_rot)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up: [..., 2I] (gate, then up) -> ``silu(gate) * up`` [..., I], into ``out`` if given.
    (No Triton kernel: CUDA tensors take the torch reference.)

    The native kernel for fp32 and bf16. Alone, torch's op can be faster (bf16 at a 2,048-token
    SmolLM2 step: 2.4 against 4.0 ms of CPU; fp32 at ~64 rows: 88 against 137 us), but not
    inside the forward: it wakes torch's OpenMP threads, which then spin on the cores the native
    kernels' pool needs (fp32 decode: 300 us; a bf16 SmolLM2-135M 8 x 256-token prefill step
    in an in-process engine: 3.43 against 3.01 s of process CPU, alternated; under the served
    worker's GOMP_SPINCOUNT, executor/worker_ipc.py, a wash: 3.00 against 3.03 s)."""
    if (
        gate_up.dtype in (torch.float32, torch.bfloat16)
        and activation_cpu.available()
        and activation_cpu.supports(gate_up)
        and not _records_grad(gate_up)
    ):
        return activation_cpu.silu_and_mul(gate_up, out)
    return activation_torch.silu_and_mul(gate_up, out)


def add_lora_(
    y: torch.Tensor,  # [T, out], updated in place
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [L, R, in], each slot's A
    bt: torch.Tensor,  # [L, R, out], each slot's B transposed
    slots: torch.Tensor,  # [T] int64, each token's slot, -1 = no adapter
    scales: torch.Tensor,  # [L] fp32
) -> torch.Tensor:
    """Batched LoRA: ``y[t] += scales[s] * (x[t] @ a[s]^T) @ bt[s]`` for every token t with a
    slot s >= 0 (summed in fp32, y rounded once); returns y."""
    if _use_triton(x):
        from trillm.kernels import lora_triton

        plan = lora_triton.step_plan(slots, a.shape[0])
        return lora_triton.add_lora_(y, x, a, bt, slots, scales, plan)
    if lora_cpu.available() and lora_cpu.supports(x, y, a, bt) and not _records_grad(x, y, a, bt):
        return lora_cpu.add_lora_(y, x, a, bt, slots, scales)
    return lora_torch.add_lora_(y, x, a, bt, slots, scales)
