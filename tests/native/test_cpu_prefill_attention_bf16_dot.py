"""The fresh-prompt kernel's bf16 products on AVX512-BF16 (``vdpbf16ps``,
ext/cpu_prefill_attention_dp.h) against its AVX2 path and transformers' eager attention.

Both paths round where transformers' bf16 eager attention does; they differ only in the fp32
order of the sums (pairs of products), so a few outputs in ten thousand round the other way.
On a CPU without AVX512-BF16 the switch stays off and the AVX2 path is what runs.
"""

from __future__ import annotations

import pytest
import torch
from paged_batches import HKV, HQ, SCALE, D, hf_eager_attention

from trillm.kernels import paged_attention_cpu

pytestmark = pytest.mark.skipif(
    not paged_attention_cpu.available()
    or not paged_attention_cpu.prefill_supports_layout(torch.bfloat16, HQ, HKV, D),
    reason="trillm._ext.cpu_kernels is not built, or no AVX2/FMA here",
)


def _ext():
    return paged_attention_cpu.cpu_kernels("attention")


@pytest.fixture
def dot_setting():
    """Yields a setter of the switch (-> whether the dot path is on after it); restores it."""
    ext = _ext()
    before = ext.prefill_bf16_dot(True)
    ext.prefill_bf16_dot(before)

    def set_to(on: bool) -> bool:
        ext.prefill_bf16_dot(on)
        return ext.prefill_bf16_dot(on)  # the setting now (the CPU may refuse True)

    yield set_to
    ext.prefill_bf16_dot(before)


def _fused_qkv(lens: list[int], hq: int, hkv: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    gap = 2
    starts = [gap + sum(lens[:i]) + gap * i for i in range(len(lens))]
    rows = starts[-1] + lens[-1] + gap
    qkv = (1.5 * torch.randn(rows, (hq + 2 * hkv) * d, generator=g)).to(torch.bfloat16)
    q = qkv[:, : hq * d].view(rows, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(rows, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(rows, hkv, d)
    segments = torch.tensor([[a, n] for a, n in zip(starts, lens)], dtype=torch.int32)
    return q, k, v, segments, starts


def _run(q, k, v, segments, scale):
    out = torch.full_like(q, 7.0)
    paged_attention_cpu.causal_prefill(q, k, v, segments, scale, out)
    return out


def test_the_dot_path_is_on_where_the_cpu_has_avx512_bf16(dot_setting):
    from trillm.kernels import linear_cpu

    assert dot_setting(True) == linear_cpu.available_bf16()
    assert dot_setting(False) is False


@pytest.mark.parametrize("dot", [True, False], ids=["vdpbf16ps", "avx2"])
def test_each_path_equals_transformers_eager(dot, dot_setting):
    """Lengths around the 64-key tiles, pairs (odd lengths) and 6-row blocks: transformers'
    eager attention up to a few outputs in ten thousand, each within 2^-6; rows between the
    segments untouched."""
    if dot_setting(dot) != dot:
        pytest.skip("the CPU has no AVX512-BF16")
    lens = [1, 2, 5, 63, 64, 65, 127, 130]
    q, k, v, segments, starts = _fused_qkv(lens, HQ, HKV, D, seed=5)
    out = _run(q, k, v, segments, SCALE)
    for a, n in zip(starts, lens):
        r = slice(a, a + n)
        hf = hf_eager_attention(q[r], k[r], v[r], 0)
        assert (out[r] != hf).float().mean().item() < 0.001
        assert (out[r].float() - hf.float()).abs().max() <= 2.0**-6
    assert (out[: starts[0]] == 7.0).all() and (out[starts[1] - 2 : starts[1]] == 7.0).all()


@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 64), (4, 4, 128), (6, 2, 48), (3, 1, 256)], ids=str)
def test_the_two_paths_agree_across_head_layouts(hq, hkv, d, dot_setting):
    """Groups of 1..4 query heads, head sizes 48..256 (one to four 64-column passes of
    P . V): the two paths' outputs are equal but for the fp32 order of their sums."""
    if not dot_setting(True):
        pytest.skip("the CPU has no AVX512-BF16")
    lens = [3, 66, 200]
    q, k, v, segments, starts = _fused_qkv(lens, hq, hkv, d, seed=7)
    dot = _run(q, k, v, segments, d**-0.5)
    dot_setting(False)
    plain = _run(q, k, v, segments, d**-0.5)
    for a, n in zip(starts, lens):
        r = slice(a, a + n)
        assert (dot[r] != plain[r]).float().mean().item() < 0.002
        assert (dot[r].float() - plain[r].float()).abs().max() <= 2.0**-5
    assert torch.isfinite(dot[starts[0] : starts[-1] + lens[-1]].float()).all()


@pytest.mark.parametrize("dot", [True, False], ids=["vdpbf16ps", "avx2"])
def test_a_nan_value_stays_a_quiet_nan_in_its_heads(dot, dot_setting):
    """The output rows' rounding keeps a NaN a quiet NaN (never an infinity): every row of the
    NaN's kv head at or after its position is NaN, the other kv heads and the other segment stay
    finite (rows before it that share its register block may read it times a zero p, as
    eager attention's P @ V does)."""
    if dot_setting(dot) != dot:
        pytest.skip("the CPU has no AVX512-BF16")
    lens = [40, 70]
    q, k, v, segments, starts = _fused_qkv(lens, HQ, HKV, D, seed=11)
    v[starts[1] + 11, 0, 3] = float("nan")
    out = _run(q, k, v, segments, SCALE)
    group = HQ // HKV
    nan = torch.isnan(out.float())
    assert nan[starts[1] + 11 : starts[1] + lens[1], :group].any(dim=-1).all()
    assert not nan[starts[0] : starts[0] + lens[0]].any()
    assert not nan[starts[1] : starts[1] + lens[1], group:].any()
    bits = out.view(torch.int16)[nan].int() & 0x7FC0
    assert (bits == 0x7FC0).all()
