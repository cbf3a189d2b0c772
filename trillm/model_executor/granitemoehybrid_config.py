"""GraniteMoeHybrid's config.json (transformers' ``GraniteMoeHybridConfig``: Granite 4.0-H,
Mamba-2 layers and attention layers, each followed by a mixture of experts plus a shared MLP)
as trillm reads it, torch-free.

``prepare`` fills absent keys with transformers' defaults, maps ``layer_types`` to the kinds
``bamba_config`` names (transformers' legacy names ``mamba`` / ``attention`` included; all
Mamba-2 when absent), checks the Mamba-2 fields as for Bamba, and refuses by name what trillm
would not run as transformers does. ``FIELDS`` decides every ``GraniteMoeHybridConfig`` field.
"""

from __future__ import annotations

from typing import Any

from trillm.model_executor.bamba_config import (
    ATTENTION,
    MAMBA,
    MAMBA_DEFAULTS,
    TIME_STEP_LIMIT,
    check_mamba,
    refuse,
)
from trillm.model_executor.config_fields import COMMON_FIELDS, INERT, READ

ARCHITECTURE = "GraniteMoeHybridForCausalLM"
# transformers' remap of the layer types older configs name (configuration_utils).
_KINDS = {MAMBA: MAMBA, ATTENTION: ATTENTION, "mamba": MAMBA, "attention": ATTENTION}

_DEFAULTS: dict[str, Any] = {
    **MAMBA_DEFAULTS,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "hidden_act": "silu",
    "embedding_multiplier": 1.0,
    "logits_scaling": 1.0,
    "residual_multiplier": 1.0,
    "attention_multiplier": 1.0,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "shared_intermediate_size": 1024,
    "position_embedding_type": None,
    "layer_types": None,
}

FIELDS: dict[str, str] = {
    **dict.fromkeys(_DEFAULTS, READ),
    **dict.fromkeys(
        (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
            "bos_token_id",
            "eos_token_id",
            "tie_word_embeddings",
        ),
        READ,
    ),
    "rope_parameters": "read when position_embedding_type is 'rope' (default, linear, dynamic, "
    "llama3, yarn; others refused by name); unused otherwise, as in transformers",
    "position_embedding_type": "'rope' rotates q and k; anything else (null) none, as in "
    "transformers",
    "hidden_act": "read for the experts, the shared MLP and the convolution (silu only)",
    "time_step_limit": TIME_STEP_LIMIT,
    "num_local_experts": "read (0: the shared MLP alone, as in transformers)",
    "layer_types": "read (linear_attention / mamba, full_attention / attention; others refused)",
    "router_aux_loss_coef": INERT,
    **COMMON_FIELDS,
}


def prepare(hf: dict[str, Any], architecture: str) -> dict[str, Any]:
    """``hf`` with the family's defaults filled in and checked (other models: unchanged)."""
    if architecture != ARCHITECTURE:
        return hf
    out = {**_DEFAULTS, **hf}
    out["num_key_value_heads"] = int(out.get("num_key_value_heads") or out["num_attention_heads"])
    check_mamba(out, ARCHITECTURE)
    out["layer_types"] = _layer_types(out)
    experts, top_k = int(out["num_local_experts"] or 0), int(out["num_experts_per_tok"] or 0)
    if experts < 0 or (experts and not 0 < top_k <= experts):
        raise refuse(ARCHITECTURE, "num_experts_per_tok", top_k, f"1..{experts} experts")
    if out.get("position_embedding_type") != "rope":  # transformers builds no rotary then
        out.pop("rope_parameters", None)
        out.pop("rope_scaling", None)
    return out


def _layer_types(hf: dict[str, Any]) -> list[str]:
    num_layers = int(hf["num_hidden_layers"])
    given = hf["layer_types"] or [MAMBA] * num_layers
    unknown = sorted(set(given) - set(_KINDS))
    if unknown or len(given) != num_layers:
        why = f"{num_layers} of {', '.join(_KINDS)}"
        raise refuse(ARCHITECTURE, "layer_types", given, why)
    return [_KINDS[kind] for kind in given]
