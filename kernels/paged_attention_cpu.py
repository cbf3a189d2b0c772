"""Paged attention on CPU: the native kernel of ``ext/cpu_attention.cpp``, same contract as
``paged_attention_torch.paged_attention`` (its reference) but reading K/V in place from the
block-paged cache: no gather into dense copies, no padding, no mask tensor.

fp32 and bf16 (math in fp32; bf16 rounds scores and probabilities where transformers' bf16
eager attention does), the cache also fp8 e4m3 (``--kv-cache-dtype fp8``); the work is spread over ``num_threads()`` threads of the thread
pool of ``trillm._ext.cpu_kernels`` (shared by the native CPU kernels). A step builds one
``PagedAttentionPlan`` (metadata checked, work items made) and every layer runs it.
``available()`` is False when the extension is not built or ``TRILLM_NO_EXTENSIONS=1``; callers
then use the torch path.

A layer may pass a sliding ``window`` (a row at ``p`` sees positions ``> p - window``; the
kernel reads only those), a logit ``softcap`` and, with fp32 queries, attention ``sinks``
(``[Hq]`` fp32 logits folded into each row's softmax, gpt-oss) to ``run``. ``causal_prefill``
has none of them: such layers attend fresh prompts with the paged kernel too.

On a CPU with AVX512-BF16, a bf16 chunk of 16 rows or more over a bf16 cache (the later chunks
of a prompt longer than ``--max-num-batched-tokens``) runs on the fresh-prompt kernel's
``vdpbf16ps`` arithmetic over 64-key tiles gathered from the blocks
(``ext/cpu_attention_paged_dp.h``; windowed and soft-capped layers keep the tile kernel).

``causal_prefill`` is the fresh-prompt twin (``ext/cpu_prefill_attention.cpp``): prompt chunks
with no context attend causally over this step's own q/k/v rows, fp32 or bf16 (rounded like the
paged kernel), GEMM-shaped tiles.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from trillm import envs
from trillm._native import cpu_kernels, native_available

from . import recording

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# The cache may also hold fp8 e4m3 (--kv-cache-dtype fp8: x / scale with the scale 1.0), read
# and widened exactly to fp32 in the kernel; or bf16 under an fp32 model.
_CACHE_DTYPES = {**_DTYPES, torch.float8_e4m3fn: 2}


def num_threads() -> int:
    """``TRILLM_CPU_ATTENTION_THREADS`` if set, else torch's intra-op thread count."""
    threads = envs.CPU_ATTENTION_THREADS.get()
    return torch.get_num_threads() if threads is None else threads


def available() -> bool:
    return native_available("cpu_kernels")


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the kernel handles these tensors (CPU, q fp32/bf16, the cache fp32/bf16/fp8
    e4m3, head_dim a multiple of 8 up to 512, at most 64 query heads per kv head)."""
    return (
        q.device.type == "cpu"
        and kv_cache.device.type == "cpu"
        and q.dtype in _DTYPES
        and kv_cache.dtype in _CACHE_DTYPES
        and q.shape[-1] <= 512
        and q.shape[-1] % 8 == 0
        and q.shape[1] % kv_cache.shape[3] == 0
        and q.shape[1] // kv_cache.shape[3] <= 64
    )


def supports_sinks(q: torch.Tensor, sinks: torch.Tensor) -> bool:
    """Whether ``run`` takes these attention sinks: fp32 q (the bf16 path rounds its
    probabilities as transformers does, where the sinks have no place yet), fp32 [Hq] sinks."""
    return (
        q.dtype == torch.float32
        and sinks.dtype == torch.float32
        and sinks.device.type == "cpu"
        and sinks.shape == (q.shape[1],)
        and sinks.is_contiguous()
    )


def _check_int32(name: str, t: torch.Tensor) -> None:
    if t.dtype != torch.int32 or t.device.type != "cpu" or t.stride(-1) != 1:
        raise ValueError(f"{name} must be a CPU int32 tensor, contiguous in its last dim.")


class PagedAttentionPlan:
    """One step's metadata, checked and split into work items once; ``run`` it per layer.

    Holds the metadata tensors (the native plan points into them), so they must not be
    modified while the plan is in use."""

    def __init__(
        self,
        query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
        seq_lens: torch.Tensor,  # [num_reqs] int32
        block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
        q_shape: tuple[int, ...] | torch.Size,  # [num_tokens, Hq, D] of every layer's q
        kv_cache_shape: tuple[int, ...] | torch.Size,  # [2, num_blocks, block_size, Hkv, D]
        reqs: torch.Tensor | None = None,  # [n] int32: attend only these requests' rows
    ) -> None:
        ext = _ext()
        for name, t in (
            ("query_start_loc", query_start_loc),
            ("seq_lens", seq_lens),
            ("block_table", block_table),
            ("reqs", reqs),
        ):
            if t is not None:
                _check_int32(name, t)
        num_reqs = seq_lens.shape[0]
        if query_start_loc.shape[0] != num_reqs + 1 or block_table.shape[0] < num_reqs:
            raise ValueError("query_start_loc, seq_lens and block_table disagree on num_reqs.")
        self.q_shape = tuple(q_shape)
        self.kv_cache_shape = tuple(kv_cache_shape)
        self._keep = (query_start_loc, seq_lens, block_table, reqs)
        self._plan = ext.Plan(
            block_table=block_table.data_ptr(),
            query_start_loc=query_start_loc.data_ptr(),
            seq_lens=seq_lens.data_ptr(),
            num_reqs=num_reqs,
            req_indices=0 if reqs is None else reqs.data_ptr(),
            num_selected=-1 if reqs is None else reqs.shape[0],
            num_heads=self.q_shape[1],
            num_kv_heads=self.kv_cache_shape[3],
            head_dim=self.q_shape[2],
            block_size=self.kv_cache_shape[2],
            num_blocks=self.kv_cache_shape[1],
            block_table_stride=block_table.stride(0),
            max_blocks_per_req=block_table.shape[1],
            num_threads=num_threads(),
        )

    @property
    def key(self) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
        """(q shape, cache shape, whether every request is attended): what a step program
        needs to build the same plan for another step's metadata."""
        return self.q_shape, self.kv_cache_shape, self._keep[3] is None

    @property
    def native(self) -> Any:
        """The native plan (``Plan.run`` with raw pointers: what a step program replays)."""
        return self._plan

    def run(
        self,
        q: torch.Tensor,  # [num_tokens, Hq, D], rows may be strided (a view of a fused qkv)
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        scale: float,
        out: torch.Tensor | None = None,  # [num_tokens, Hq, D]
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,  # [Hq] fp32, fp32 q only (``supports_sinks``)
    ) -> torch.Tensor:  # [num_tokens, Hq, D]
        if (window is not None and window < 1) or (softcap is not None and not softcap > 0):
            raise ValueError("window must be >= 1 and softcap > 0 (or None).")
        if sinks is not None and not supports_sinks(q, sinks):
            raise ValueError("sinks must be a contiguous [Hq] float32 tensor, q float32.")
        if q.shape != self.q_shape or kv_cache.shape != self.kv_cache_shape:
            raise ValueError("q or kv_cache has another shape than the plan was made for.")
        if not supports(q, kv_cache):
            raise ValueError("paged_attention_cpu: unsupported device, dtype or head layout.")
        if q.stride(2) != 1 or not kv_cache.is_contiguous():
            raise ValueError("q must be contiguous in its last dim and kv_cache contiguous.")
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype)
        if out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
            raise ValueError("out must match q's shape and dtype, contiguous in its last dim.")
        recording.attention(
            self,
            self._plan,
            out=out.data_ptr(),
            q=q.data_ptr(),
            k_cache=kv_cache[0].data_ptr(),
            v_cache=kv_cache[1].data_ptr(),
            q_token_stride=q.stride(0),
            q_head_stride=q.stride(1),
            out_token_stride=out.stride(0),
            out_head_stride=out.stride(1),
            scale=float(scale),
            dtype=_DTYPES[q.dtype],
            window=window or 0,
            softcap=float(softcap or 0.0),
            cache_dtype=_CACHE_DTYPES[kv_cache.dtype],
            sinks=0 if sinks is None else sinks.data_ptr(),
        )
        return out


def paged_attention(
    q: torch.Tensor,  # [num_tokens, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, Hq, D]
    reqs: torch.Tensor | None = None,  # [n] int32: attend only these requests' rows
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, Hq, D]
    """One call: a plan for this metadata, run once (layers of one step share a plan)."""
    plan = PagedAttentionPlan(query_start_loc, seq_lens, block_table, q.shape, kv_cache.shape, reqs)
    return plan.run(q, kv_cache, scale, out, window, softcap, sinks)


def kernel() -> str:
    """The paged kernel in use: ``"avx2"`` (where the CPU has AVX2 and FMA) or ``"generic"``
    (the portable fallback)."""
    return str(_ext().get_kernel())


@contextlib.contextmanager
def use_kernel(name: str) -> Iterator[None]:
    """Run the paged kernel ``name`` (``"avx2"`` or ``"generic"``) inside the block,
    process-wide: the fallback is otherwise never run on a CPU with AVX2. ValueError for another
    name, RuntimeError where the CPU lacks AVX2."""
    ext, before = _ext(), kernel()
    if name not in ("avx2", "generic"):
        raise ValueError(f"use_kernel: {name!r} is not 'avx2' or 'generic'.")
    ext.set_kernel(name)
    try:
        yield
    finally:
        ext.set_kernel(before)


def _ext() -> Any:
    ext = cpu_kernels("attention")
    if ext is None:
        raise RuntimeError("trillm._ext.cpu_kernels is not built.")
    return ext


def prefill_supports_layout(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> bool:
    """Whether ``causal_prefill`` handles this layout: fp32 or bf16, head_dim a multiple of 16
    up to 256, at most 96 query heads per kv head, a CPU with AVX2 and FMA."""
    ext = cpu_kernels("attention")
    return (
        ext is not None
        and ext.prefill_supported()
        and dtype in _DTYPES
        and head_dim % 16 == 0
        and head_dim <= 256
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= 96
    )


def prefill_supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``causal_prefill`` handles these tensors: on CPU, one dtype, a layout
    ``prefill_supports_layout`` accepts."""
    return (
        all(t.device.type == "cpu" and t.dtype == q.dtype for t in (q, k, v))
        and k.shape == v.shape
        and k.shape[-1] == q.shape[-1]
        and prefill_supports_layout(q.dtype, q.shape[1], k.shape[1], q.shape[-1])
    )


def causal_prefill(
    q: torch.Tensor,  # [T, Hq, D] fp32 or bf16, rows may be strided (a view of a fused qkv)
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    segments: torch.Tensor,  # [n, 2] int32: (first row, length) of each fresh prompt chunk
    scale: float,
    out: torch.Tensor,  # [T, Hq, D]: the segments' rows are written, the others left alone
) -> torch.Tensor:
    """Causal self-attention of prompt chunks with no context in the cache: segment rows attend
    to the segment's rows up to their own, read from this step's q/k/v (no cache, no mask).
    The native kernel of ``ext/cpu_prefill_attention.cpp``; check ``prefill_supports`` first.
    bf16 rounds where transformers' bf16 eager attention does, as the paged kernel."""
    if not prefill_supports(q, k, v):
        raise ValueError("causal_prefill: unsupported device, dtype or head layout.")
    if k.shape[0] != q.shape[0] or out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError("q, k, v and out must have the same rows; out q's shape and dtype.")
    if any(t.stride(2) != 1 for t in (q, k, v, out)):
        raise ValueError("q, k, v and out must be contiguous in their last dim.")
    _check_int32("segments", segments)
    if segments.dim() != 2 or segments.shape[1] != 2 or not segments.is_contiguous():
        raise ValueError("segments must be a contiguous [n, 2] int32 tensor.")
    if segments.numel() and (
        int(segments[:, 0].min()) < 0
        or int(segments[:, 1].min()) < 0
        or int((segments[:, 0] + segments[:, 1]).max()) > q.shape[0]
    ):
        raise ValueError("a segment reaches outside q's rows.")
    ext = cpu_kernels("attention")
    assert ext is not None
    recording.call(
        ext.causal_prefill,
        out=out.data_ptr(),
        q=q.data_ptr(),
        k=k.data_ptr(),
        v=v.data_ptr(),
        segments=segments.data_ptr(),
        num_segments=segments.shape[0],
        q_token_stride=q.stride(0),
        q_head_stride=q.stride(1),
        k_token_stride=k.stride(0),
        k_head_stride=k.stride(1),
        v_token_stride=v.stride(0),
        v_head_stride=v.stride(1),
        out_token_stride=out.stride(0),
        out_head_stride=out.stride(1),
        num_heads=q.shape[1],
        num_kv_heads=k.shape[1],
        head_dim=q.shape[2],
        scale=float(scale),
        num_threads=num_threads(),
        dtype=_DTYPES[q.dtype],
    )
    return out
