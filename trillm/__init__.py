"""trillm: an LLM inference server on Trio structured concurrency.

Layout (the request lifecycle of docs/architecture.md, stage by stage):
  entrypoints/   stages 1-3 and 11: the OpenAI-compatible server, the CLI
  engine/        stages 4 and 10: AsyncEngine (open_engine), LLM, AsyncLLM, input/output processing
  core/          P1 and P4 of step(): scheduler and KV block manager (native twins in ext/)
  executor/      worker subprocesses and the shared-memory rings that feed them (ipc/)
  worker/        P2 and P3: model runner, persistent batch, KV cache
  model_executor/ model loading and the model definitions
  attention/     attention backends behind one interface
  kernels/       a link to the repository's kernels/ (Triton, native CPU and torch kernels per op;
                 no __init__.py, model code calls trillm.kernels.dispatch)
  sample/        the batched sampler
  lora/          LoRA adapters: PEFT loading, batched deltas, admission
  bench/         ``trillm bench``

The public API is re-exported here; heavy modules load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trillm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

__version__ = "0.1.0"

_LAZY = {
    "LLM": "trillm.engine.llm",
    "AsyncLLM": "trillm.engine.async_llm",
    "AsyncEngine": "trillm.engine.async_engine",
    "open_engine": "trillm.engine.engine_startup",
    "EngineArgs": "trillm.config",
    "RequestOutput": "trillm.outputs",
    "BeamSearchOutput": "trillm.outputs",
    "BeamSearchSequence": "trillm.outputs",
    "CompletionOutput": "trillm.outputs",
    "Logprob": "trillm.outputs",
    "PoolingRequestOutput": "trillm.outputs",
    "EngineDeadError": "trillm.errors",
    "LoRARequest": "trillm.lora.request",
}

if TYPE_CHECKING:
    from trillm.config import EngineArgs
    from trillm.engine.async_engine import AsyncEngine
    from trillm.engine.async_llm import AsyncLLM
    from trillm.engine.engine_startup import open_engine
    from trillm.engine.llm import LLM
    from trillm.errors import EngineDeadError
    from trillm.lora.request import LoRARequest
    from trillm.outputs import (
        BeamSearchOutput,
        BeamSearchSequence,
        CompletionOutput,
        Logprob,
        PoolingRequestOutput,
        RequestOutput,
    )


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trillm' has no attribute {name!r}")


__all__ = [
    "LLM",
    "AsyncEngine",
    "AsyncLLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EngineArgs",
    "EngineDeadError",
    "Logprob",
    "LoRARequest",
    "PoolingRequestOutput",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "__version__",
    "open_engine",
]
