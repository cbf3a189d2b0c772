"""gpt-oss's config.json (transformers' ``GptOssConfig``) as trillm reads it, torch-free (the
frontend checks a config with it).

transformers fills an absent key with ``GptOssConfig``'s default, several of which differ from
what trillm's generic reading assumes (``head_dim`` 64, a 128-position window on every other
layer, biased attention, YaRN RoPE on a 150000 base): ``prepare`` writes them in first, so the
model runs what transformers would. ``FIELDS`` says, for every field of ``GptOssConfig``, what
trillm does with it; the tests check that it names them all, so a new transformers field is a
decision, not a silent default.
"""

from __future__ import annotations

from typing import Any

from trillm.model_executor.config_fields import COMMON_FIELDS, INERT, READ
from trillm.model_executor.layer_types import FULL, SLIDING
from trillm.model_executor.quantization import checkpoint_method

ARCHITECTURE = "GptOssForCausalLM"
MXFP4 = "mxfp4"

# GptOssConfig's defaults, for keys a config.json may leave out.
_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 36,
    "num_local_experts": 128,
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "head_dim": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "sliding_window": 128,
    "tie_word_embeddings": False,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "attention_bias": True,
}
_DEFAULT_THETA = 150000.0
_DEFAULT_ROPE: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}

# Every GptOssConfig field -> what trillm does with it.
FIELDS: dict[str, str] = {
    **dict.fromkeys(_DEFAULTS, READ),
    "rope_parameters": "read (default, linear, dynamic, llama3, yarn; others refused by name)",
    "layer_types": "read (sliding_attention / full_attention; others refused by name)",
    "eos_token_id": READ,
    "bos_token_id": READ,
    # transformers' gpt-oss does not read it (its experts' clamped SwiGLU is fixed); trillm
    # refuses a value other than silu by name (registry.py), rather than run it silently
    "hidden_act": "silu, else refused by name",
    "router_aux_loss_coef": INERT,
    **COMMON_FIELDS,
}


class GptOssConfigError(ValueError):
    """A gpt-oss config.json field trillm does not run as transformers would."""


def prepare(hf: dict[str, Any], architecture: str) -> dict[str, Any]:
    """``hf`` with GptOssConfig's defaults filled in for a gpt-oss model; for any other
    model it only refuses an MXFP4 checkpoint (only gpt-oss's experts are dequantized)."""
    method = checkpoint_method(hf)
    if architecture != ARCHITECTURE:
        if method is not None and method.lower() == MXFP4:
            raise GptOssConfigError(
                f"MXFP4 checkpoints are supported for {ARCHITECTURE} (its experts) only, "
                f"not {architecture}."
            )
        return hf
    if hf.get("is_encoder_decoder"):
        raise GptOssConfigError(f"is_encoder_decoder=true is not a {ARCHITECTURE} config.")
    out = {**_DEFAULTS, **hf}  # an explicit null stays null, as in transformers
    if "num_local_experts" not in hf and hf.get("num_experts") is not None:
        out["num_local_experts"] = hf["num_experts"]  # GptOssConfig's attribute_map
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or _DEFAULT_ROPE)
    rope.setdefault("rope_theta", hf.get("rope_theta", _DEFAULT_THETA))
    out["rope_parameters"] = rope
    out.pop("rope_scaling", None)
    if not hf.get("layer_types"):  # GptOssConfig: even layers slide, odd ones are full
        out["layer_types"] = [
            SLIDING if (i + 1) % 2 else FULL for i in range(int(out["num_hidden_layers"]))
        ]
    return out
