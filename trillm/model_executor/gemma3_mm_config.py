"""Gemma 3 with images (``Gemma3ForConditionalGeneration``) config.json: the language model's
fields under ``text_config`` (the Gemma 3 decoder's, as ``Gemma3ForCausalLM`` reads them), the
SigLIP tower's under ``vision_config``, and the image tokens (``boi_token_index``,
``image_token_index``, ``eoi_token_index``, ``mm_tokens_per_image``). What trillm cannot run is
refused by name. Torch-free: the frontend reads it."""

from __future__ import annotations

from typing import Any

GEMMA3_MM_ARCHITECTURE = "Gemma3ForConditionalGeneration"
GEMMA3_VISION_MODELS = ("siglip_vision_model",)
# transformers' Gemma3Config defaults
DEFAULTS = {
    "mm_tokens_per_image": 256,
    "boi_token_index": 255_999,
    "eoi_token_index": 256_000,
    "image_token_index": 262_144,
}
# transformers' Gemma3TextConfig defaults (hub folders' text_config leaves most of them out)
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
}
GLOBAL_ROPE_THETA, LOCAL_ROPE_THETA = 1_000_000.0, 10_000.0
_SHARED_KEYS = ("dtype", "torch_dtype")


def is_gemma3_mm(mm_config: dict[str, Any]) -> bool:
    return GEMMA3_MM_ARCHITECTURE in (mm_config.get("architectures") or [])


def gemma3_text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config (with the checkpoint's dtype and tied head); the vision tower and
    the image-token geometry checked."""
    text = {**TEXT_DEFAULTS, **(hf.get("text_config") or {})}
    text_type = text.get("model_type", "gemma3_text")
    if text_type != "gemma3_text":
        raise ValueError(
            f"{GEMMA3_MM_ARCHITECTURE} with a {text_type!r} language model is not supported; "
            "supported: gemma3_text."
        )
    if text.get("use_bidirectional_attention"):
        raise ValueError(
            f"{GEMMA3_MM_ARCHITECTURE}: text_config use_bidirectional_attention is not "
            "supported (an encoder, not a generator)."
        )
    for key in _SHARED_KEYS:
        if key in hf and key not in text:
            text[key] = hf[key]
    text["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", True))
    if not text.get("rope_parameters"):
        text["rope_parameters"] = _rope_parameters(text)
    _check_vision(hf)
    return text


def _rope_parameters(text: dict[str, Any]) -> dict[str, Any]:
    """transformers 4's keys (``rope_scaling`` and ``rope_theta`` for the global layers,
    ``rope_local_base_freq`` for the sliding ones) as 5's per-layer-type parameters."""
    full = dict(text.pop("rope_scaling", None) or {})
    if "type" in full:
        full["rope_type"] = full.pop("type")
    full = {"rope_type": "default", **full}
    full.setdefault("rope_theta", float(text.pop("rope_theta", GLOBAL_ROPE_THETA)))
    local = float(text.pop("rope_local_base_freq", LOCAL_ROPE_THETA))
    return {
        "sliding_attention": {"rope_type": "default", "rope_theta": local},
        "full_attention": full,
    }


def _check_vision(hf: dict[str, Any]) -> None:
    vc = hf.get("vision_config") or {}
    vision_type = vc.get("model_type", "siglip_vision_model")
    if vision_type not in GEMMA3_VISION_MODELS:
        raise ValueError(
            f"{GEMMA3_MM_ARCHITECTURE} with a {vision_type!r} vision tower is not supported; "
            f"supported: {', '.join(GEMMA3_VISION_MODELS)}."
        )
    side = int(vc.get("image_size", 224)) // int(vc.get("patch_size", 16))
    tokens = int(hf.get("mm_tokens_per_image", DEFAULTS["mm_tokens_per_image"]))
    per_side = round(tokens**0.5)
    if per_side**2 != tokens or per_side == 0 or side % per_side:
        raise ValueError(
            f"{GEMMA3_MM_ARCHITECTURE}: mm_tokens_per_image {tokens} must be a square whose "
            f"side divides the tower's {side} patches a side (the projector's average pool)."
        )


def gemma3_token(mm_config: dict[str, Any], name: str) -> int:
    """``boi_token_index``, ``image_token_index``, ``eoi_token_index`` or
    ``mm_tokens_per_image``, its default when the config leaves it out."""
    return int(mm_config.get(name, DEFAULTS[name]))
