"""The native CPU paged-attention kernel (ext/cpu_attention.cpp) against its torch reference
(kernels/paged_attention_torch.py): head layouts, block sizes, dtypes, strided queries, request
subsets, thread counts, bad inputs, and use after fork."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from trillm.kernels import paged_attention_cpu, paged_attention_torch

pytestmark = pytest.mark.skipif(
    not paged_attention_cpu.available(), reason="trillm._ext.cpu_kernels is not built"
)


def _problem(
    query_lens,
    seq_lens,
    *,
    heads=8,
    kv_heads=2,
    head_dim=64,
    block_size=16,
    dtype=torch.float32,
    seed=0,
    fused_qkv=True,
):
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    width = max(blocks_needed) + 2  # rows longer than needed, padded with junk ids
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.randint(0, num_blocks, (len(seq_lens), width), generator=g, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_needed):
        table[i, :n] = perm[used : used + n]
        used += n
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    tokens = sum(query_lens)
    if fused_qkv:  # q as a strided view of a fused qkv projection, as the model passes it
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
        q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    else:
        q = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
    qsl = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return q, kv, qsl, torch.tensor(seq_lens, dtype=torch.int32), table


def _check(q, kv, qsl, seq_lens, table, *, atol=2e-6, window=None, softcap=None, **kwargs):
    scale = q.shape[-1] ** -0.5
    out = paged_attention_cpu.paged_attention(
        q, kv, qsl, seq_lens, table, scale, window=window, softcap=softcap, **kwargs
    )
    ref = paged_attention_torch.paged_attention(
        q, kv, qsl, seq_lens, table, scale, window=window, softcap=softcap
    )
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=atol)
    return out


CASES = {
    "decode": ([1] * 6, [1, 5, 16, 17, 33, 300]),
    "prefill-after-prefix": ([7, 40, 3], [50, 40, 100]),
    "mixed": ([1, 37, 1, 2], [64, 37, 9, 130]),
    "long-context": ([1, 1], [1000, 77]),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim",
    [(8, 2, 64), (8, 8, 64), (4, 1, 128), (12, 4, 80), (16, 1, 8), (64, 1, 16)],
)
def test_matches_reference(case, heads, kv_heads, head_dim):
    query_lens, seq_lens = CASES[case]
    _check(*_problem(query_lens, seq_lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim))


@pytest.mark.parametrize(
    "window,softcap", [(1, None), (5, None), (70, None), (None, 0.8), (33, 2.0)]
)
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (4, 1, 128), (12, 4, 80)])
def test_sliding_window_and_softcap_match_reference(
    case, heads, kv_heads, head_dim, window, softcap
):
    # head_dim 64 / 128 take the one-row decode kernel for decode rows, 80 the generic tile
    query_lens, seq_lens = CASES[case]
    problem = _problem(query_lens, seq_lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    _check(*problem, window=window, softcap=softcap, atol=1e-5)


def test_sliding_window_bfloat16_and_fresh_prompts():
    # context 0 (a fresh prompt read back from the cache) spanning several windows
    _check(
        *_problem([1, 40, 1], [70, 40, 5], dtype=torch.bfloat16), window=9, softcap=1.5, atol=1e-2
    )


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (4, 1, 128), (12, 4, 80)])
def test_generic_fallback_matches_reference(case, heads, kv_heads, head_dim):
    # The portable kernel (CPUs without AVX2; on x86-64 built at -O1) is otherwise never run
    # here: fp32, a window and a softcap, and bf16, decode rows and tiles, each head_dim path.
    # The long bf16 chunks too: neither long-chunk kernel (AVX2, AVX512-BF16) runs under it.
    shape = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
    default = paged_attention_cpu.kernel()
    ext = paged_attention_cpu.cpu_kernels("attention")
    chunks = ext.paged_chunk_kernel()
    ran = 0 if chunks == "tile" else ext.paged_chunk_items_run(chunks)
    with paged_attention_cpu.use_kernel("generic"):
        assert paged_attention_cpu.kernel() == "generic"
        _check(*_problem(*CASES[case], **shape))
        _check(*_problem(*CASES[case], **shape), window=5, softcap=2.0, atol=1e-5)
        _check(*_problem(*CASES[case], **shape, dtype=torch.bfloat16), atol=1e-2)
    assert paged_attention_cpu.kernel() == default
    assert ran == (0 if chunks == "tile" else ext.paged_chunk_items_run(chunks))
    with pytest.raises(ValueError, match="'avx2' or 'generic'"):
        with paged_attention_cpu.use_kernel("avx512"):
            pass


def test_bad_window_or_softcap_is_refused():
    q, kv, qsl, seq_lens, table = _problem([1], [4])
    for bad in ({"window": 0}, {"softcap": 0.0}, {"softcap": float("nan")}):
        with pytest.raises(ValueError, match="window must be >= 1 and softcap > 0"):
            paged_attention_cpu.paged_attention(q, kv, qsl, seq_lens, table, 0.1, **bad)


@pytest.mark.parametrize("block_size", [1, 8, 32, 128])
def test_block_sizes(block_size):
    _check(*_problem([1, 20, 1], [45, 20, 300], block_size=block_size))


def test_bfloat16_matches_reference():
    # Inputs in bf16, math in fp32 on both sides; the outputs round to bf16.
    _check(*_problem([1, 9, 1], [70, 30, 5], dtype=torch.bfloat16), atol=1e-2)


def test_contiguous_query_and_out_buffer():
    q, kv, qsl, seq_lens, table = _problem([3, 1], [10, 40], fused_qkv=False)
    out = torch.full_like(q, float("nan"))
    got = _check(q, kv, qsl, seq_lens, table, out=out)
    assert got.data_ptr() == out.data_ptr()


def test_request_subset_writes_only_its_rows():
    q, kv, qsl, seq_lens, table = _problem([1, 6, 1, 4], [30, 6, 50, 20])
    out = torch.full_like(q, 7.0)
    reqs = torch.tensor([0, 2, 3], dtype=torch.int32)
    paged_attention_cpu.paged_attention(q, kv, qsl, seq_lens, table, 0.125, out=out, reqs=reqs)
    ref = paged_attention_torch.paged_attention(q, kv, qsl, seq_lens, table, 0.125)
    rows = torch.ones(q.shape[0], dtype=torch.bool)
    rows[1:7] = False  # request 1's rows
    torch.testing.assert_close(out[rows], ref[rows], atol=2e-6, rtol=2e-6)
    assert torch.all(out[~rows] == 7.0)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts_agree(threads):
    problem = _problem([1] * 40 + [25], [int(x) for x in torch.arange(1, 41) * 7] + [60])
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _check(*problem)
    finally:
        torch.set_num_threads(previous)
    torch.set_num_threads(1)
    try:
        one = paged_attention_cpu.paged_attention(*problem, scale=64**-0.5)
    finally:
        torch.set_num_threads(previous)
    # The same work items in any thread count: bit-identical results.
    assert torch.equal(got, one)


def test_bad_inputs_are_value_errors_not_crashes():
    q, kv, qsl, seq_lens, table = _problem([1, 1], [20, 30])
    bad = table.clone()
    bad[1, 0] = kv.shape[1]  # a block id past the cache
    with pytest.raises(ValueError, match="block id"):
        paged_attention_cpu.paged_attention(q, kv, qsl, seq_lens, bad, 0.1)
    too_long = seq_lens.clone()
    too_long[0] = table.shape[1] * kv.shape[2] + 1
    with pytest.raises(ValueError, match="block table"):
        paged_attention_cpu.paged_attention(q, kv, qsl, too_long, table, 0.1)
    with pytest.raises(ValueError, match="int32"):
        paged_attention_cpu.paged_attention(q, kv, qsl, seq_lens.long(), table, 0.1)
    with pytest.raises(ValueError, match="request index"):
        paged_attention_cpu.paged_attention(
            q, kv, qsl, seq_lens, table, 0.1, reqs=torch.tensor([5], dtype=torch.int32)
        )
    assert not paged_attention_cpu.supports(q.half(), kv.half())
    assert not paged_attention_cpu.supports(q[..., :12], kv[..., :12])  # head_dim % 8 != 0


_FORK_PROBLEM = _problem([1] * 16, list(range(10, 170, 10)))


def _child(conn) -> None:
    # Only the kernel runs here: torch's own OpenMP pool is not fork-safe either, so the child
    # avoids other parallel torch ops; its inputs come from the parent's memory.
    torch.set_num_threads(2)
    out = paged_attention_cpu.paged_attention(*_FORK_PROBLEM, scale=0.125)
    conn.send(out.tolist())


def test_works_in_a_forked_child_after_the_parent_used_its_threads():
    """The thread pool does not survive fork; the child makes its own instead of hanging."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:  # the parent's pool exists from here on
        expected = paged_attention_cpu.paged_attention(*_FORK_PROBLEM, scale=0.125)
    finally:
        torch.set_num_threads(previous)
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child,))
    proc.start()
    try:
        assert parent.poll(60), "the forked child hung"
        assert torch.equal(torch.tensor(parent.recv()), expected)
        proc.join(10)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()


def test_thread_count_follows_torch_unless_overridden(monkeypatch):
    monkeypatch.delenv("TRILLM_CPU_ATTENTION_THREADS", raising=False)
    assert paged_attention_cpu.num_threads() == torch.get_num_threads()
    monkeypatch.setenv("TRILLM_CPU_ATTENTION_THREADS", "3")
    assert paged_attention_cpu.num_threads() == 3
    _check(*_problem([1, 4], [30, 9]))  # and the kernel runs with it


def test_concurrent_callers_share_the_pool_safely():
    """Two Python threads calling at once (the GIL is released inside) both get exact results."""
    import threading

    problems = [_problem([1] * 24 + [9], [17 * (i + 1) for i in range(25)], seed=s) for s in (1, 2)]
    expected = [paged_attention_cpu.paged_attention(*p, scale=0.125) for p in problems]
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    failures: list[str] = []

    def hammer(index: int) -> None:
        for _ in range(30):
            got = paged_attention_cpu.paged_attention(*problems[index], scale=0.125)
            if not torch.equal(got, expected[index]):
                failures.append(f"caller {index} got a different result")
                return

    try:
        threads = [threading.Thread(target=hammer, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a caller hung"
    finally:
        torch.set_num_threads(previous)
    assert failures == []


def test_one_plan_serves_every_layer_and_refuses_other_shapes():
    """A step plans once; each layer runs the plan on its own q and cache."""
    q, kv, qsl, seq_lens, table = _problem([1, 5, 1], [40, 5, 90])
    plan = paged_attention_cpu.PagedAttentionPlan(qsl, seq_lens, table, q.shape, kv.shape)
    g = torch.Generator().manual_seed(3)
    for layer in range(3):
        kv_layer = kv if layer == 0 else torch.randn(kv.shape, generator=g)
        got = plan.run(q, kv_layer, 0.125)
        ref = paged_attention_torch.paged_attention(q, kv_layer, qsl, seq_lens, table, 0.125)
        torch.testing.assert_close(got, ref, atol=2e-6, rtol=2e-6)
    with pytest.raises(ValueError, match="another shape"):
        plan.run(q, kv[:, :-1].contiguous(), 0.125)
