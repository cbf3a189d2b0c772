"""Phi-3: the Llama decoder as is. Its checkpoint already fuses q/k/v (``qkv_proj``) and
gate/up (``gate_up_proj``) in the order trillm stacks them, so they load by name; a
``sliding_window`` covers every layer; RoPE may turn only part of each head
(``partial_rotary_factor``). "longrope" rope scaling (Phi-3.5-mini, Phi-4-mini) picks short or
long factors per request: layers/rotary.py, and the runner's ``_longrope_switch``."""

from __future__ import annotations

from trillm.model_executor.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    O_BIAS_FOLLOWS_CONFIG = False
