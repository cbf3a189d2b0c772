"""The packed-weight CPU GEMM (``ext/cpu_gemm.cpp`` via ``kernels/linear_cpu.py``) against
``torch.nn.functional.linear``, and the model layers routed through it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trillm.kernels import linear_cpu
from trillm.model_executor.layers import linear as linear_layers

pytestmark = pytest.mark.skipif(
    not linear_cpu.available(), reason="trillm._ext.cpu_kernels is not built or no AVX2/FMA"
)


def _close(got: torch.Tensor, want: torch.Tensor, k: int) -> None:
    # fp32, a different summation order over k terms: a few ulps of the largest partial sum
    torch.testing.assert_close(got, want, atol=2e-6 * k**0.5 * 4, rtol=1e-5)


@pytest.mark.parametrize("m", [0, 1, 5, 6, 7, 13, 53, 300])
@pytest.mark.parametrize("n,k", [(1, 1), (15, 3), (16, 64), (17, 40), (1000, 512), (48, 1408)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_torch_linear(m, n, k, bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = linear_cpu.linear(x, linear_cpu.PackedWeight(w), b)
    assert got.shape == (m, n) and got.dtype == torch.float32
    _close(got, F.linear(x, w, b), k)


def _cpu_has_avx512f() -> bool:
    with open("/proc/cpuinfo") as f:
        return " avx512f " in f.read()


needs_avx512 = pytest.mark.skipif(not _cpu_has_avx512f(), reason="no AVX-512F on this CPU")


@needs_avx512
def test_avx512_is_the_default_where_the_cpu_has_it():
    assert linear_cpu.isa() == "avx512"


@needs_avx512
@pytest.mark.parametrize("m", [1, 2, 11, 12, 13, 24, 191, 192, 193, 400])
@pytest.mark.parametrize("n,k", [(1, 1), (16, 8), (17, 33), (40, 64), (48, 70), (1000, 512)])
def test_avx512_and_avx2_kernels_are_bit_identical(m, n, k):
    """One sequential FMA chain over k per output in both kernels, whatever the rows' register
    block (12 x two panels vs 6 x one), the panel pairing (an odd last panel, a part-filled
    one) or the row block."""
    g = torch.Generator().manual_seed(m * 7 + n * 3 + k)
    x, w, b = (
        torch.randn(m, k, generator=g),
        torch.randn(n, k, generator=g),
        torch.randn(n, generator=g),
    )
    packed = linear_cpu.PackedWeight(w)
    for bias in (None, b):
        with linear_cpu.use_isa("avx2"):
            narrow = linear_cpu.linear(x, packed, bias)
        with linear_cpu.use_isa("avx512"):
            wide = linear_cpu.linear(x, packed, bias)
        assert torch.equal(narrow, wide), (m, n, k, bias is None)
        _close(wide, F.linear(x, w, bias), k)
    assert linear_cpu.isa() == "avx512"  # use_isa restores the default


def test_use_isa_refuses_an_unknown_kernel():
    with pytest.raises(ValueError, match="'sse'"), linear_cpu.use_isa("sse"):
        pass


def test_strided_rows_leading_dims_and_a_strided_weight():
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(2, 9, 100, generator=g)
    x = wide[..., 10:74]  # rows strided by 100, last dim contiguous
    w_wide = torch.randn(33, 80, generator=g)
    w = w_wide[:, :64]  # weight rows strided by 80
    got = linear_cpu.linear(x, linear_cpu.PackedWeight(w))
    assert got.shape == (2, 9, 33)
    _close(got, F.linear(x, w), 64)


def test_thread_counts_give_identical_results():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(97, 512, generator=g), torch.randn(700, 512, generator=g)
    packed = linear_cpu.PackedWeight(w)
    previous = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(linear_cpu.linear(x, packed))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_packed_weight_is_a_copy():
    w = torch.randn(20, 8)
    x = torch.randn(3, 8)
    packed = linear_cpu.PackedWeight(w)
    expected = F.linear(x, w)
    w.zero_()
    _close(linear_cpu.linear(x, packed), expected, 8)


def test_bad_inputs_are_value_errors():
    packed = linear_cpu.PackedWeight(torch.randn(10, 8))
    with pytest.raises(ValueError, match="last dim 8"):
        linear_cpu.linear(torch.randn(3, 7), packed)
    with pytest.raises(ValueError, match="fp32"):
        linear_cpu.linear(torch.randn(3, 8, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match="bias"):
        linear_cpu.linear(torch.randn(3, 8), packed, torch.randn(9))
    with pytest.raises(ValueError):
        linear_cpu.PackedWeight(torch.randn(10, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        linear_cpu.PackedWeight(torch.randn(10, 8).t())  # last dim not contiguous


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 96)
        self.down = nn.Linear(96, 32, bias=False)
        self.norm = nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.norm(x))))


def test_pack_cpu_linears_routes_inference_through_the_packed_weights(monkeypatch):
    torch.manual_seed(3)
    model = _Block().eval()
    x = torch.randn(5, 32)
    with torch.inference_mode():
        want = model(x)
    assert linear_layers.pack_cpu_linears(model) == 2
    assert isinstance(model.up.packed_weight, linear_cpu.PackedWeight)
    calls = []
    real = linear_cpu.linear

    def counted(*args, **kwargs):
        calls.append(args[0].shape[-1])
        return real(*args, **kwargs)

    monkeypatch.setattr(linear_cpu, "linear", counted)
    with torch.inference_mode():
        got = model(x)
    assert calls == [32, 96]
    _close(got, want, 96)
    # autograd on: torch's GEMM on the weights unpacked from the packed copies (the originals
    # are dropped), the same values; gradients reach the input
    out = model(x.requires_grad_())
    assert calls == [32, 96] and torch.equal(out.detach(), want)
    out.sum().backward()
    assert x.grad is not None and model.up.weight.numel() == 0


def test_extensions_switch_keeps_torch_linear(python_without_extensions):
    code = (
        "import torch\n"
        "from trillm.kernels import linear_cpu\n"
        "from trillm.model_executor.layers.linear import pack_cpu_linears\n"
        "assert not linear_cpu.available()\n"
        "print(pack_cpu_linears(torch.nn.Linear(4, 4)))\n"
    )
    assert python_without_extensions(code) == "0"
