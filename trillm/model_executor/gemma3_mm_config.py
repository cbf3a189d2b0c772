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
_SHARED_KEYS = ("dtype", "torch_dtype")


def is_gemma3_mm(mm_config: dict[str, Any]) -> bool:
    return GEMMA3_MM_ARCHITECTURE in (mm_config.get("architectures") or [])


def gemma3_text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config (with the checkpoint's dtype and tied head); the vision tower and
    the image-token geometry checked."""
    text = dict(hf.get("text_config") or {})
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
    _check_vision(hf)
    return text


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
