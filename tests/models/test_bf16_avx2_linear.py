"""A tiny bf16 Llama through the AVX2 bf16 GEMM (the CPU path without AVX512-BF16): the same
greedy tokens as the engine on torch's bf16 ``F.linear`` and log-probs equal to bf16 rounding,
with batched prompts of different lengths in 16-token prefill chunks. (Against transformers'
own output the bf16 engine is checked in tests/native/test_cpu_gemm_bf16.py: there near-ties
may diverge either way.)"""

from __future__ import annotations

import pytest
import torch

from trillm.kernels import linear_bf16_avx2_cpu, linear_cpu
from trillm.testing.tiny_models import build_tiny_model

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(
        not linear_bf16_avx2_cpu.available(),
        reason="trillm._ext.cpu_kernels is not built or this CPU lacks AVX2/FMA/F16C",
    ),
]
MAX_NEW = 8
# The kernel and torch's bf16 F.linear round fp32 sums of different order, so a layer output
# may land one bf16 step (2^-7 relative) apart; that moves a log-prob by about 2^-7 of a logit
# (the logits here are of order 1), far below the gap between greedy candidates. Seen: 1.9e-6.
LOGPROB_TOL = 0.05


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 4096, (n,), generator=g).tolist() for n in (3, 19, 37, 8)]


def _generate(path, prompts):
    from trillm import LLM, SamplingParams

    llm = LLM(
        str(path),
        dtype="bfloat16",
        max_num_seqs=4,
        max_num_batched_tokens=16,
        distributed_executor_backend="uni",
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    results = []
    for out in outs:
        tokens = list(out.outputs[0].token_ids)
        steps = zip(out.outputs[0].logprobs, tokens, strict=True)
        results.append((tokens, [step[t].logprob for step, t in steps]))
    return results


def test_tiny_bf16_llama_same_tokens_through_the_avx2_kernel(monkeypatch, tmp_path):
    """The engine with the bf16 layers on torch's ``F.linear`` (before) and on the AVX2
    kernel (after): the same greedy tokens, log-probs equal to bf16 rounding."""
    monkeypatch.setattr(linear_cpu, "available_bf16", lambda: False)  # as on an AVX2-only CPU
    path = build_tiny_model("llama", tmp_path / "llama")
    prompts = _prompts()
    with monkeypatch.context() as off:
        off.setattr(linear_bf16_avx2_cpu, "available", lambda: False)
        before = _generate(path, prompts)
    calls = []
    real = linear_bf16_avx2_cpu.linear_bf16
    monkeypatch.setattr(
        linear_bf16_avx2_cpu,
        "linear_bf16",
        lambda *a, **kw: calls.append(1) or real(*a, **kw),
    )
    after = _generate(path, prompts)
    assert calls, "the bf16 layers did not go through the AVX2 kernel"
    worst = 0.0
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(after, before, strict=True):
        assert tokens == want_tokens
        worst = max(worst, *(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)))
    print(f"max |logprob diff| F.linear vs the AVX2 kernel: {worst:.2e}")
    assert worst < LOGPROB_TOL
