"""Mistral: the Llama decoder without attention biases (sliding window is capped by the loader)."""

from __future__ import annotations

from trillm.model_executor.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    O_BIAS_FOLLOWS_CONFIG = False
