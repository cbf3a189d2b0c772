"""Nemotron-H's config.json (transformers' ``NemotronHConfig``: Mamba-2, attention and MLP
layers in the order ``hybrid_override_pattern`` / ``layers_block_type`` gives) as trillm reads
it, torch-free.

``prepare`` fills absent keys with transformers' defaults, takes the legacy names transformers
still reads (``mamba_n_groups``, ``mamba_d_conv``, ``mamba_chunk_size``, ...: they win over the
new ones, as in ``NemotronHConfig.__post_init__``), and writes the Mamba-2 fields under the names
``mamba2.py`` and ``hybrid_sharding.py`` read (Bamba's: ``mamba_n_heads``, ``mamba_d_head``,
...), the layer kinds under ``layer_types``, the norms' epsilon as ``rms_norm_eps``. It refuses
by name what trillm would not run as transformers does. ``FIELDS`` decides every
``NemotronHConfig`` field.
"""

from __future__ import annotations

from typing import Any

from trillm.model_executor.bamba_config import (
    ATTENTION,
    MAMBA,
    TIME_STEP_LIMIT,
    check_mamba_sizes,
    refuse,
)
from trillm.model_executor.config_fields import COMMON_FIELDS, INERT, READ

ARCHITECTURE = "NemotronHForCausalLM"
MLP = "mlp"  # a layer that is a relu2 MLP alone ('-' in the pattern)
MOE = "moe"
# hybrid_override_pattern's characters (transformers' _pattern_to_list).
_PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
# The legacy layer kinds transformers remaps (configuration_utils' remap_legacy_layer_types).
_KINDS = {kind: kind for kind in _PATTERN.values()} | {"mamba": MAMBA, "attention": ATTENTION}

_DEFAULTS: dict[str, Any] = {
    "head_dim": 128,
    "intermediate_size": 21504,
    "mlp_hidden_act": "relu2",
    "mlp_bias": False,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "mamba_hidden_act": "silu",
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "chunk_size": 128,
    "use_conv_bias": True,
    "use_bias": False,
    "time_step_limit": [0.0, float("inf")],
    "layer_norm_epsilon": 1e-5,
    "sliding_window": None,
    "tie_word_embeddings": False,
}
# Bamba's name of each Mamba-2 field (what mamba2.py reads) <- Nemotron-H's, and the legacy
# name transformers takes instead when config.json has it.
_MAMBA_NAMES: dict[str, tuple[str, str | None]] = {
    "mamba_n_heads": ("mamba_num_heads", None),
    "mamba_d_head": ("mamba_head_dim", None),
    "mamba_d_state": ("ssm_state_size", None),
    "mamba_n_groups": ("n_groups", "mamba_n_groups"),
    "mamba_d_conv": ("conv_kernel", "mamba_d_conv"),
    "mamba_chunk_size": ("chunk_size", "mamba_chunk_size"),
    "mamba_conv_bias": ("use_conv_bias", "mamba_conv_bias"),
    "mamba_proj_bias": ("use_bias", None),  # in_proj / out_proj: transformers reads use_bias
    "time_step_limit": ("time_step_limit", "mamba_dt_limit"),
}

_MOE_FIELDS = (
    "n_routed_experts",
    "n_shared_experts",
    "moe_intermediate_size",
    "moe_shared_expert_intermediate_size",
    "moe_latent_size",
    "moe_shared_expert_overlap",
    "num_experts_per_tok",
    "routed_scaling_factor",
    "n_group",
    "topk_group",
    "norm_topk_prob",
)
_MOE_WHY = "mixture-of-experts layers ('E', Nemotron 3) are not implemented in trillm"
_INIT_ONLY = "weight initialisation only: " + INERT

FIELDS: dict[str, str] = {
    **dict.fromkeys(_DEFAULTS, READ),
    **dict.fromkeys(
        (
            "vocab_size",
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
            "bos_token_id",
            "eos_token_id",
        ),
        READ,
    ),
    "layers_block_type": "read (or hybrid_override_pattern: M, *, -; the legacy mamba / "
    f"attention names remapped); moe / E refused ({_MOE_WHY}); its length is the layer count",
    "mlp_hidden_act": "read for the '-' layers (relu2 only; others refused by name)",
    "mamba_hidden_act": "read for the Mamba-2 convolution (silu only; others refused by name)",
    "use_bias": "read: in_proj's and out_proj's bias, as transformers reads it",
    "mamba_proj_bias": "no effect in transformers (its Mamba-2 projections read use_bias): "
    "none here either",
    "expand": "no effect in transformers (the Mamba-2 width is mamba_num_heads * "
    "mamba_head_dim): none here either",
    "attention_bias": "no effect in transformers (its attention projections have no bias): "
    "none here either",
    "time_step_limit": TIME_STEP_LIMIT,
    "sliding_window": "must be null: trillm runs Nemotron-H's attention over the whole context",
    "tie_word_embeddings": "no effect in transformers (Nemotron-H's head is never tied to the "
    "embeddings): the head is read from lm_head.weight whatever it says",
    "mamba_ssm_cache_dtype": "no effect in transformers' torch path: the SSM state stays "
    "float32, as there",
    "num_logits_to_keep": "generate's logits kept per prompt: no effect on the output",
    "num_nextn_predict_layers": "the multi-token-prediction layers (mtp.*) are skipped at "
    "load, as transformers skips them; speculative decoding with them is not supported",
    "mtp_layers_block_type": "as num_nextn_predict_layers",
    "residual_in_fp32": "no effect in transformers' Nemotron-H: none here either",
    "use_mamba_kernels": INERT,
    "time_step_min": _INIT_ONLY,
    "time_step_max": _INIT_ONLY,
    "time_step_floor": _INIT_ONLY,
    "rescale_prenorm_residual": _INIT_ONLY,
    "hidden_dropout": INERT,
    **dict.fromkeys(_MOE_FIELDS, f"read only by 'moe' layers, which are refused ({_MOE_WHY})"),
    **COMMON_FIELDS,
}


def prepare(hf: dict[str, Any], architecture: str) -> dict[str, Any]:
    """``hf`` with the family's defaults filled in and checked (other models: unchanged)."""
    if architecture != ARCHITECTURE:
        return hf
    out = {**_DEFAULTS, **hf}
    for name, (field, legacy) in _MAMBA_NAMES.items():
        out[name] = out[legacy] if legacy is not None and legacy in hf else out[field]
    out["layer_types"] = _layer_types(hf)
    out["num_hidden_layers"] = len(out["layer_types"])  # transformers ignores the given one
    out["num_key_value_heads"] = int(out.get("num_key_value_heads") or out["num_attention_heads"])
    out["rms_norm_eps"] = out["layer_norm_epsilon"]
    out["hidden_act"] = out["mlp_hidden_act"]  # the registry's activation check reads it
    out["attention_bias"] = False  # transformers' projections have none, whatever it says
    out["tie_word_embeddings"] = False
    for rope in ("rope_parameters", "rope_scaling", "rope_theta"):  # no positional embedding
        out.pop(rope, None)
    _check(out, hf)
    return out


def _check(hf: dict[str, Any], given: dict[str, Any]) -> None:
    """Refuses ``hf``'s values trillm would not run, each by the name ``given`` (config.json)
    calls it."""
    names = {
        name: legacy if legacy is not None and legacy in given else field
        for name, (field, legacy) in _MAMBA_NAMES.items()
    }
    check_mamba_sizes(hf, ARCHITECTURE, names)
    if hf["mlp_hidden_act"] != "relu2":
        raise refuse(ARCHITECTURE, "mlp_hidden_act", hf["mlp_hidden_act"], "relu2 only")
    if hf["mamba_hidden_act"] != "silu":
        raise refuse(ARCHITECTURE, "mamba_hidden_act", hf["mamba_hidden_act"], "silu only")
    if hf["sliding_window"] is not None:
        why = "trillm runs Nemotron-H's attention over the whole context, as create_causal_mask"
        raise refuse(ARCHITECTURE, "sliding_window", hf["sliding_window"], why)


def _layer_types(hf: dict[str, Any]) -> list[str]:
    """Each layer's kind: ``layers_block_type`` (or ``layer_types``), else the pattern, else
    transformers' default list, which has a 'moe' layer and so is refused."""
    given = hf.get("layers_block_type") or hf.get("layer_types")
    field = "layers_block_type"
    if given is None and hf.get("hybrid_override_pattern") is not None:
        field, pattern = "hybrid_override_pattern", hf["hybrid_override_pattern"]
        if not isinstance(pattern, str) or set(pattern) - set(_PATTERN):
            raise refuse(ARCHITECTURE, field, pattern, f"characters of {''.join(_PATTERN)}")
        given = [_PATTERN[char] for char in pattern]
    if given is None:
        given = [MAMBA, MOE, ATTENTION, MLP]
    if not isinstance(given, list) or not given or set(given) - set(_KINDS):
        raise refuse(ARCHITECTURE, field, given, f"a list of {', '.join(_KINDS)}")
    kinds = [_KINDS[kind] for kind in given]
    if MOE in kinds:
        raise refuse(ARCHITECTURE, field, hf.get(field, given), _MOE_WHY)
    return kinds
