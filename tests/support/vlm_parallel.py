"""Vision-language models under tensor and pipeline parallelism (tests/parallel/
test_*_parallel.py of LLaVA, Qwen2-VL, Gemma 3, LLaVA-OneVision): a batch mixing image and
text-only requests, prefill chunked across the image spans, and the checks that a parallel
layout gives the one-rank engine's greedy tokens and log-probs and transformers' tokens, and
that with pipeline parallelism only the first stage reads and builds the vision side."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llava_reference import image

from trillm.engine.llm import LLM
from trillm.sampling_params import SamplingParams

TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, logprobs=1)
Run = list[tuple[list[int], list[int], list[float]]]  # (prompt ids, tokens, their log-probs)


@dataclass(frozen=True)
class Family:
    """What the checks need of one model family."""

    image: str  # the prompt text that stands for one image
    reference: Callable[..., tuple[Any, ...]]  # transformers: (ids, tokens[, log-probs])
    vision: tuple[str, ...]  # the vision side's checkpoint name prefixes
    modules: tuple[str, ...]  # the model's vision-side attributes
    budget: int = 16  # max_num_batched_tokens: the image prompts' prefill in chunks
    videos: tuple[Any, ...] = ()  # video prompts batched with the rest (one video each)
    max_model_len: int = 512  # at most the checkpoint's max_position_embeddings

    def prompts(self) -> list[Any]:
        return [
            {"prompt": f"Describe {self.image} now", "multi_modal_data": {"image": image(0)}},
            "The license grants",
            {
                "prompt": f"{self.image} a {self.image} b",
                "multi_modal_data": {"image": [image(1), image(2, (64, 32))]},
            },
            *self.videos,
        ]

    def limits(self) -> dict[str, int]:
        """limit_mm_per_prompt for ``prompts``."""
        return {"image": 2, **({"video": 1} if self.videos else {})}

    def first_items(self) -> list[Any]:
        """The first prompt's items, as ``reference`` takes them."""
        return [image(0)]


def run(path: str, family: Family, **kwargs: Any) -> Run:
    """(prompt ids, greedy tokens, their log-probs) of each of ``family``'s prompts."""
    with LLM(
        path,
        max_model_len=family.max_model_len,
        kv_cache_memory="8MiB",
        max_num_batched_tokens=family.budget,
        limit_mm_per_prompt=family.limits(),
        **kwargs,
    ) as llm:
        outs = llm.generate(family.prompts(), GREEDY, use_tqdm=False)
    return [
        (
            list(o.prompt_token_ids),
            list(o.outputs[0].token_ids),
            [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)],
        )
        for o in outs
    ]


def run_uni(path: str, family: Family) -> Run:
    return run(path, family, distributed_executor_backend="uni")


def parallel_equals(one: Run, path: str, family: Family, **parallel: Any) -> str:
    """Asserts the ``parallel`` layout's prompt ids and tokens equal the one-rank engine's
    (``one``: ``run_uni``'s) and the first prompt's equal transformers' (and its log-probs,
    where the reference gives them); returns the largest log-prob differences (< 1e-4)."""
    two = run(path, family, **parallel)
    assert [r[:2] for r in two] == [r[:2] for r in one]
    diff = max(abs(a - b) for r1, r2 in zip(one, two) for a, b in zip(r1[2], r2[2]))
    assert diff < 1e-4, diff
    reference = family.reference(
        path, f"Describe {family.image} now", family.first_items(), n=TOKENS
    )
    ids, tokens, logprobs = two[0]
    assert (ids, tokens) == (reference[0], reference[1])
    figures = f"max |logprob diff| vs one rank {diff:.2e}"
    if len(reference) > 2:  # [P + n, V] log-softmax, row i scoring token i + 1
        rows = [float(reference[2][len(ids) - 1 + i, t]) for i, t in enumerate(tokens)]
        hf_diff = max(abs(a - b) for a, b in zip(logprobs, rows))
        assert hf_diff < 1e-4, hf_diff
        figures += f", vs transformers {hf_diff:.2e}"
    return figures


def assert_vision_on_first_stage(path: str, family: Family) -> None:
    """Under pipeline_parallel_size 2 only stage 0's loader reads the vision side's tensors
    and only stage 0 builds its modules (the other stage's are ``PPMissingLayer``)."""
    from safetensors import safe_open

    from trillm.attention.selector import get_attention_backend
    from trillm.config import EngineArgs
    from trillm.distributed.pipeline import PipelineGroup, PPMissingLayer, set_pp_group
    from trillm.engine.config_builder import build_config
    from trillm.model_executor.loader import build_model, safetensors_files, stage_filter

    cfg = build_config(EngineArgs(path, pipeline_parallel_size=2)).model
    names = []
    for file in safetensors_files(path):
        with safe_open(file, "pt") as f:
            names += list(f.keys())
    vision = [k for k in names if k.startswith(family.vision)]
    assert vision and len(vision) < len(names)
    for stage in (0, 1):
        set_pp_group(PipelineGroup(stage, 2, start_layer=stage, end_layer=stage + 1))
        try:
            wanted = stage_filter(cfg)
            assert wanted is not None
            assert [wanted(k) for k in vision] == [stage == 0] * len(vision)
            model = build_model(cfg, get_attention_backend("torch", "cpu"), "cpu")
        finally:
            set_pp_group(PipelineGroup())
        for name in family.modules:
            assert isinstance(getattr(model, name), PPMissingLayer) == (stage == 1), name
