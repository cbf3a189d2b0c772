"""Llama 4 text's config.json (transformers' ``Llama4TextConfig``) as trillm reads it,
torch-free (the frontend checks a config with it).

transformers fills an absent key with ``Llama4TextConfig``'s default and derives three
per-layer lists from the others (``no_rope_layers``: a NoPE layer every
``no_rope_layer_interval``-th; ``moe_layers``: every ``interleave_moe_layer_step``-th;
``layer_types``: chunked local attention on the RoPE layers when ``attention_chunk_size`` is
set): ``prepare`` writes them in as transformers would, so the model reads explicit lists.
``FIELDS`` says, for every field of ``Llama4TextConfig``, what trillm does with it; a test
checks that it names them all, so a new transformers field is a decision, not a silent default.
"""

from __future__ import annotations

from typing import Any

from trillm.model_executor.config_fields import COMMON_FIELDS, INERT, READ
from trillm.model_executor.layer_types import FULL

ARCHITECTURE = "Llama4ForCausalLM"
# A multimodal Llama 4 checkpoint (Scout, Maverick): its language model under ``text_config``
# and ``language_model.*``, served on text alone (no vision encoder yet).
CONDITIONAL = "Llama4ForConditionalGeneration"
ARCHITECTURES = (ARCHITECTURE, CONDITIONAL)
CHUNKED = "chunked_attention"

# Llama4TextConfig's defaults, for keys a config.json may leave out.
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 202048,
    "hidden_size": 5120,
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
    "num_hidden_layers": 48,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 4096 * 32,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "num_experts_per_tok": 1,
    "num_local_experts": 16,
    "interleave_moe_layer_step": 1,
    "use_qk_norm": True,
    "no_rope_layer_interval": 4,
    "attention_chunk_size": 8192,
    "attn_temperature_tuning": True,
    "floor_scale": 8192,
    "attn_scale": 0.1,
    "attention_bias": False,
}
_DEFAULT_ROPE: dict[str, Any] = {"rope_type": "default", "rope_theta": 500000.0}

# Every Llama4TextConfig field -> what trillm does with it.
FIELDS: dict[str, str] = {
    **dict.fromkeys(_DEFAULTS, READ),
    "moe_layers": "read (else every interleave_moe_layer_step-th layer, as transformers)",
    "no_rope_layers": "read: 0 = a NoPE layer (else every no_rope_layer_interval-th)",
    "layer_types": "read (chunked_attention / full_attention; others refused by name)",
    "rope_parameters": "read (default, linear, dynamic, llama3, yarn; others refused by name)",
    "hidden_act": "silu, else refused by name",
    "router_aux_loss_coef": INERT,
    "router_jitter_noise": INERT,  # transformers' Llama4Router never reads it
    **COMMON_FIELDS,
}


class Llama4ConfigError(ValueError):
    """A Llama 4 config.json field trillm does not run as transformers would."""


def prepare(hf: dict[str, Any], architecture: str) -> dict[str, Any]:
    """``hf`` with Llama4TextConfig's defaults and derived per-layer lists filled in for a
    Llama 4 text model; any other model's config is returned as it is."""
    if architecture not in ARCHITECTURES:
        return hf
    if hf.get("is_encoder_decoder"):
        raise Llama4ConfigError(f"is_encoder_decoder=true is not a {ARCHITECTURE} config.")
    out = {**_DEFAULTS, **hf}  # an explicit null stays null, as in transformers
    if out.get("head_dim") is None:
        out["head_dim"] = int(out["hidden_size"]) // int(out["num_attention_heads"])
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or _DEFAULT_ROPE)
    rope.setdefault("rope_theta", hf.get("rope_theta", _DEFAULT_ROPE["rope_theta"]))
    out["rope_parameters"] = rope
    out.pop("rope_scaling", None)
    num_layers = int(out["num_hidden_layers"])
    out["no_rope_layers"] = _per_layer(out, "no_rope_layers", num_layers) or [
        int((i + 1) % int(out["no_rope_layer_interval"]) != 0) for i in range(num_layers)
    ]
    if out.get("moe_layers") is None:
        step = int(out["interleave_moe_layer_step"])
        out["moe_layers"] = list(range(step - 1, num_layers, step))
    chunk = out.get("attention_chunk_size")
    if out.get("layer_types") is None:
        out["layer_types"] = [
            CHUNKED if rope and chunk is not None else FULL for rope in out["no_rope_layers"]
        ]
    _check_layer_types(out["layer_types"], num_layers, chunk)
    return out


def conditional_text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A ``Llama4ForConditionalGeneration`` config.json's ``text_config`` (the checkpoint's
    dtype copied in); the vision side's fields (``vision_config``, the image token ids) are
    read by ``llama4_vision_config``. A tied top-level ``tie_word_embeddings`` is refused."""
    text = dict(hf.get("text_config") or {})
    text_type = text.get("model_type", "llama4_text")
    if text_type != "llama4_text":
        raise Llama4ConfigError(
            f"{CONDITIONAL} with a {text_type!r} language model is not supported; supported: "
            "llama4_text."
        )
    if hf.get("tie_word_embeddings"):
        raise Llama4ConfigError(
            f"{CONDITIONAL}: tie_word_embeddings=true at the top level is not supported (the "
            "language model's text_config decides its own)."
        )
    for key in ("dtype", "torch_dtype"):
        if key in hf and key not in text:
            text[key] = hf[key]
    return text


def _per_layer(hf: dict[str, Any], key: str, num_layers: int) -> list[int]:
    """A per-layer list as given (empty when absent: transformers derives it then)."""
    values = list(hf.get(key) or [])
    if values and len(values) < num_layers:
        raise Llama4ConfigError(f"{key} has {len(values)} entries for {num_layers} layers.")
    return values


def _check_layer_types(types: list[str], num_layers: int, chunk: int | None) -> None:
    if len(types) != num_layers:
        raise Llama4ConfigError(f"layer_types has {len(types)} entries for {num_layers} layers.")
    unknown = set(types) - {CHUNKED, FULL}
    if unknown:
        raise Llama4ConfigError(
            f"Unsupported layer types {sorted(unknown)} for {ARCHITECTURE}; supported: "
            f"{CHUNKED}, {FULL}."
        )
    if CHUNKED in types and not chunk:
        raise Llama4ConfigError(
            f"layer_types has {CHUNKED} layers but attention_chunk_size is not set."
        )
