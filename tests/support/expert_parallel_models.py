"""What the expert-parallel tests share (tests/parallel/test_expert_parallel*.py): the tiny
MoE checkpoints' odd routed-expert intermediate sizes, the log-prob tolerance against the
single-rank engine, and ``tokens_and_logprobs``, an engine's greedy tokens with their
log-probs."""

from __future__ import annotations

from parallel_models import MAX_TOKENS
from parallel_reference import greedy

from trillm.engine.llm import LLM

LOGPROB_TOL = 1e-4
# Odd routed-expert intermediate sizes, which tensor parallelism without expert parallelism
# refuses (it splits each expert's intermediate size over the ranks); Qwen2-MoE's shared
# expert and dense layer stay tensor-parallel, split in halves.
ODD_EXPERTS = {
    "mixtral": {"intermediate_size": 37},
    "qwen2_moe": {"moe_intermediate_size": 33},
    "qwen3_moe": {"moe_intermediate_size": 29},
}


def tokens_and_logprobs(llm: LLM, prompts: list[str]) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens (MAX_TOKENS) and the log-prob of each."""
    params = greedy(MAX_TOKENS)
    params.logprobs = 0
    outs = llm.generate(prompts, params, use_tqdm=False)
    result = []
    for out in outs:
        comp = out.outputs[0]
        logprobs = [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)]
        result.append((list(comp.token_ids), logprobs))
    return result
