"""What the multimodal model tests through the Python API share (Llama 4, LLaVA-OneVision,
Gemma 3 and Qwen2-Audio in tests/models): the sampling they compare with transformers', the
in-process engine of a module, a prompt with its media, the encoder's call count, the check
of a batch's prompt ids, greedy tokens and log-probabilities against transformers', and of
preempted requests resuming."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from engine_waves import concurrent_requests
from qwen2_vl_reference import max_logprob_diff

from trillm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SCORED = SamplingParams(
    temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1, prompt_logprobs=1
)
UNI = {"kv_cache_memory": "8MiB", "distributed_executor_backend": "uni"}

# (checkpoint folder, prompt text, media) -> transformers' (prompt ids, greedy tokens, logprobs)
HfGreedy = Callable[[str, str, list[Any]], tuple[list[int], list[int], Any]]


def module_llm(path: str, **options: Any) -> Iterator[LLM]:
    """A test module's engine, in this process (``yield from`` in its fixture), shut down at
    the module's end."""
    engine = LLM(path, **{**UNI, **options})
    yield engine
    engine.shutdown()


def as_prompt(text: str, media: list[Any], modality: str = "image") -> object:
    return {"prompt": text, "multi_modal_data": {modality: media}} if media else text


def encoder_calls(engine: LLM) -> int:
    return engine.engine.cores[0].executor.runner.mm.encoder_calls


def batch_logprob_diff(path: str, cases: list, outs: list, hf_greedy: HfGreedy) -> float:
    """Each output's prompt ids and greedy tokens equal transformers' for its (text, media)
    case -> the largest |log-probability difference| over the prompts and samples."""
    worst = 0.0
    for (text, media), out in zip(cases, outs, strict=True):
        ids, tokens, logprobs = hf_greedy(path, text, media)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == tokens
        worst = max(worst, max_logprob_diff(out, ids, logprobs))
    return worst


def check_preempted_resume(
    path: str, cases: list, prompts: list, hf_greedy: Callable[..., Any], **engine: Any
) -> None:
    """``prompts`` (one per (text, media) case) at once on a KV cache too small for them
    (``engine``: the options that make it so): preempted, each resumes to transformers' 24
    greedy tokens."""
    expected = [hf_greedy(path, text, media, n=24)[1] for text, media in cases]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    got, stats = concurrent_requests(
        path, prompts, params, block_size=16, distributed_executor_backend="uni", **engine
    )
    assert got == expected
    assert stats.num_preemptions > 0, "the small KV cache should have forced preemption"
