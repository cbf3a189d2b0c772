"""The bf16 CPU GEMM (``ext/cpu_gemm_bf16.cpp`` via ``kernels/linear_cpu.py``) against a torch
reference (the bf16 values multiplied in fp32), the bf16 model layers routed through it, and a
``--dtype bfloat16`` model's greedy output against transformers in bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trillm.kernels import linear_bf16_avx2_cpu, linear_cpu
from trillm.model_executor.layers import linear as linear_layers

needs_kernel = pytest.mark.skipif(
    not linear_cpu.available_bf16(),
    reason="trillm._ext.cpu_kernels is not built or this CPU lacks AVX512-BF16",
)
bf16 = torch.bfloat16

# (out_features, in_features) of the embedded default model (hidden 192, MLP 512, 6 / 2 heads
# of 32, vocab 4096) and of SmolLM2-135M (hidden 576, MLP 1536, 9 / 3 heads of 64).
DEFAULT_MODEL_SHAPES = [(320, 192), (192, 192), (1024, 192), (192, 512), (4096, 192)]
SMOLLM2_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def _reference(x, w, b=None):
    """The exact products of the bf16 values, summed in fp32 (torch's order)."""
    return F.linear(x.to(bf16).float(), w.float(), None if b is None else b.float())


def _close_fp32(got, want, k):
    # fp32 sums of k exact products in another order: a few ulps of the partial sums
    torch.testing.assert_close(got, want, rtol=1e-5, atol=4e-6 * k**0.5)


def _close_bf16(got, want, k):
    """``got`` (bf16) is ``want`` (fp32) rounded, up to one bf16 step where the fp32 sums differ
    in their last bits across a rounding boundary (rare: checked by the share of exact ones)."""
    assert got.dtype == bf16
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=4e-6 * k**0.5)
    if want.numel() >= 1000:
        assert (got == want.to(bf16)).float().mean().item() > 0.995


def _data(m, n, k, seed, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(bf16)
    w = torch.randn(n, k, generator=g).to(bf16)
    b = torch.randn(n, generator=g).to(bf16) if bias else None
    return x, w, b


@needs_kernel
@pytest.mark.parametrize("m", [0, 1, 5, 6, 7, 13, 193, 300])
@pytest.mark.parametrize("n,k", [(1, 1), (15, 3), (16, 64), (65, 33), (130, 512), (48, 1409)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_fp32_reference(m, n, k, bias):
    x, w, b = _data(m, n, k, m * 1000 + n + k, bias)
    packed = linear_cpu.PackedWeightBf16(w)
    want = _reference(x, w, b)
    got = linear_cpu.linear_bf16(x, packed, b, out_dtype=torch.float32)
    assert got.shape == (m, n) and got.dtype == torch.float32
    _close_fp32(got, want, k)
    got16 = linear_cpu.linear_bf16(x, packed, b)  # bf16 in, bf16 out by default
    assert got16.dtype == bf16
    _close_bf16(got16, want, k)
    # fp32 x is rounded to bf16 first (nearest even, like torch's cast): the same sums
    x32 = x.float() + torch.rand(m, k) * 1e-3
    assert torch.equal(
        linear_cpu.linear_bf16(x32, packed, b, out_dtype=torch.float32),
        linear_cpu.linear_bf16(x32.to(bf16), packed, b, out_dtype=torch.float32),
    )
    assert linear_cpu.linear_bf16(x32, packed, b).dtype == torch.float32


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 8, 16, 64, 256, 2048])
@pytest.mark.parametrize("n,k", DEFAULT_MODEL_SHAPES + SMOLLM2_SHAPES[:2])
def test_model_weight_shapes_from_1_to_2048_rows(m, n, k):
    if m == 2048 and n * k > 600_000:
        pytest.skip("the fp32 reference alone takes seconds at this size")
    x, w, _ = _data(m, n, k, m + n + k)
    packed = linear_cpu.PackedWeightBf16(w)
    want = _reference(x, w)
    _close_fp32(linear_cpu.linear_bf16(x, packed, out_dtype=torch.float32), want, k)
    _close_bf16(linear_cpu.linear_bf16(x, packed), want, k)


@needs_kernel
@pytest.mark.parametrize("n,k", SMOLLM2_SHAPES[2:] + [(49152, 576)])
def test_smollm2_mlp_and_head_shapes(n, k):
    for m in (1, 64):
        x, w, _ = _data(m, n, k, m + n)
        want = _reference(x, w)
        _close_bf16(linear_cpu.linear_bf16(x, linear_cpu.PackedWeightBf16(w)), want, k)


@needs_kernel
def test_bf16_output_matches_torch_bf16_linear_with_a_bf16_bias():
    # torch rounds x.W^T + bias once from fp32 (bias as fp32): the model's numerics in bf16
    x, w, b = _data(37, 300, 576, 5, bias=True)
    got = linear_cpu.linear_bf16(x, linear_cpu.PackedWeightBf16(w), b)
    assert (got == F.linear(x, w, b)).float().mean().item() > 0.995


@needs_kernel
@pytest.mark.parametrize("k", [63, 64])
def test_strided_rows_odd_k_and_a_strided_weight(k):
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(2, 9, 100, generator=g).to(bf16)
    wide[..., 10 + k] = float("nan")  # the element after each row: never read
    x = wide[..., 10 : 10 + k]  # rows strided by 100 (odd offsets: unaligned pairs)
    w = torch.randn(70, 80, generator=g).to(bf16)[:, :k]  # weight rows strided by 80
    got = linear_cpu.linear_bf16(x, linear_cpu.PackedWeightBf16(w), out_dtype=torch.float32)
    assert got.shape == (2, 9, 70) and torch.isfinite(got).all()
    _close_fp32(got, _reference(x, w), k)


@needs_kernel
# 1, 3 (odd: one panel alone), 3, 5 panels; 1000 at k 576 (16 panels) is split over threads
@pytest.mark.parametrize("n", [64, 130, 192, 300, 1000])
@pytest.mark.parametrize("k", [63, 576])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, bf16])
def test_one_row_equals_that_row_of_a_larger_call(n, k, bias, out_dtype):
    # One row walks two panels at once (Bf16Kernel::row_pair; the pairs start where each
    # thread's run of panels does, an odd one left to block<1>); more rows take the register
    # blocks, one panel at a time: the same products and sums, so the same bits, on every
    # thread count.
    x, w, b = _data(7, n, k, 4, bias=bias)
    packed = linear_cpu.PackedWeightBf16(w)
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            rows = linear_cpu.linear_bf16(x, packed, b, out_dtype=out_dtype)
            for i in (0, 3, 6):
                one = linear_cpu.linear_bf16(x[i : i + 1], packed, b, out_dtype=out_dtype)
                assert torch.equal(one[0], rows[i]), (threads, i)
    finally:
        torch.set_num_threads(previous)
    if out_dtype == torch.float32:
        _close_fp32(rows, _reference(x, w, b), k)


@needs_kernel
def test_thread_counts_give_identical_results():
    x, w, _ = _data(97, 700, 512, 2)
    packed = linear_cpu.PackedWeightBf16(w)
    previous = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(linear_cpu.linear_bf16(x, packed, out_dtype=torch.float32))
            outs.append(linear_cpu.linear_bf16(x.float(), packed, out_dtype=torch.float32))
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(outs[0], out) for out in outs[1:])


@needs_kernel
def test_packed_weight_is_a_copy_and_bad_inputs_are_value_errors():
    x, w, _ = _data(3, 20, 8, 4)
    packed = linear_cpu.PackedWeightBf16(w)
    want = _reference(x, w)
    w.zero_()
    _close_fp32(linear_cpu.linear_bf16(x, packed, out_dtype=torch.float32), want, 8)
    with pytest.raises(ValueError, match="last dim 8"):
        linear_cpu.linear_bf16(torch.randn(3, 7), packed)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        linear_cpu.linear_bf16(torch.randn(3, 8, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match="out_dtype"):
        linear_cpu.linear_bf16(x, packed, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="bias"):
        linear_cpu.linear_bf16(x, packed, torch.randn(9))
    with pytest.raises(ValueError):
        linear_cpu.PackedWeightBf16(torch.randn(10, 8))  # fp32
    with pytest.raises(ValueError):
        linear_cpu.PackedWeightBf16(torch.randn(10, 8).to(bf16).t())  # last dim not contiguous


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 96)
        self.down = nn.Linear(96, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


@needs_kernel
def test_pack_cpu_linears_routes_bf16_layers_through_the_kernel(monkeypatch):
    torch.manual_seed(3)
    model = _Block().to(bf16).eval()
    x = torch.randn(5, 32).to(bf16)
    with torch.inference_mode():
        want = model(x)  # torch's bf16 F.linear
    assert linear_layers.pack_cpu_linears(model) == 2
    assert isinstance(model.up.packed_weight, linear_cpu.PackedWeightBf16)
    calls = []
    real = linear_cpu.linear_bf16

    def counted(*args, **kwargs):
        calls.append(args[0].shape[-1])
        return real(*args, **kwargs)

    monkeypatch.setattr(linear_cpu, "linear_bf16", counted)
    with torch.inference_mode():
        got = model(x)
    assert calls == [32, 96] and got.dtype == bf16
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-3)
    # With AMX-BF16 calls of many rows go to torch's (oneDNN AMX) GEMM; without, any count
    monkeypatch.setattr(linear_cpu, "bf16_kernel_max_rows", lambda: 4)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), want, rtol=2**-7, atol=1e-3)
        model(x[:4])
    assert calls == [32, 96, 32, 96]
    monkeypatch.setattr(linear_cpu, "bf16_kernel_max_rows", lambda: None)
    with torch.inference_mode():
        model(torch.randn(3, 100, 32).to(bf16))
    assert calls == [32, 96] * 3
    wide = x.float().requires_grad_()
    out = model(wide.to(bf16))  # autograd on: torch's F.linear on the unpacked weights
    assert calls == [32, 96] * 3 and torch.equal(out.detach(), want)
    out.float().sum().backward()
    assert wide.grad is not None


def test_without_bf16_kernels_layers_keep_torch_linear(monkeypatch):
    # The run-time choice: on a CPU with neither AVX512-BF16 nor AVX2/F16C (the AVX2 bf16
    # kernel: test_cpu_gemm_bf16_avx2.py) nothing is packed (no second copy of the weights)
    # and the layers stay torch's.
    monkeypatch.setattr(linear_cpu, "available_bf16", lambda: False)
    monkeypatch.setattr(linear_bf16_avx2_cpu, "available", lambda: False)
    model = _Block().to(bf16).eval()
    assert linear_layers.pack_cpu_linears(model) == 0
    assert not hasattr(model.up, "packed_weight")
    assert "forward" not in vars(model.up)


def test_extensions_switch_keeps_torch_linear_for_bf16(python_without_extensions):
    code = (
        "import torch\n"
        "from trillm.kernels import linear_cpu\n"
        "from trillm.model_executor.layers.linear import pack_cpu_linears\n"
        "assert not linear_cpu.available_bf16()\n"
        "print(pack_cpu_linears(torch.nn.Linear(4, 4).to(torch.bfloat16)))\n"
    )
    assert python_without_extensions(code) == "0"


# ------------------------------------------------------------------ the real model in bf16

PROMPTS = [
    "In the beginning",
    "And God said",
    "The king of the land",
    "Once upon a time there was",
    "He went into the city and",
    "Blessed are they that",
    "The LORD is my shepherd",
    "And it came to pass",
]


def _hf_bf16_greedy(model, prompt_ids: list[int], max_new_tokens: int):
    """transformers in bf16: (greedy tokens, top-5 token ids at each step), EOS ignored."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            generation_config=config,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    top5 = [step[0].float().topk(5).indices.tolist() for step in out.logits]
    return tokens, top5


def test_default_model_in_bf16_matches_transformers_bf16(monkeypatch):
    """Greedy output of the embedded default model with ``dtype="bfloat16"``, through the
    engine (the bf16 GEMM where the CPU has it), equals transformers' bf16 ``generate`` token
    for token, or at the first divergence each side's token is in the other's top 5 (a
    near-tie: bf16 logits tie exactly more often than fp32 ones)."""
    from trillm import LLM, SamplingParams
    from trillm.default_model import ensure_default_model

    calls = []
    real = linear_cpu.linear_bf16

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(linear_cpu, "linear_bf16", counted)
    n = 24
    engine = LLM(
        None,
        dtype="bfloat16",
        max_model_len=256,
        kv_cache_memory="8MiB",
        distributed_executor_backend="uni",
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=5)
        outs = engine.generate(PROMPTS, params, use_tqdm=False)
    finally:
        engine.shutdown()
    assert bool(calls) == linear_cpu.available_bf16()
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(ensure_default_model()), dtype=bf16).eval()
    equal, report = 0, []
    for prompt, out in zip(PROMPTS, outs, strict=True):
        got = out.outputs[0].token_ids
        want, hf_top5 = _hf_bf16_greedy(hf, out.prompt_token_ids, n)
        if got == want:
            equal += 1
            continue
        i = next(i for i in range(n) if got[i] != want[i])
        ours_top5 = list(out.outputs[0].logprobs[i])
        report.append(f"{prompt!r}: step {i}, ours {got[i]} hf {want[i]}")
        assert got[i] in hf_top5[i] and want[i] in ours_top5, report[-1]
    # most agree token for token: 6 of 8 on 2026-12-01, the other two diverging where
    # transformers' bf16 logits tie exactly (same with torch's F.linear in place of the kernel)
    assert equal >= len(PROMPTS) - 3, report
