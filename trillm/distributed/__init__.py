"""Tensor and pipeline parallelism over ``torch.distributed`` (gloo on CPU, NCCL on GPU).

``parallel_state.py`` owns the process's tensor-parallel group (rank, size, the collectives the
model calls); ``sharding.py`` says which slice of each checkpoint tensor a rank holds;
``pipeline.py`` says which layers a pipeline stage holds and passes its hidden states on.
``engine_fit.py`` checks the parallel sizes an engine asks for when it loads.
"""
