"""DeepSeek-V2 / V3's config.json (transformers' ``DeepseekV2Config`` / ``DeepseekV3Config``)
as trillm reads it, torch-free (the frontend checks a config with it).

``prepare`` fills absent keys with transformers' defaults (they differ between V2 and V3: q-LoRA,
routing, scaling), sets ``head_dim`` to ``qk_rope_head_dim`` as transformers does (the rotary
embedding's width), and refuses by name every value trillm would not run as transformers does.
``FIELDS`` says, for every field of both config classes and the keys DeepSeek's own
config.json files carry, what trillm does with it; the tests check that it names them all.
"""

from __future__ import annotations

from typing import Any

from trillm.model_executor.config_fields import COMMON_FIELDS, INERT, READ

V2, V3 = "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"
ARCHITECTURES = (V2, V3)

_COMMON: dict[str, Any] = {
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "first_k_dense_replace": 0,
    "norm_topk_prob": False,
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    V2: {
        **_COMMON,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "moe_intermediate_size": 1407,
        "routed_scaling_factor": 1.0,
        "topk_method": "greedy",
        "n_group": None,
        "topk_group": None,
    },
    V3: {
        **_COMMON,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "moe_intermediate_size": 2048,
        "routed_scaling_factor": 2.5,
        "n_group": 8,
        "topk_group": 4,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "norm_topk_prob": True,
        "rope_interleave": True,
    },
}
# transformers' V2 router: softmax scores, top-k over all experts or the best groups' (by
# each group's best expert); V3's: sigmoid scores plus the correction bias, groups by their
# top-2 sum ("noaux_tc", whatever topk_method says).
_TOPK_METHODS = {V2: ("greedy", "group_limited_greedy"), V3: ("noaux_tc",)}
_SCORING = {V2: "softmax", V3: "sigmoid"}

# Every field -> what trillm does with it.
FIELDS: dict[str, str] = {
    **dict.fromkeys(_DEFAULTS[V2], READ),
    **dict.fromkeys(_DEFAULTS[V3], READ),
    **dict.fromkeys(
        (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
            "rms_norm_eps",
            "bos_token_id",
            "eos_token_id",
            "tie_word_embeddings",
            "attention_bias",
            "num_experts_per_tok",
            "architectures",
        ),
        READ,
    ),
    "rope_parameters": "read (default, linear, dynamic, llama3, yarn with mscale / "
    "mscale_all_dim folded into the softmax scale; others refused by name)",
    "hidden_act": "read (silu; others refused by name)",
    "head_dim": "set to qk_rope_head_dim, as transformers does",
    "qk_head_dim": "derived (qk_nope_head_dim + qk_rope_head_dim), as transformers does",
    "num_key_value_heads": "must equal num_attention_heads (MLA has no KV-head groups)",
    "mlp_bias": "must be false: refused otherwise",
    "pretraining_tp": "must be 1: refused otherwise",
    "topk_method": f"V2: {' or '.join(_TOPK_METHODS[V2])}; V3: noaux_tc; others refused",
    "scoring_func": "must be softmax (V2) or sigmoid (V3): refused otherwise",
    "moe_layer_freq": "must be 1 (every layer after first_k_dense_replace sparse)",
    "num_mtp_layers": "the multi-token-prediction layers' weights are skipped, as transformers "
    "does",
    "num_nextn_predict_layers": "as num_mtp_layers; with speculative_config method mtp (one "
    "layer) it drafts (spec_decode/mtp_config.py)",
    "ep_size": "expert parallelism in DeepSeek's own code; no effect on the output",
    "aux_loss_alpha": INERT,
    "seq_aux": INERT,
    **COMMON_FIELDS,
}


class DeepseekConfigError(ValueError):
    """A DeepSeek config.json field trillm does not run as transformers would."""


def prepare(hf: dict[str, Any], architecture: str) -> dict[str, Any]:
    """``hf`` with the family's defaults filled in and checked (other models: unchanged)."""
    if architecture not in ARCHITECTURES:
        return hf
    out = {**_DEFAULTS[architecture], **hf}  # an explicit null stays null, as in transformers
    if "n_routed_experts" not in hf:  # the config classes' attribute_map
        for alias in ("num_experts", "num_local_experts"):
            if hf.get(alias) is not None:
                out["n_routed_experts"] = hf[alias]
    out["head_dim"] = int(out["qk_rope_head_dim"])
    heads = int(out["num_attention_heads"])
    out["num_key_value_heads"] = int(out.get("num_key_value_heads") or heads)
    _check_fixed(out, architecture, heads)
    _check_routing(out, architecture)
    return out


def _refuse(architecture: str, field: str, value: Any, why: str) -> DeepseekConfigError:
    return DeepseekConfigError(f"{architecture}: {field}={value!r} is not supported ({why}).")


def _check_fixed(hf: dict[str, Any], arch: str, heads: int) -> None:
    """Fields whose other values transformers does not compute (or computes differently
    from DeepSeek's own code): each refused by name."""
    checks = (
        ("num_key_value_heads", hf["num_key_value_heads"] != heads, "must equal heads"),
        ("mlp_bias", bool(hf.get("mlp_bias")), "DeepSeek's MLPs have no bias"),
        ("pretraining_tp", (hf.get("pretraining_tp") or 1) != 1, "only 1"),
        ("moe_layer_freq", (hf.get("moe_layer_freq") or 1) != 1, "only 1"),
        ("is_encoder_decoder", bool(hf.get("is_encoder_decoder")), "a decoder-only model"),
        ("n_shared_experts", int(hf.get("n_shared_experts") or 0) < 1, "at least 1"),
        (
            "scoring_func",
            hf.get("scoring_func", _SCORING[arch]) != _SCORING[arch],
            f"{arch} scores experts with {_SCORING[arch]}",
        ),
        (
            "norm_topk_prob",
            arch == V2 and bool(hf.get("norm_topk_prob")),
            "transformers' DeepseekV2 does not renormalize, DeepSeek's code does",
        ),
    )
    for field, refused, why in checks:
        if refused:
            raise _refuse(arch, field, hf.get(field), why)


def _check_routing(hf: dict[str, Any], arch: str) -> None:
    method = hf.get("topk_method") or ("noaux_tc" if arch == V3 else None)
    if method not in _TOPK_METHODS[arch]:
        raise _refuse(arch, "topk_method", method, f"supported: {_TOPK_METHODS[arch]}")
    experts, top_k = int(hf["n_routed_experts"]), int(hf.get("num_experts_per_tok") or 0)
    if not 0 < top_k <= experts:
        raise _refuse(arch, "num_experts_per_tok", top_k, f"1..n_routed_experts={experts}")
    if method == "greedy":
        return
    groups, topk_group = hf.get("n_group"), hf.get("topk_group")
    if not groups or experts % int(groups):
        raise _refuse(arch, "n_group", groups, f"a divisor of n_routed_experts={experts}")
    per_group = experts // int(groups)
    if not topk_group or not 0 < int(topk_group) <= int(groups):
        raise _refuse(arch, "topk_group", topk_group, f"1..n_group={groups}")
    if int(topk_group) * per_group < top_k:
        raise _refuse(arch, "topk_group", topk_group, "its groups hold fewer experts than top-k")
    if arch == V3 and per_group < 2:  # a group's score is its top-2 sum
        raise _refuse(arch, "n_group", groups, "V3 groups need at least 2 experts")
