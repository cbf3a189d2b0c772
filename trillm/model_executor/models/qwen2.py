"""Qwen2: the Llama decoder with a bias on q/k/v (never on o_proj)."""

from __future__ import annotations

from trillm.model_executor.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    QKV_BIAS_ALWAYS = True
    O_BIAS_FOLLOWS_CONFIG = False
