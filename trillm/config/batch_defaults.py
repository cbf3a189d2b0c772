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

On CPU both defaults scale with the world size (pipeline x tensor-parallel ranks), and the
batch's size (``max_num_seqs``) follows the same split: 256 for the offline class, 128 for the
server and anything else. On a GPU, vLLM's table by the device's memory: 70 GiB or more (not
an A100) 16,384 / 8,192 tokens and 1,024 sequences; otherwise 8,192 / 2,048 and 256.

As in vLLM (``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args``), a default
follows the other value where that one is given: the budget left unset is at most
``max_num_seqs`` x ``max_model_len``, the batch size left unset at most the budget (so
``max_num_batched_tokens=16`` alone runs at most 16 sequences). What vLLM refuses of the
result: ``trillm/config/scheduler_checks.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

GIB = 1 << 30


class UsageContext(Enum):
    """What made the engine (vLLM's names)."""

    LLM_CLASS = "LLM_CLASS"  # trillm.LLM
    OPENAI_API_SERVER = "OPENAI_API_SERVER"  # trillm serve
    ENGINE_CONTEXT = "ENGINE_CONTEXT"  # open_engine, AsyncLLM, the batch runner


# vLLM's SchedulerConfig defaults: what any other maker of an engine gets.
OTHER_STEP_BUDGET = 2048
OTHER_MAX_NUM_SEQS = 128


@dataclass(frozen=True)
class BatchLimits:
    """The step's token budget and the batch's most requests."""

    max_num_batched_tokens: int
    max_num_seqs: int


@dataclass(frozen=True)
class Device:
    """What the defaults depend on: the device kind, its memory and name (GPUs), the ranks."""

    kind: str  # "cpu" or "cuda"
    world_size: int = 1
    memory_bytes: int = 0
    name: str = ""


def _table(device: Device) -> dict[UsageContext, BatchLimits]:
    if device.kind == "cpu":
        w = device.world_size
        return {
            UsageContext.LLM_CLASS: BatchLimits(4096 * w, 256 * w),
            UsageContext.OPENAI_API_SERVER: BatchLimits(2048 * w, 128 * w),
        }
    if device.memory_bytes >= 70 * GIB and "a100" not in device.name.lower():
        return {
            UsageContext.LLM_CLASS: BatchLimits(16384, 1024),
            UsageContext.OPENAI_API_SERVER: BatchLimits(8192, 1024),
        }
    return {
        UsageContext.LLM_CLASS: BatchLimits(8192, 256),
        UsageContext.OPENAI_API_SERVER: BatchLimits(2048, 256),
    }


def batch_limits(
    tokens: int | None, seqs: int | None, usage: UsageContext, device: Device, max_model_len: int
) -> BatchLimits:
    """``tokens`` / ``seqs`` where given, else ``usage``'s defaults on ``device``, each default
    capped by the other value as vLLM caps it (the budget by ``seqs`` x ``max_model_len``, the
    batch by the budget). Unchecked (``scheduler_checks.check_batch_limits``)."""
    default = _table(device).get(usage, BatchLimits(OTHER_STEP_BUDGET, OTHER_MAX_NUM_SEQS))
    num_seqs = default.max_num_seqs if seqs is None else seqs
    budget = tokens
    if budget is None:
        budget = min(default.max_num_batched_tokens, num_seqs * max_model_len)
    if seqs is None:
        num_seqs = min(num_seqs, budget)
    return BatchLimits(budget, num_seqs)


def device_facts(kind: str, world_size: int) -> Device:
    """``kind``'s memory and name where it is a GPU (vLLM's small-GPU row when unknown)."""
    if kind != "cuda":
        return Device(kind, world_size)
    try:
        import torch

        props = torch.cuda.get_device_properties(0)
        return Device(kind, world_size, int(props.total_memory), str(props.name))
    except (ImportError, RuntimeError, AssertionError):
        return Device(kind, world_size)
