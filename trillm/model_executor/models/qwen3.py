"""Qwen3: the Llama decoder with a per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

from trillm.model_executor.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    QK_NORM = True
