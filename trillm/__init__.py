"""trillm: an LLM inference server on Trio structured concurrency.

Layout (the request lifecycle of docs/architecture.md, stage by stage):
  entrypoints/   stages 1-3 and 11: the OpenAI-compatible server, the CLI
  engine/        stage 4 and 10: AsyncEngine (open_engine), input and output processing
  core/          P1 and P4 of step(): scheduler and KV block manager (native twins in ext/)
  executor/      worker subprocesses and the shared-memory rings that feed them (ipc/)
  worker/        P2 and P3: model runner, persistent batch, KV cache
  model_executor/ model loading and the model definitions
  attention/     attention backends behind one interface; kernels/ holds the Triton kernels
  sample/        the batched sampler
  bench/         ``trillm bench``
"""

from trillm.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"

__all__ = ["RequestOutputKind", "SamplingParams", "__version__"]
