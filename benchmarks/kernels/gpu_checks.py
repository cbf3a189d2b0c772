"""GPU checks for trillm's kernels: compile the Triton kernels for real, compare each with its
torch reference in fp32/fp16/bf16, compare the Triton and FlashInfer attention backends with
the torch reference, and time paged-attention decode at batch 64.

    python benchmarks/kernels/gpu_checks.py [--skip-timing]

Exits 0 with a message when no CUDA device is present; exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

# NOTE: run as a script, sys.path[0] is benchmarks/; the repo root makes ``trillm`` importable
# from a source checkout whatever the install mode.
sys.path.insert(1, str(Path(__file__).resolve().parents[2]))

# dtype -> (atol, rtol) against the fp32-math torch references
_TOL = {
    torch.float32: (2e-4, 2e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
# attention in half precision: the kernel rounds p to the value dtype before P @ V
_ATTN_TOL = {
    torch.float32: (2e-4, 2e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 3e-2),
}
_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
_DEVICE = "cuda"  # a module global so the plumbing can be dry-run on CPU
_failures: list[str] = []


def _check(name: str, fn: Callable[[], None]) -> None:
    try:
        fn()
        print(f"PASS  {name}")
    except Exception:  # a failed check is reported, the others still run
        _failures.append(name)
        print(f"FAIL  {name}\n{traceback.format_exc()}")


def _close(got: torch.Tensor, expected: torch.Tensor, tol: tuple[float, float]) -> None:
    torch.testing.assert_close(got.float(), expected.float(), atol=tol[0], rtol=tol[1])


# --- elementwise kernels ----------------------------------------------------------------------


def check_rms_norm(dtype: torch.dtype) -> None:
    from trillm.kernels import rms_norm_torch, rms_norm_triton

    x = torch.randn(77, 4096, device=_DEVICE, dtype=dtype)
    res = torch.randn_like(x)
    w = torch.randn(4096, device=_DEVICE, dtype=dtype)
    _close(rms_norm_triton.rms_norm(x, w, 1e-6), rms_norm_torch.rms_norm(x, w, 1e-6), _TOL[dtype])
    out, new_res = rms_norm_triton.fused_add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_res = rms_norm_torch.fused_add_rms_norm(x, res, w, 1e-6)
    _close(new_res, ref_res, (0.0, 0.0))
    _close(out, ref_out, _TOL[dtype])


def check_rotary(dtype: torch.dtype) -> None:
    from trillm.kernels import rotary_torch, rotary_triton

    head_dim = 128
    inv_freq = 1.0 / (500000 ** (torch.arange(0, head_dim, 2, device=_DEVICE) / head_dim))
    cache = rotary_torch.build_cos_sin_cache(inv_freq, 8192)
    qkv = torch.randn(300, (32 + 8 + 8) * head_dim, device=_DEVICE, dtype=dtype)
    q = qkv[:, : 32 * head_dim].view(300, 32, head_dim)  # strided views, like a fused qkv
    k = qkv[:, 32 * head_dim : 40 * head_dim].view(300, 8, head_dim)
    positions = torch.randint(0, 8192, (300,), device=_DEVICE)
    q_ref, k_ref = rotary_torch.apply_rotary(q, k, positions, cache)
    q_out, k_out = rotary_triton.apply_rotary(q, k, positions, cache)
    _close(q_out, q_ref, _TOL[dtype])
    _close(k_out, k_ref, _TOL[dtype])


def check_reshape_and_cache(dtype: torch.dtype) -> None:
    from trillm.kernels import reshape_and_cache_torch, reshape_and_cache_triton

    cache = torch.randn(2, 64, 16, 8, 128, device=_DEVICE, dtype=dtype)
    expected = cache.clone()
    k = torch.randn(200, 8, 128, device=_DEVICE, dtype=dtype)
    v = torch.randn_like(k)
    slots = torch.randperm(64 * 16, device=_DEVICE)[:200]
    reshape_and_cache_torch.reshape_and_cache(k, v, expected, slots)
    reshape_and_cache_triton.reshape_and_cache(k, v, cache, slots)
    _close(cache, expected, (0.0, 0.0))


# --- attention --------------------------------------------------------------------------------


def make_step(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype):
    """A random step on the GPU: (q, k, v, kv_cache, meta); the cache already holds each
    request's context in shuffled, non-contiguous blocks."""
    from trillm.attention.backend import AttentionMetadata

    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 4
    pool = torch.randperm(num_blocks, dtype=torch.int32)
    table = torch.zeros(len(blocks), max(blocks), dtype=torch.int32)
    starts = torch.tensor([0, *torch.tensor(blocks).cumsum(0).tolist()])
    for i, n in enumerate(blocks):
        table[i, :n] = pool[starts[i] : starts[i] + n]
    slots = [
        int(table[i, p // block_size]) * block_size + p % block_size
        for i, (c, s) in enumerate(zip(context_lens, seq_lens))
        for p in range(c, s)
    ]
    n = sum(query_lens)
    meta = AttentionMetadata(
        num_reqs=len(query_lens),
        num_tokens=n,
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()]).int(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=seq_lens,
    )
    for name in ("query_start_loc", "seq_lens", "context_lens", "block_table", "slot_mapping"):
        setattr(meta, name, getattr(meta, name).to(_DEVICE))
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=_DEVICE)
    q = torch.randn(n, num_heads, head_dim, device=_DEVICE, dtype=dtype)
    k = torch.randn(n, num_kv_heads, head_dim, device=_DEVICE, dtype=dtype)
    v = torch.randn(n, num_kv_heads, head_dim, device=_DEVICE, dtype=dtype)
    return q, k, v, cache.to(dtype), meta


_MIXED = ([1] * 6 + [37, 130, 1, 64], [5, 100, 1000, 17, 2048, 300, 0, 256, 4000, 1])
_SMALL_DECODE = ([1, 1], [4000, 900])  # few programs: the Triton backend splits the K/V
_ATTN_SHAPES = [(32, 8, 128, 16), (8, 2, 64, 16), (4, 1, 24, 32), (12, 12, 64, 16)]


def reference_step(q, k, v, cache, meta, scale):
    from trillm.kernels import paged_attention_torch, reshape_and_cache_torch

    reshape_and_cache_torch.reshape_and_cache(k, v, cache, meta.slot_mapping)
    return paged_attention_torch.paged_attention(
        q, cache, meta.query_start_loc, meta.seq_lens, meta.block_table, scale
    )


def check_backend(name: str, dtype: torch.dtype, shape, batch=_MIXED) -> None:
    from trillm.attention.backend import get_attention_backend

    num_heads, num_kv_heads, head_dim, block_size = shape
    query_lens, context_lens = batch
    q, k, v, cache, meta = make_step(
        query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype
    )
    scale = head_dim**-0.5
    expected_cache = cache.clone()
    expected = reference_step(q, k, v, expected_cache, meta, scale)
    backend = get_attention_backend(name, _DEVICE)
    backend.plan(meta)
    got = backend.forward(q, k, v, cache, meta, scale)
    _close(cache, expected_cache, (0.0, 0.0))
    _close(got, expected, _ATTN_TOL[dtype])


# --- timing -----------------------------------------------------------------------------------


def time_decode(context_len: int, batch: int) -> None:
    import triton.testing

    from trillm.attention.backend import get_attention_backend

    num_heads, num_kv_heads, head_dim, block_size = 32, 8, 128, 16
    q, k, v, cache, meta = make_step(
        [1] * batch,
        [context_len - 1] * batch,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        torch.bfloat16,
    )
    kv_bytes = 2 * batch * context_len * num_kv_heads * head_dim * cache.element_size()
    names = ["triton", "torch"]
    if _flashinfer_importable():
        names.append("flashinfer")
    for name in names:
        backend = get_attention_backend(name, _DEVICE)
        backend.plan(meta)

        def step(backend=backend):
            backend.forward(q, k, v, cache, meta, head_dim**-0.5)

        ms = triton.testing.do_bench(step, warmup=25, rep=200)
        gbps = kv_bytes / (ms * 1e-3) / 1e9
        print(
            f"TIME  decode batch={batch} ctx={context_len} {name:10s} {ms * 1e3:8.1f} us "
            f"{gbps:7.0f} GB/s of KV"
        )


def _flashinfer_importable() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-timing", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_checks: no CUDA device here; nothing to check.")
        return 0
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}")
    for dtype in _DTYPES:
        tag = str(dtype).removeprefix("torch.")
        _check(f"rms_norm {tag}", partial(check_rms_norm, dtype))
        _check(f"rotary {tag}", partial(check_rotary, dtype))
        _check(f"reshape_and_cache {tag}", partial(check_reshape_and_cache, dtype))
        for shape in _ATTN_SHAPES:
            for name in ("triton", "torch"):
                _check(f"{name} backend {tag} {shape}", partial(check_backend, name, dtype, shape))
        split_case = partial(check_backend, "triton", dtype, (32, 8, 128, 16), _SMALL_DECODE)
        _check(f"triton backend split-KV decode {tag}", split_case)
    if _flashinfer_importable():
        for dtype in (torch.float16, torch.bfloat16):
            tag = str(dtype).removeprefix("torch.")
            for shape in [s for s in _ATTN_SHAPES if s[2] in (64, 128)]:
                case = partial(check_backend, "flashinfer", dtype, shape)
                _check(f"flashinfer backend {tag} {shape}", case)
    else:
        print("SKIP  flashinfer: not importable")
    if not args.skip_timing:
        for batch, context_len in ((64, 512), (64, 4096), (1, 8192)):
            case = partial(time_decode, context_len, batch)
            _check(f"timing batch={batch} ctx={context_len}", case)
    print(f"{len(_failures)} failed" + (": " + ", ".join(_failures) if _failures else ""))
    return 1 if _failures else 0


if __name__ == "__main__":
    sys.exit(main())
