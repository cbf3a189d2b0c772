"""Bamba's config.json (transformers' ``BambaConfig``: Mamba-2 layers with a few attention
layers) as trillm reads it, torch-free (the frontend checks a config with it); its Mamba-2
fields' checks (``check_mamba``) serve GraniteMoeHybrid too (``granitemoehybrid_config.py``).

``prepare`` fills absent keys with transformers' defaults, resolves ``mamba_d_head: "auto"`` and
the partial rotary factor (transformers hard-codes 0.5) as transformers does, and refuses by
name every value trillm would not run as transformers does. ``FIELDS`` says, for every field
of ``BambaConfig``, what trillm does with it; the tests check that it names them all.
"""

from __future__ import annotations

import math
from typing import Any

from trillm.model_executor.config_fields import COMMON_FIELDS, INERT, READ

ARCHITECTURE = "BambaForCausalLM"
MAMBA = "linear_attention"  # transformers' layer type of a Mamba-2 layer
ATTENTION = "full_attention"

# The Mamba-2 fields and their defaults (BambaConfig's and GraniteMoeHybridConfig's alike).
MAMBA_DEFAULTS: dict[str, Any] = {
    "mamba_n_heads": 128,
    "mamba_d_head": "auto",
    "mamba_n_groups": 1,
    "mamba_d_state": 256,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 256,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "time_step_limit": [0.0, math.inf],
}
_DEFAULTS: dict[str, Any] = {
    **MAMBA_DEFAULTS,
    "attn_layer_indices": None,
    "rms_norm_eps": 1e-5,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
}
# transformers' BambaConfig.__post_init__ sets it whatever config.json says.
PARTIAL_ROTARY_FACTOR = 0.5

TIME_STEP_LIMIT = (
    "must be (0.0, inf): transformers clamps dt with it in a prompt's chunked scan but not in "
    "a single-token step, which trillm does not mirror"
)
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
            "rope_theta",
        ),
        READ,
    ),
    "rope_parameters": "read (default, linear, dynamic, llama3, yarn; others refused by name); "
    "partial_rotary_factor set to 0.5 as transformers does",
    "hidden_act": "read for the MLP and the Mamba-2 convolution (silu; others refused by name)",
    "time_step_limit": TIME_STEP_LIMIT,
    "layer_types": "derived from attn_layer_indices as transformers does; a different list "
    "is refused",
    "layers_block_type": "as layer_types",
    "num_logits_to_keep": "generate's logits kept per prompt: no effect on the output",
    "z_loss_coefficient": INERT,
    **COMMON_FIELDS,
}


class BambaConfigError(ValueError):
    """A hybrid Mamba-2 model's config.json field trillm does not run as transformers would."""


def refuse(arch: str, field: str, value: Any, why: str) -> BambaConfigError:
    return BambaConfigError(f"{arch}: {field}={value!r} is not supported ({why}).")


def prepare(hf: dict[str, Any], architecture: str) -> dict[str, Any]:
    """``hf`` with the family's defaults filled in and checked (other models: unchanged)."""
    if architecture != ARCHITECTURE:
        return hf
    out = {**_DEFAULTS, **hf}
    out["num_key_value_heads"] = int(out.get("num_key_value_heads") or out["num_attention_heads"])
    rope = dict(out.get("rope_parameters") or {})
    rope["partial_rotary_factor"] = PARTIAL_ROTARY_FACTOR
    out["rope_parameters"] = rope
    check_mamba(out, ARCHITECTURE)
    out["layer_types"] = _layer_types(out)
    return out


def check_mamba(hf: dict[str, Any], arch: str) -> None:
    """Resolves ``mamba_d_head: "auto"`` in ``hf`` and refuses Mamba-2 fields by name."""
    hf["mamba_d_head"] = _d_head(hf, arch)
    check_mamba_sizes(hf, arch)


def check_mamba_sizes(hf: dict[str, Any], arch: str, names: dict[str, str] | None = None) -> None:
    """Refuses by name the groups, sizes and time-step limit of a Mamba-2 layer (its
    ``mamba_d_head`` resolved) that trillm would not run as transformers does; ``names``: the
    family's own names of these fields in config.json (Nemotron-H's), for the refusals."""

    def name(field: str) -> str:
        return (names or {}).get(field, field)

    heads, groups = int(hf["mamba_n_heads"]), int(hf["mamba_n_groups"] or 0)
    if groups < 1 or heads % groups:
        why = f"a divisor of {name('mamba_n_heads')}={heads}"
        raise refuse(arch, name("mamba_n_groups"), groups, why)
    for field in ("mamba_d_state", "mamba_chunk_size", "mamba_d_conv"):
        if int(hf[field] or 0) < 1:
            raise refuse(arch, name(field), hf[field], "at least 1")
    if not _default_time_step_limit(hf["time_step_limit"]):
        raise refuse(arch, name("time_step_limit"), hf["time_step_limit"], TIME_STEP_LIMIT)


def _d_head(hf: dict[str, Any], arch: str) -> int:
    inner, heads = int(hf["mamba_expand"]) * int(hf["hidden_size"]), int(hf["mamba_n_heads"])
    if inner % heads:
        raise refuse(
            arch, "mamba_n_heads", heads, f"must divide mamba_expand * hidden_size = {inner}"
        )
    d_head = hf["mamba_d_head"]
    d_head = inner // heads if d_head == "auto" else int(d_head)
    if d_head * heads != inner:
        raise refuse(arch, "mamba_d_head", d_head, f"mamba_d_head * mamba_n_heads must be {inner}")
    return d_head


def _default_time_step_limit(limit: Any) -> bool:
    """(0.0, inf), as json.dumps writes it, or as transformers' to_json writes infinity."""
    if not isinstance(limit, list | tuple) or len(limit) != 2:
        return False
    low, high = limit
    if isinstance(high, dict):
        high = high.get("__float__")
    try:
        return float(low) == 0.0 and float(high) == math.inf
    except (TypeError, ValueError):
        return False


def _layer_types(hf: dict[str, Any]) -> list[str]:
    """Each layer's kind from ``attn_layer_indices`` (transformers' ``layers_block_type``)."""
    num_layers = int(hf["num_hidden_layers"])
    indices = set(hf["attn_layer_indices"] or ())
    if not indices <= set(range(num_layers)):
        raise refuse(ARCHITECTURE, "attn_layer_indices", sorted(indices), f"below {num_layers}")
    derived = [ATTENTION if i in indices else MAMBA for i in range(num_layers)]
    for field in ("layer_types", "layers_block_type"):
        given = hf.get(field)
        if given is not None and list(given) != derived:
            raise refuse(
                ARCHITECTURE, field, given, "transformers derives it from attn_layer_indices"
            )
    return derived
