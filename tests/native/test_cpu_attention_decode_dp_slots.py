"""The bf16 decode kernel on AVX512-BF16 that reads each cache slot once for all the kv heads of
a work item (ext/cpu_attention_decode_dp_slots.h, ``paged_decode_kernel("bf16-dot")``) against
the kernel it replaces, which walks the keys once per kv head (``"bf16-dot-per-head"``,
ext/cpu_attention_decode_dp.h): the same scores, softmax and P @ V sums in the same order, so the
same bits, over GQA groups 1-16, head dims 64 / 128, blocks 16 / 32, lengths at the 16- and
32-key tiles and the blocks' edges, 4,097 keys, sliding windows, soft caps, a NaN-filled unused
cache and 1-3 threads; and against the torch twin (transformers' bf16 rounding points) within
the bf16 kernels' usual tolerance."""

from __future__ import annotations

import pytest
import torch

from tests.support.decode_attention import decode_problem as _problem
from tests.support.decode_attention import run_decode as _run
from trillm.kernels import paged_attention_cpu, paged_attention_torch

pytestmark = pytest.mark.skipif(
    not paged_attention_cpu.available(), reason="trillm._ext.cpu_kernels is not built"
)

NEW, OLD = "bf16-dot", "bf16-dot-per-head"
# one key, the tiles' and blocks' edges +-1, a few thousand
SEQ_LENS = [1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 300, 4097]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert not a.isnan().any()
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim",
    [
        (9, 3, 64),  # SmolLM2-135M: group 3
        (32, 8, 64),  # Llama-3.2-1B: group 4
        (16, 8, 128),  # Qwen3-1.7B: group 2
        (8, 8, 128),  # group 1
        (16, 1, 64),  # group 16
        (16, 2, 128),  # group 8
    ],
)
@pytest.mark.parametrize("block_size", [16, 32])
def test_same_bits_as_per_head_kernel(heads, kv_heads, head_dim, block_size, monkeypatch):
    monkeypatch.setenv("TRILLM_CPU_ATTENTION_THREADS", "1")
    problem = _problem(
        SEQ_LENS, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size
    )
    _same_bits(_run(problem, NEW), _run(problem, OLD))


def test_near_torch_twin_and_can_fail():
    problem = _problem(SEQ_LENS[:-1], heads=9, kv_heads=3, head_dim=64)
    new = _run(problem, NEW)
    q, kv, qsl, seq_lens, table = problem
    twin = paged_attention_torch.paged_attention(q, kv, qsl, seq_lens, table, 64**-0.5)
    assert (new != twin).float().mean().item() <= 0.01
    assert (new.float() - twin.float()).abs().max().item() <= 2.0**-5
    # the test can fail: another cache gives other outputs
    other = _problem(SEQ_LENS[:-1], heads=9, kv_heads=3, head_dim=64, seed=1)
    assert (new.float() - _run(other, NEW).float()).abs().max() > 0.1


@pytest.mark.parametrize("window,softcap", [(9, None), (None, 1.5), (40, 30.0), (1, None)])
def test_window_and_softcap_same_bits(window, softcap):
    problem = _problem([1, 8, 9, 17, 70, 200, 1000], heads=9, kv_heads=3, head_dim=64, seed=3)
    new = _run(problem, NEW, window=window, softcap=softcap)
    _same_bits(new, _run(problem, OLD, window=window, softcap=softcap))
    # the test can fail: without the window (or cap) the rows differ
    assert not torch.equal(new, _run(problem, NEW))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("batch,keys", [(1, 1025), (16, 300)])
def test_thread_counts_same_bits(threads, batch, keys, monkeypatch):
    """Batch 1 (an item per kv head) and batch 16 (every kv head of a row in one item)."""
    monkeypatch.setenv("TRILLM_CPU_ATTENTION_THREADS", str(threads))
    problem = _problem([keys] * batch, heads=9, kv_heads=3, head_dim=64, seed=4)
    _same_bits(_run(problem, NEW), _run(problem, OLD))


def test_long_context_takes_kv_heads_in_turns(monkeypatch):
    """8,200 keys x group 4 x 4 bytes of scores a kv head: fewer kv heads than the item's at
    once (the score rows' bound), still the same bits."""
    monkeypatch.setenv("TRILLM_CPU_ATTENTION_THREADS", "1")
    problem = _problem([8200, 20, 20, 20], heads=32, kv_heads=8, head_dim=64, seed=5)
    _same_bits(_run(problem, NEW), _run(problem, OLD))
