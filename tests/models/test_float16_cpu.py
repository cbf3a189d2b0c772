"""``--dtype float16`` on CPU, as vLLM's CPU backend serves it: weights, activations and the KV
cache in fp16, every op summing in fp32 and rounding to fp16 (the linears through the F16C GEMM).

A tiny Llama and a tiny Qwen2 (q/k/v biases, tied embedding) generate batched prompts of
different lengths, in 32-token prefill chunks, two of them sharing a prefix-cache hit: greedy
tokens equal transformers' fp16 model token for token, and each token's log-probability is
within LOGPROB_TOL of transformers' (measured 2026-12-07: at most 0.0114 for Llama, 0.0079 for
Qwen2). fp8 weights, GGUF-quantized weights and a LoRA adapter on an fp16 model give the same
tokens as on the fp32 model (up to an fp16/fp32 near-tie: vLLM's top-5 rule); model types whose
activations overflow fp16 are refused by name, as vLLM does.
"""

from __future__ import annotations

import logging

import pytest
import torch

from trillm import LLM, LoRARequest, SamplingParams
from trillm.config import EngineArgs
from trillm.model_executor.model_config import UnsupportedDtypeError

MAX_NEW = 8
LOGPROB_TOL = 0.03
ENGINE = dict(distributed_executor_backend="uni", max_model_len=256, kv_cache_memory="8MiB")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 4096, (20,), generator=g).tolist()  # a prefix-cache hit
    prompts = [torch.randint(3, 4096, (n,), generator=g).tolist() for n in (5, 23, 41, 12)]
    return [*prompts, shared + [7, 8, 9], shared + [10, 11]]


def _hf_fp16(path: str, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16).eval()
    gen = transformers.GenerationConfig(
        do_sample=False,
        max_new_tokens=MAX_NEW,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    refs = []
    with torch.no_grad():
        for prompt in prompts:
            out = hf.generate(torch.tensor([prompt]), generation_config=gen)
            tokens = out.sequences[0, len(prompt) :].tolist()
            logprobs = [
                float(torch.log_softmax(step[0].float(), dim=-1)[tok])
                for step, tok in zip(out.logits, tokens, strict=True)
            ]
            refs.append((tokens, logprobs))
    return refs


def _run(model: str, prompts, lora: LoRARequest | None = None, **engine):
    """Each prompt's greedy completion (top-5 logprobs per step)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    with LLM(model, **{**ENGINE, **engine}) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=lora
        )
    return [out.outputs[0] for out in outs]


def _generate(model: str, prompts, lora: LoRARequest | None = None, **engine):
    results = []
    for completion in _run(model, prompts, lora, **engine):
        tokens = list(completion.token_ids)
        logprobs = [step[t].logprob for step, t in zip(completion.logprobs, tokens, strict=True)]
        results.append((tokens, logprobs))
    return results


def _assert_close(got, want) -> None:
    """vLLM's ``check_logprobs_close``: equal tokens up to the first divergence, where each
    side's token is in the other's top-5 (an fp16/fp32 near-tie), then no more is compared."""
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        for step, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
            if ta != tb:
                assert ta in b.logprobs[step] and tb in a.logprobs[step], f"prompt {i}, {step}"
                break


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float16_equals_transformers_float16(tiny_model_factory, arch):
    path = tiny_model_factory(arch)
    prompts = _prompts()
    refs = _hf_fp16(path, prompts)
    got = _generate(path, prompts, dtype="float16", max_num_seqs=8, max_num_batched_tokens=32)
    for i, ((tokens, logprobs), (ref_tokens, ref_logprobs)) in enumerate(
        zip(got, refs, strict=True)
    ):
        assert tokens == ref_tokens, f"prompt {i}: {tokens} != {ref_tokens}"
        assert logprobs == pytest.approx(ref_logprobs, abs=LOGPROB_TOL), f"prompt {i}"


def test_float16_keeps_weights_and_kv_cache_in_float16(tiny_model_factory, caplog):
    from trillm.attention.torch_backend import TorchAttentionBackend
    from trillm.engine.config_builder import build_config
    from trillm.kernels import linear_fp16_cpu
    from trillm.model_executor.loader import build_model
    from trillm.worker import kv_cache_sizing

    with caplog.at_level(logging.INFO):
        config = build_config(EngineArgs(model=tiny_model_factory("llama"), dtype="float16"))
    assert "dtype float16 on CPU" in caplog.text
    assert config.model.dtype == "float16" and config.cache.cache_dtype == "float16"
    assert kv_cache_sizing.kv_cache_dtype(config) == torch.float16
    model = build_model(config.model, TorchAttentionBackend(), "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if linear_fp16_cpu.available():
        assert all(hasattr(m, "packed_weight") for m in linears)


def test_float16_refused_for_model_types_that_overflow(tiny_model_factory):
    with pytest.raises(
        UnsupportedDtypeError, match="dtype float16 is not supported for model type 'gemma2'"
    ):
        LLM(tiny_model_factory("gemma2"), dtype="float16", **ENGINE)


@pytest.fixture(scope="module")
def qwen2(tiny_model_factory):
    path = tiny_model_factory("qwen2")
    return path, _run(path, _prompts()[:3], dtype="float32")


def test_fp8_weights_on_float16(qwen2):
    path, _ = qwen2
    prompts = _prompts()[:3]
    want = _run(path, prompts, dtype="float32", quantization="fp8")
    _assert_close(_run(path, prompts, dtype="float16", quantization="fp8"), want)


def test_gguf_weights_on_float16(qwen2, tmp_path):
    from trillm.testing.gguf_models import write_tiny_gguf

    path, _ = qwen2
    gguf = str(write_tiny_gguf(path, tmp_path, {"attn_q": "Q8_0", "ffn_up": "Q4_0"}))
    prompts = _prompts()[:3]
    want = _run(gguf, prompts, dtype="float32", tokenizer=path)
    _assert_close(_run(gguf, prompts, dtype="float16", tokenizer=path), want)


def test_lora_on_float16(qwen2, tmp_path):
    from trillm.testing.lora_adapters import build_peft_adapter

    path, base = qwen2
    lora = LoRARequest("all", 1, str(build_peft_adapter(path, tmp_path / "all", seed=1)))
    prompts = _prompts()[:3]
    want = _run(path, prompts, lora, dtype="float32", enable_lora=True)
    got = _run(path, prompts, lora, dtype="float16", enable_lora=True)
    _assert_close(got, want)
    assert [c.token_ids for c in got] != [c.token_ids for c in base]  # the adapter applies
