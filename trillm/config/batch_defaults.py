"""The step's token budget when ``max_num_batched_tokens`` is left unset, by what made the
engine, as vLLM picks it on CPU (``EngineArgs.get_batch_defaults`` by ``UsageContext``): its
``LLM`` class 4,096, its OpenAI server 2,048, anything else (an engine made directly, the batch
runner) ``SchedulerConfig``'s 2,048. A value given wins, whoever made the engine.

Why 2,048 suits the server on CPU: vLLM's scheduler, like trillm's, fills the budget with the
waiting prompts in order, chunking the last: 16 prompts arriving together finish budget /
prompt_len at a time, so a smaller budget lowers their mean TTFT ((n/k + 1) / 2 steps of k
prompts each) as long as the GEMMs keep their rate at the step's rows (flat from 128 rows at
Llama-3.2-1B's shape, from ~1,024 at SmolLM2-135M's:
benchmarks/kernels/results/gemm_rows_plateau_20261207.txt). A prompt longer than the budget is
prefilled in chunks of it; on CPU the later chunks' attention runs at the fresh-prompt kernel's
rate, so the chunk size barely moves an 8,192-token prompt's cost at the 1B shape (process CPU
24.5-25.7 s at 1024-4096, 27.8 s as one chunk:
benchmarks/engine/results/prefill_breakdown_1b2l_8k_chunk_sizes.txt). The offline class, whose
batch is handed over whole and judged by its throughput, takes vLLM's larger budget.

NOTE: vLLM multiplies the LLM class's and the server's CPU defaults by the world size
(pipeline x tensor parallel ranks); trillm's stay per engine core.
"""

from __future__ import annotations

from enum import Enum


class UsageContext(Enum):
    """What made the engine (vLLM's names)."""

    LLM_CLASS = "LLM_CLASS"  # trillm.LLM
    OPENAI_API_SERVER = "OPENAI_API_SERVER"  # trillm serve
    ENGINE_CONTEXT = "ENGINE_CONTEXT"  # open_engine, AsyncLLM, the batch runner


STEP_BUDGETS = {UsageContext.LLM_CLASS: 4096, UsageContext.OPENAI_API_SERVER: 2048}
OTHER_STEP_BUDGET = 2048  # vLLM's SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS


def max_num_batched_tokens(requested: int | None, usage: UsageContext) -> int:
    """The step's token budget: ``requested`` where given, else ``usage``'s default."""
    if requested is not None:
        return requested
    return STEP_BUDGETS.get(usage, OTHER_STEP_BUDGET)
