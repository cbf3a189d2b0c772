"""LLaVA under tensor and pipeline parallelism (tests/parallel/test_llava_*_parallel.py): the
shared vision-language checks (``vlm_parallel.py``) with LLaVA's placeholder and reference."""

from __future__ import annotations

from typing import Any

from llava_reference import hf_llava_greedy
from vlm_parallel import Family, parallel_equals, run_uni

LLAVA = Family(
    "<image>",
    hf_llava_greedy,
    vision=("vision_tower.", "multi_modal_projector."),
    modules=("vision_tower", "multi_modal_projector"),
)


def parallel_equals_uni(path: str, **parallel: Any) -> str:
    """``vlm_parallel.parallel_equals`` against a one-rank run of its own."""
    return parallel_equals(run_uni(path, LLAVA), path, LLAVA, **parallel)
