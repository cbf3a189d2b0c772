"""The attention-backend interface: one paged-attention call per layer, any batch mix.

A step's batch is flattened: the scheduled tokens of all requests are concatenated
(``num_tokens`` rows), request ``i`` owning rows ``query_start_loc[i]:query_start_loc[i+1]``.
A request's rows are its positions ``context_lens[i] .. seq_lens[i]-1``: a decode step has one
row, a prefill chunk many, and a chunk may start after a prefix-cache hit or an earlier chunk.

KV cache layout, per layer: ``kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]``
(``kv_cache[0]`` keys, ``kv_cache[1]`` values). Token at position ``p`` of request ``i`` lives in
block ``block_table[i, p // block_size]`` at offset ``p % block_size``; ``slot_mapping`` holds
``block * block_size + offset`` for each row of this step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from trillm.attention.ssm_state import SSMStep


class UnsupportedAttentionFeatureError(ValueError):
    """The chosen backend lacks a feature the model needs (sliding window, logit softcap)."""


def check_backend_supports(
    backend: AttentionBackend, window: int | None, softcap: float | None
) -> None:
    """Refuse, when the model is built, a layer whose window or softcap the backend lacks."""
    if (window is not None or softcap is not None) and not getattr(
        backend, "supports_window_and_softcap", True
    ):
        raise UnsupportedAttentionFeatureError(
            f"The {backend.name} attention backend does not implement sliding-window attention "
            "or attention logit soft-capping, which this model uses; use "
            "--attention-backend triton or torch."
        )


def check_backend_supports_sinks(backend: AttentionBackend) -> None:
    """Refuse, when the model is built, attention sinks (gpt-oss) on a backend that lacks them."""
    if not getattr(backend, "supports_sinks", False):
        raise UnsupportedAttentionFeatureError(
            f"The {backend.name} attention backend does not implement attention sinks (a "
            "learned per-head logit in the softmax), which this model uses; use "
            "--attention-backend torch, triton or eager."
        )


def check_backend_supports_bidirectional(backend: AttentionBackend) -> None:
    """Refuse, when the model is built, a backend without bidirectional attention among an
    image's tokens (Gemma 3's image spans: ``AttentionMetadata.bidirectional_spans``)."""
    if not getattr(backend, "supports_bidirectional_spans", False):
        raise UnsupportedAttentionFeatureError(
            f"The {backend.name} attention backend does not implement bidirectional attention "
            "among an image's tokens, which this model uses; use --attention-backend torch."
        )


@dataclass
class AttentionMetadata:
    num_reqs: int
    num_tokens: int  # rows of this step (sum of query lengths)
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, prefix sums of query lengths
    seq_lens: torch.Tensor  # [num_reqs] int32, context length after this step's tokens
    context_lens: torch.Tensor  # [num_reqs] int32, tokens already in the cache before it
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    max_query_len: int
    max_seq_len: int
    # CPU copies of the lengths, for backends that plan on the host (no device sync needed).
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Per request, position ranges [start, end) whose tokens attend to each other both ways
    # inside the causal attention (Gemma 3's images); None: causal only
    bidirectional_spans: list[list[tuple[int, int]]] | None = None
    # A hybrid state-space model's Mamba layers: the step's requests' states (ssm_state.py)
    ssm: SSMStep | None = None

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(Protocol):
    """Writes this step's keys/values into the cache, then attends over the whole context."""

    name: str

    def plan(self, meta: AttentionMetadata) -> None:
        """Once per step, before the layers run (index building, flashinfer planning)."""

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,  # sliding window: a row at p sees positions > p - window
        softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap)
        # [num_heads] a learned logit per head in the softmax's denominator, attending to no
        # value (gpt-oss); only backends with ``supports_sinks`` take one
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...
