"""Mistral: the Llama decoder without attention biases (its sliding window is honoured per layer)."""

from __future__ import annotations

from trillm.model_executor.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    O_BIAS_FOLLOWS_CONFIG = False
