"""LLaVA under tensor and pipeline parallelism (tests/parallel/test_llava_*_parallel.py): a batch
mixing image and text-only requests, prefill chunked across the image spans, and the check that
a parallel layout gives the one-rank engine's greedy tokens and log-probs, and transformers'
tokens."""

from __future__ import annotations

from typing import Any

from llava_reference import hf_llava_greedy, image

from trillm.engine.llm import LLM
from trillm.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
PROMPTS = [
    {"prompt": "Describe <image> now", "multi_modal_data": {"image": image(0)}},
    "The license grants",
    {
        "prompt": "<image> a <image> b",
        "multi_modal_data": {"image": [image(1), image(2, (64, 32))]},
    },
]


def run(path: str, **kwargs: Any) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt ids, greedy tokens, their log-probs) of each prompt."""
    with LLM(
        path,
        max_model_len=128,
        kv_cache_memory="4MiB",
        max_num_batched_tokens=16,  # the image prompts' spans cross chunk boundaries
        limit_mm_per_prompt={"image": 2},
        **kwargs,
    ) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [
        (
            list(o.prompt_token_ids),
            list(o.outputs[0].token_ids),
            [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)],
        )
        for o in outs
    ]


def parallel_equals_uni(path: str, **parallel: Any) -> float:
    """Asserts the ``parallel`` layout's prompt ids and tokens equal the one-rank engine's and
    the first prompt's equal transformers'; returns the largest log-prob difference (< 1e-4)."""
    one = run(path, distributed_executor_backend="uni")
    two = run(path, **parallel)
    assert [r[:2] for r in two] == [r[:2] for r in one]
    diff = max(abs(a - b) for r1, r2 in zip(one, two) for a, b in zip(r1[2], r2[2]))
    assert diff < 1e-4, diff
    reference = hf_llava_greedy(path, "Describe <image> now", [image(0)], n=6)
    assert two[0][:2] == (reference[0], reference[1])
    return diff
