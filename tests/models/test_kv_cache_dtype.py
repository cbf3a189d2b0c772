"""``--kv-cache-dtype`` (issue 13): a KV cache stored in bf16 or fp8 e4m3 (scale 1.0), read in
place by the native paged-attention kernel (``ext/cpu_attention.cpp``) and by the torch path,
each against the torch reference attention over the same cache widened to fp32; the cache
write; the engine on the embedded model (close to, not equal to, its auto-dtype output); the
refusals."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from trillm import LLM, SamplingParams
from trillm.attention.backend import AttentionMetadata
from trillm.attention.torch_backend import TorchAttentionBackend, to_fp8
from trillm.config import EngineArgs
from trillm.engine.config_builder import build_config, resolve_cache_dtype
from trillm.kernels import paged_attention_cpu, paged_attention_torch
from trillm.worker.model_runner import ModelRunner

FP8 = torch.float8_e4m3fn
needs_kernel = pytest.mark.skipif(
    not paged_attention_cpu.available(), reason="trillm._ext.cpu_kernels is not built"
)


def _problem(
    query_lens,
    seq_lens,
    cache_dtype,
    q_dtype=torch.float32,
    heads=8,
    kv_heads=2,
    head_dim=64,
    block_size=16,
    seed=0,
):
    g = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + 2
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(seq_lens), max(needed) + 1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(needed):
        table[i, :n] = perm[used : used + n]
        used += n
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g) * 3
    kv = to_fp8(kv) if cache_dtype == FP8 else kv.to(cache_dtype)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=g).to(q_dtype)
    qsl = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return q, kv, qsl, torch.tensor(seq_lens, dtype=torch.int32), table


CASES = {"decode": ([1, 1, 1], [1, 17, 300]), "mixed": ([1, 9, 3], [70, 30, 5])}


@needs_kernel
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("cache_dtype", [FP8, torch.bfloat16])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 40])
@pytest.mark.parametrize("kernel", ["default", "generic"])  # generic: the CPUs without AVX2
def test_native_kernel_reads_the_cache_dtype_in_place(case, cache_dtype, q_dtype, head_dim, kernel):
    q, kv, qsl, seq_lens, table = _problem(*CASES[case], cache_dtype, q_dtype, head_dim=head_dim)
    scale = head_dim**-0.5
    with paged_attention_cpu.use_kernel(kernel) if kernel != "default" else nullcontext():
        out = paged_attention_cpu.paged_attention(q, kv, qsl, seq_lens, table, scale)
    # the reference: the same stored values widened to fp32 (exact), the torch twin's attention
    # with the kernel's rounding points for q's dtype (bf16 queries: bf16-rounded scores)
    ref = paged_attention_torch.paged_attention(q, kv.float(), qsl, seq_lens, table, scale)
    assert out.dtype == q_dtype
    tol = 1e-5 if q_dtype == torch.float32 else 1e-2  # values up to ~10: fp32 sums reordered
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@needs_kernel
def test_every_e4m3_code_is_read_exactly():
    """A cache holding each finite e4m3 code once (subnormals, signs); one-hot queries with a
    huge scale pick one key each, so the output is that key's value row, widened exactly."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F][:248]  # 248 = 31 rows of head_dim 8
    head_dim, block_size = 8, 32
    values = codes.view(31, 1, head_dim)  # [slots, Hkv, D]
    kv = torch.zeros(2, 1, block_size, 1, head_dim, dtype=torch.uint8)
    kv[1, 0, :31] = values
    keys = torch.eye(head_dim).repeat(4, 1)[:31] * 100 + torch.arange(31)[:, None] * 0.001
    kv[0, 0, :31] = to_fp8(keys).view(torch.uint8)[:, None]
    kv = kv.view(FP8)
    q = torch.zeros(1, 1, head_dim)
    q[0, 0, 3] = 1.0  # best: the key rows with 100 at dim 3 (rows 3, 11, 19, 27), 27 the largest
    out = paged_attention_cpu.paged_attention(
        q,
        kv,
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([31], dtype=torch.int32),
        torch.zeros(1, 1, dtype=torch.int32),
        1e4,
    )
    ref = paged_attention_torch.paged_attention(
        q,
        kv.float(),
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([31], dtype=torch.int32),
        torch.zeros(1, 1, dtype=torch.int32),
        1e4,
    )
    torch.testing.assert_close(out, ref, atol=0, rtol=1e-6)
    # all 31 value rows read back through the reference widening are the torch e4m3 values
    assert torch.equal(kv[1, 0, :31].float(), values.view(FP8).float())


def test_write_saturates_and_the_torch_path_matches_the_reference():
    """The torch path (native=False): K/V written as e4m3 (beyond +-448 saturated), read back
    widened; against the reference over the cache it wrote."""
    q, _, qsl, seq_lens, table = _problem([1, 4], [20, 10], FP8)  # both with context
    tokens, kv_heads, head_dim, block_size = q.shape[0], 2, 64, 16
    k = torch.randn(tokens, kv_heads, head_dim) * 100
    k[0, 0, 0], k[1, 0, 0] = 1000.0, -1e9
    v = torch.randn(tokens, kv_heads, head_dim)
    kv = torch.zeros(2, 4, block_size, kv_heads, head_dim, dtype=FP8)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    slots = torch.tensor([19, 38, 39, 40, 41])  # request 0's position 19, request 1's 6..9
    meta = AttentionMetadata(
        num_reqs=2,
        num_tokens=tokens,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        context_lens=torch.tensor([19, 6], dtype=torch.int32),
        block_table=table,
        slot_mapping=slots,
        max_query_len=4,
        max_seq_len=20,
        query_lens_cpu=[1, 4],
        seq_lens_cpu=[20, 10],
    )
    backend = TorchAttentionBackend(native=False)
    backend.plan(meta)
    out = backend.forward(q, k, v, kv, meta, head_dim**-0.5)
    assert kv[0].view(-1, kv_heads, head_dim)[19, 0, 0].item() == 448.0
    assert kv[0].view(-1, kv_heads, head_dim)[38, 0, 0].item() == -448.0
    torch.testing.assert_close(kv[1].view(-1, kv_heads, head_dim)[slots].float(), v.to(FP8).float())
    ref = paged_attention_torch.paged_attention(q, kv.float(), qsl, seq_lens, table, head_dim**-0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------ config and engine

SMALL = {"max_model_len": 256, "kv_cache_memory": "16MiB", "distributed_executor_backend": "uni"}


def test_cache_dtype_sizes_the_blocks_and_unknown_values_are_refused():
    sizes = {}
    for name in ("auto", "bfloat16", "fp8", "fp8_e4m3"):
        config = build_config(EngineArgs(kv_cache_dtype=name, dtype="float32", device="cpu"))
        runner = ModelRunner(config)
        sizes[name] = (config.cache.cache_dtype, runner.kv_dtype, runner.kv_block_bytes())
    assert sizes["auto"][:2] == ("float32", torch.float32)
    assert sizes["bfloat16"][:2] == ("bfloat16", torch.bfloat16)
    assert sizes["fp8"][:2] == sizes["fp8_e4m3"][:2] == ("fp8_e4m3", FP8)
    assert sizes["auto"][2] == 2 * sizes["bfloat16"][2] == 4 * sizes["fp8"][2]
    for bad in ("fp8_e5m2", "float16", "int8"):
        with pytest.raises(ValueError, match=f"kv_cache_dtype '{bad}' is not implemented yet"):
            EngineArgs(kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="CPU only"):
        resolve_cache_dtype("fp8", "bfloat16", "cuda")
    assert resolve_cache_dtype("auto", "bfloat16", "cuda") == "bfloat16"


PROMPTS = [
    "In the beginning God created",
    "And the LORD said unto Moses,",
    "Blessed are the meek: for",
    "The king of Babylon came",
    "And it came to pass, when",
    "Thou shalt not",
]


def _greedy(**kwargs):
    llm = LLM(None, dtype="float32", **kwargs, **SMALL)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


def test_engine_output_with_a_bf16_and_an_fp8_cache_stays_close():
    """Close, not equal: >= 5 of 6 greedy continuations of 24 tokens identical to the fp32
    cache's (measured, 8 prompts x 48 tokens: bf16 8 / 8 identical; fp8 6 / 8, the other two
    departing at tokens 24 and 32)."""
    base = _greedy()
    for name in ("bfloat16", "fp8"):
        got = _greedy(kv_cache_dtype=name)
        same = sum(a == b for a, b in zip(base, got))
        assert same >= 5, (name, same)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_cache_write_rounds_like_torch(dtype):
    """ext/cpu_ops.cpp's fp8 write: the bytes torch's clamp-then-cast gives (nearest even,
    subnormals, +-448 saturation), for every slot the mapping names; negative slots skipped."""
    from trillm.kernels import reshape_and_cache_cpu

    g = torch.Generator().manual_seed(3)
    tokens, heads, head_dim = 40, 2, 64
    k = torch.randn(tokens, heads, head_dim, generator=g) * torch.logspace(-4, 3, head_dim)
    v = torch.randn(tokens, heads, head_dim, generator=g) * 0.01
    k[0, 0, :6] = torch.tensor([448.0, 460.0, 470.0, 1e9, -1e9, 0.0078125 * 1.0625])
    k, v = k.to(dtype), v.to(dtype)
    slots = torch.randperm(64, generator=g)[:tokens]
    slots[5] = -1
    kv = torch.zeros(2, 4, 16, heads, head_dim, dtype=FP8)
    reshape_and_cache_cpu.reshape_and_cache(k, v, kv, slots)
    keep = slots >= 0
    for i, src in enumerate((k, v)):
        got = kv[i].view(-1, heads, head_dim)[slots[keep]].view(torch.uint8)
        assert torch.equal(got, to_fp8(src[keep].float()).view(torch.uint8))
    assert kv.view(torch.uint8).count_nonzero() > 0
