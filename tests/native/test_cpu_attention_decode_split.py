"""Small fp32 decode batches split by key range over the threads (flash-decoding,
ext/cpu_attention.cpp's plan_key_splits): with fewer one-row items than twice the threads (batch
1 of SmolLM2: 3 kv heads on 2 threads), each (request, kv head) item runs as parts of its keys,
each part's partial online softmax merged in part order. Checked against an fp64 reference and
against the unsplit run (``paged_decode_key_splits(False)``): the merge changes the summation
order only, within 4e-6 of an O(1) output (the fp32 online softmax's own error against fp64 is
2e-5 here); GQA 1/3/4/8, head dims 64/128, blocks of 16/32, contexts 1 to 4,097 and the part
edges, fp32 / bf16 / fp8 caches, windows (parts left empty), soft caps, sinks, NaN in the unused
cache slots, 2 and 3 threads; the same bits however the threads take the parts; bf16 q (its
rounded softmax needs a row's whole sum) and larger batches keep the whole items."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from tests.support.decode_attention import attention_ext as _ext
from tests.support.decode_attention import decode_problem as _problem
from tests.support.decode_attention import fp64_reference as _fp64_reference
from tests.support.decode_attention import run_decode
from trillm.kernels import paged_attention_cpu

pytestmark = pytest.mark.skipif(
    not paged_attention_cpu.available(), reason="trillm._ext.cpu_kernels is not built"
)

CACHES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


@contextlib.contextmanager
def _splits(on: bool) -> Iterator[None]:
    before = _ext().paged_decode_key_splits(int(on))
    try:
        yield
    finally:
        _ext().paged_decode_key_splits(int(before))


def _run(problem, *, split: bool, kernel: str = "one-row", **kwargs) -> tuple[torch.Tensor, int]:
    """The attention of ``problem`` and how many split parts ran for it."""
    with _splits(split):
        ran = _ext().paged_decode_split_items_run()
        out = run_decode(problem, kernel, **kwargs)
        return out, _ext().paged_decode_split_items_run() - ran


def _check(problem, *, expect_parts: int, kernel: str = "one-row", **kwargs) -> torch.Tensor:
    """Split vs unsplit (4e-6) and vs fp64 (2e-5); ``expect_parts`` parts ran (0: no split)."""
    new, parts = _run(problem, split=True, kernel=kernel, **kwargs)
    old, none = _run(problem, split=False, kernel=kernel, **kwargs)
    assert (parts, none) == (expect_parts, 0)
    assert not new.isnan().any()
    torch.testing.assert_close(new, old, rtol=0, atol=4e-6)
    ref = _fp64_reference(problem, **kwargs)
    torch.testing.assert_close(new.double(), ref, rtol=0, atol=2e-5)
    return new


def _parts(threads: int, kv_heads: int, seq_len: int) -> int:
    """The parts the plan makes of a batch-1 row (plan_key_splits' rule)."""
    if kv_heads >= 2 * threads:
        return 0
    splits = min(-(-2 * threads // kv_heads), seq_len // 64)
    return kv_heads * splits if splits > 1 else 0


SEQ_LENS = [1, 63, 128, 129, 137, 300, 1025]
CASES = [  # heads, kv heads, head dim, cache, threads
    (9, 3, 64, "fp32", 2),  # SmolLM2
    (9, 3, 64, "bf16", 3),
    (9, 3, 64, "fp8", 2),
    (8, 1, 128, "fp32", 3),
    (8, 1, 128, "bf16", 2),
    (8, 2, 64, "fp32", 2),
    (8, 2, 64, "fp8", 3),
    (4, 4, 128, "fp32", 3),
    (24, 3, 64, "bf16", 2),
]


@pytest.mark.parametrize("heads,kv_heads,head_dim,cache,threads", CASES)
def test_batch_1_parts_match_unsplit_and_fp64(
    heads, kv_heads, head_dim, cache, threads, monkeypatch
):
    monkeypatch.setenv("TRILLM_CPU_ATTENTION_THREADS", str(threads))
    seq_lens = SEQ_LENS + [4097] if cache == "fp32" and kv_heads == 3 else SEQ_LENS
    for i, seq_len in enumerate(seq_lens):
        problem = _problem(
            [seq_len],
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            q_dtype=torch.float32,
            cache_dtype=CACHES[cache],
            block_size=32 if i % 2 else 16,
            seed=seq_len,
        )
        _check(problem, expect_parts=_parts(threads, kv_heads, seq_len))


@pytest.mark.parametrize("kernel", ["avx2", "bf16-dot"])
def test_the_decode_kernels_that_take_fp32_q_split_too(kernel, monkeypatch):
    """fp32 q over a bf16 / fp8 cache runs the group-sharing kernel under either setting."""
    monkeypatch.setenv("TRILLM_CPU_ATTENTION_THREADS", "2")
    for cache in (torch.bfloat16, torch.float8_e4m3fn):
        problem = _problem(
            [700], heads=9, kv_heads=3, head_dim=64, q_dtype=torch.float32, cache_dtype=cache
        )
        _check(problem, expect_parts=6, kernel=kernel)


@pytest.mark.parametrize("window", [8, 64, 100, 200])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_windows_and_soft_caps(window, softcap, monkeypatch):
    """The parts come from the context length, not the window: a window shorter than the
    context leaves the later parts empty (m -inf, l 0: weight 0 in the merge)."""
    monkeypatch.setenv("TRILLM_CPU_ATTENTION_THREADS", "2")
    problem = _problem([300], heads=9, kv_heads=3, head_dim=64, q_dtype=torch.float32, seed=7)
    _check(problem, expect_parts=6, window=window, softcap=softcap)


def test_sinks_fold_in_after_the_merge(monkeypatch):
    monkeypatch.setenv("TRILLM_CPU_ATTENTION_THREADS", "2")
    q, kv, qsl, seq_lens, table = problem = _problem(
        [500], heads=8, kv_heads=2, head_dim=64, q_dtype=torch.float32, cache_dtype=torch.float32
    )
    sinks = torch.linspace(-2.0, 6.0, 8)
    new, parts = _run(problem, split=True, sinks=sinks)
    old, _ = _run(problem, split=False, sinks=sinks)
    assert parts == 4
    torch.testing.assert_close(new, old, rtol=0, atol=4e-6)
    ref = _fp64_reference(problem, sinks=sinks)
    torch.testing.assert_close(new.double(), ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize("threads", [2, 3])
def test_the_same_bits_every_run(threads, monkeypatch):
    """The parts and their merge order are fixed by the plan: however the pool's threads claim
    the parts, the same bits."""
    monkeypatch.setenv("TRILLM_CPU_ATTENTION_THREADS", str(threads))
    problem = _problem([2000], heads=9, kv_heads=3, head_dim=64, q_dtype=torch.float32, seed=3)
    first, parts = _run(problem, split=True)
    assert parts == 6  # 3 kv heads x 2 parts on 2 threads and on 3
    for _ in range(20):
        assert torch.equal(_run(problem, split=True)[0], first)


def test_whole_items_where_they_fill_the_threads_and_for_bf16_q(monkeypatch):
    """No parts at one thread, with items >= 2x the threads (batch 2 of 3 kv heads on 2
    threads), for bf16 q; the same bits as the unsplit run there."""
    monkeypatch.setenv("TRILLM_CPU_ATTENTION_THREADS", "1")
    one = _problem([400], heads=9, kv_heads=3, head_dim=64, q_dtype=torch.float32)
    assert torch.equal(*(_check(one, expect_parts=0) for _ in range(2)))
    monkeypatch.setenv("TRILLM_CPU_ATTENTION_THREADS", "2")
    two = _problem([400, 300], heads=9, kv_heads=3, head_dim=64, q_dtype=torch.float32)
    assert torch.equal(_run(two, split=True)[0], _run(two, split=False)[0])
    assert _run(two, split=True)[1] == 0
    bf16 = _problem([400], heads=9, kv_heads=3, head_dim=64)
    new, parts = _run(bf16, split=True, kernel="bf16-dot")
    assert parts == 0 and torch.equal(new, _run(bf16, split=False, kernel="bf16-dot")[0])


def test_nan_in_unused_slots_stays_out(monkeypatch):
    """The last part ends mid-block: the NaN past the row's last key is never read."""
    monkeypatch.setenv("TRILLM_CPU_ATTENTION_THREADS", "2")
    problem = _problem([1000], heads=9, kv_heads=3, head_dim=64, q_dtype=torch.float32)
    assert problem[1].isnan().any()
    assert not _check(problem, expect_parts=6).isnan().any()


def test_the_generic_fallback_splits_too(monkeypatch):
    """CPUs without AVX2 run the same one-row kernel built for them: parts and merge as here."""
    if paged_attention_cpu.kernel() != "avx2":
        pytest.skip("the generic kernel is the one in use: covered above")
    monkeypatch.setenv("TRILLM_CPU_ATTENTION_THREADS", "2")
    problem = _problem([300], heads=9, kv_heads=3, head_dim=64, q_dtype=torch.float32, seed=5)
    with paged_attention_cpu.use_kernel("generic"):
        _check(problem, expect_parts=6, softcap=30.0)
