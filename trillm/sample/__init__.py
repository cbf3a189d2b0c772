"""P3, stage 8: the batched sampler that runs inside the model worker.

- ``sampler.py``: ``Sampler`` (the pipeline) and ``SamplerOutput``; start here.
- ``state.py``: ``SamplingState``, the persistent per-slot parameters and token history.
- ``bitmask.py``: packed token sets (structured output, allowed / prompt / stop tokens).
- ``penalties.py``, ``topk_topp.py``, ``bad_words.py``: the logits processors.
- ``race.py``: exponential-race sampling and batch-independent per-request seeds.
- ``logits_processor.py``: vLLM's custom logits processor interface (``--logits-processors``);
  ``custom_batch.py``: a worker's instances and their batch updates in vLLM's shape.
- ``logprobs.py``: ``LogprobsTensors`` and ``compute_topk_logprobs`` (also for prompt logprobs).
"""
