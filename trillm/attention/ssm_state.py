"""The per-request state of a hybrid model's Mamba-2 layers, which stands in for the paged KV
cache in those layers (``CausalLM.ssm_state_layout``; the attention layers keep the paged
cache).

A request's state lives in the row of its persistent-batch slot (``worker/input_batch.py``):
one slot per running request, at most ``max_num_seqs``, so the slots bound the running batch
as the scheduler already does, and their bytes are taken from the KV cache's budget
(``worker/kv_cache_sizing.py``). The slot is the request's from the step that first schedules
it to its finish, abort or preemption (``finished_req_ids``: the worker drops it). A step
whose request starts at position 0 (its first chunk, or its first after a preemption: trillm
preempts by recompute) starts from a zero state; every later chunk or decode step continues
from the state the previous one left. The state of a token therefore needs every earlier token
computed by this request: the engine keeps prefix caching off for these models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SSMStateLayout:
    """What one request holds per Mamba-2 layer: the causal convolution's last inputs and the
    SSM state; ``kv_layers`` are the model's attention layers (the paged cache's)."""

    conv: tuple[int, int]  # [conv channels, conv_kernel - 1]
    ssm: tuple[int, int, int]  # [heads, head_dim, d_state], float32
    num_layers: int  # Mamba-2 layers
    kv_layers: int  # attention layers

    def bytes_per_request(self, conv_dtype: torch.dtype) -> int:
        conv = math.prod(self.conv) * conv_dtype.itemsize
        ssm = math.prod(self.ssm) * torch.float32.itemsize
        return self.num_layers * (conv + ssm)


class SSMStateCache:
    """Every Mamba-2 layer's states, one row per batch slot."""

    def __init__(
        self, layout: SSMStateLayout, num_slots: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.layout = layout
        self.device = device
        # NOTE: the SSM state stays float32 whatever the model's dtype: transformers' scan
        # computes and hands it on in float32.
        self.conv = [
            torch.zeros(num_slots, *layout.conv, dtype=dtype, device=device)
            for _ in range(layout.num_layers)
        ]
        self.ssm = [
            torch.zeros(num_slots, *layout.ssm, dtype=torch.float32, device=device)
            for _ in range(layout.num_layers)
        ]

    def step(
        self,
        slots: np.ndarray,  # [R] int64: the step's requests' rows, in batch order
        context_lens: np.ndarray,  # [R] their tokens computed before this step
        query_start_loc: np.ndarray,  # [R + 1] their rows in the flat batch
    ) -> SSMStep:
        """How the step's requests meet their states: a decode step (one token after others)
        takes the recurrent form, batched; any other takes the chunked scan, one by one (as
        transformers picks by the forward's length and whether a state exists)."""
        lens = np.diff(query_start_loc)
        decode = (lens == 1) & (context_lens > 0)
        starts = query_start_loc[:-1]
        chunked = [
            Chunk(
                int(starts[i]), int(starts[i] + lens[i]), int(slots[i]), bool(context_lens[i] == 0)
            )
            for i in np.nonzero(~decode)[0]
        ]

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self.device)

        return SSMStep(self, dev(starts[decode]), dev(slots[decode]), chunked)


@dataclass(frozen=True)
class Chunk:
    """A request's rows ``start:end`` in a step that runs the chunked scan."""

    start: int
    end: int
    slot: int
    fresh: bool  # starts at position 0: from a zero state


@dataclass(frozen=True)
class SSMStep:
    """One step's view of the state cache (``AttentionMetadata.ssm``)."""

    cache: SSMStateCache
    decode_rows: torch.Tensor  # [Rd] int64: the decode requests' rows
    decode_slots: torch.Tensor  # [Rd] int64: their state rows
    chunks: list[Chunk]  # the other requests
