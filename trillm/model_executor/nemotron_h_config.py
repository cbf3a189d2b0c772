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

# The 'moe' layers' fields (transformers' defaults), dropped when there is none.
_MOE_DEFAULTS: dict[str, Any] = {
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 7688,
    "moe_shared_expert_intermediate_size": 7688,
    "moe_latent_size": None,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
}
_MOE_INERT = ("n_shared_experts", "moe_shared_expert_overlap")
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
    "layers_block_type": "read (or hybrid_override_pattern: M, *, -, E; the legacy mamba / "
    "attention names remapped); its length is the layer count",
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
    **dict.fromkeys(
        _MOE_DEFAULTS,
        "read by the 'moe' layers (the router as DeepSeek-V3's "
        "noaux_tc: sigmoid scores, e_score_correction_bias, n_group / topk_group)",
    ),
    "moe_latent_size": "read: the experts run on fc1_latent_proj's output, fc2_latent_proj "
    "maps their sum back",
    "n_shared_experts": "no effect in transformers (the shared MLP has "
    "moe_shared_expert_intermediate_size): none here either",
    "moe_shared_expert_overlap": INERT,
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
    if MOE in out["layer_types"]:
        out = {**_MOE_DEFAULTS, **out}
        if "num_local_experts" in hf:  # transformers' attribute_map: it wins, as there
            out["n_routed_experts"] = hf["num_local_experts"]
        _check_moe(out)
    else:  # unread: kept out of the sizes tensor parallelism checks
        for field in (*_MOE_DEFAULTS, *_MOE_INERT):
            out.pop(field, None)
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


def _check_moe(hf: dict[str, Any]) -> None:
    """Refuses router sizes transformers' top-k and group top-2 would fail on."""
    experts, top_k = int(hf["n_routed_experts"] or 0), int(hf["num_experts_per_tok"] or 0)
    groups, top_groups = int(hf["n_group"] or 0), int(hf["topk_group"] or 0)
    if experts < 1 or not 0 < top_k <= experts:
        raise refuse(ARCHITECTURE, "num_experts_per_tok", top_k, f"1..{experts} experts")
    if groups < 1 or experts % groups or experts // groups < 2:
        why = f"a divisor of n_routed_experts={experts} leaving 2 or more experts a group"
        raise refuse(ARCHITECTURE, "n_group", groups, why)
    if not 0 < top_groups <= groups:
        raise refuse(ARCHITECTURE, "topk_group", top_groups, f"1..{groups} groups")


def _layer_types(hf: dict[str, Any]) -> list[str]:
    """Each layer's kind: ``layers_block_type`` (or ``layer_types``), else the pattern, else
    transformers' default list."""
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
    return [_KINDS[kind] for kind in given]
