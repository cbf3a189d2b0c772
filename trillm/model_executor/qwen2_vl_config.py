"""Qwen2-VL / Qwen2.5-VL config.json: the language model's fields (under ``text_config`` in
transformers 5's layout, at the top level in the hub's older one) with their M-RoPE made
explicit, and what trillm cannot run refused by name. Torch-free: the frontend reads it."""

from __future__ import annotations

from typing import Any

QWEN2_VL_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
QWEN2_VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
# transformers' Qwen2VLTextConfig defaults (its rope_theta, its rotary's mrope_section)
DEFAULT_ROPE_THETA = 1000000.0
DEFAULT_MROPE_SECTION = [16, 24, 24]
# Top-level keys of the flat (hub) layout that are not the language model's
_NOT_TEXT_KEYS = ("vision_config", "text_config", "architectures", "model_type")


def is_qwen2_vl(mm_config: dict[str, Any]) -> bool:
    return mm_config.get("model_type") in QWEN2_VL_MODEL_TYPES or any(
        a in QWEN2_VL_ARCHITECTURES for a in mm_config.get("architectures") or []
    )


def qwen2_vl_text_config(hf: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The decoder's config: ``rope_parameters`` as {"rope_type": "default", "rope_theta": ...,
    "mrope_section": [t, h, w]}, the checkpoint's dtype and tied head."""
    nested = hf.get("text_config")
    text = dict(nested) if nested else {k: v for k, v in hf.items() if k not in _NOT_TEXT_KEYS}
    for key in ("dtype", "torch_dtype"):
        if key in hf and key not in text:
            text[key] = hf[key]
    # transformers ties the head when either level says so
    text["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings")) or bool(
        text.get("tie_word_embeddings")
    )
    if text.get("use_sliding_window"):
        raise ValueError(f"{architecture}: use_sliding_window is not supported yet.")
    text["sliding_window"] = None  # what transformers sets without use_sliding_window
    text["rope_parameters"] = _mrope_parameters(text, hf, architecture)
    text.pop("rope_scaling", None)
    _check_vision(hf.get("vision_config") or {}, architecture)
    return text


def _mrope_parameters(text: dict[str, Any], hf: dict[str, Any], arch: str) -> dict[str, Any]:
    params = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    params = params or dict(hf.get("rope_scaling") or {})
    rope_type = params.pop("type", None) or params.get("rope_type") or "default"
    if rope_type not in ("default", "mrope"):
        raise ValueError(
            f"{arch}: rope_type {rope_type!r} is not supported with M-RoPE (supported: default)."
        )
    theta = params.get("rope_theta", text.get("rope_theta", DEFAULT_ROPE_THETA))
    section = list(params.get("mrope_section", DEFAULT_MROPE_SECTION))
    heads = int(text.get("num_attention_heads", 1))
    half = int(text.get("head_dim") or int(text.get("hidden_size", 0)) // heads) // 2
    if len(section) != 3 or sum(section) != half:
        raise ValueError(
            f"{arch}: rope_parameters mrope_section {section} must be three counts (time, "
            f"height, width) summing to half the head dimension ({half})."
        )
    return {"rope_type": "default", "rope_theta": float(theta), "mrope_section": section}


def _check_vision(vc: dict[str, Any], architecture: str) -> None:
    rope_type = (vc.get("rope_parameters") or {}).get("rope_type", "axial")
    if rope_type != "axial":
        raise ValueError(
            f"{architecture}: vision_config rope_type {rope_type!r} is not supported "
            "(transformers' towers take 'axial' only)."
        )


def qwen2_vl_image_tokens(mm_config: dict[str, Any], shape: list[int]) -> int:
    """Placeholder tokens of an image whose patches are [t, h, w, patch_dim]: one per merged
    ``spatial_merge_size`` x ``spatial_merge_size`` block."""
    merge = int(mm_config["vision_config"].get("spatial_merge_size", 2))
    t, h, w = shape[:3]
    return t * h * w // merge**2
