"""A vision-language checkpoint's config.json: the language model's fields under
``text_config`` (what ``ModelConfig`` reads, as for a text model) and the rest (vision tower,
projector, placeholder token), kept whole in ``ModelConfig.mm_config`` for the worker's
encoder and the frontend's processor. What trillm cannot run yet is refused by name."""

from __future__ import annotations

from typing import Any

from trillm.model_executor import llama4_config
from trillm.model_executor.gemma3_mm_config import (
    GEMMA3_MM_ARCHITECTURE,
    gemma3_text_config,
    gemma3_token,
    is_gemma3_mm,
)
from trillm.model_executor.onevision_config import DEFAULTS as ONEVISION_DEFAULTS
from trillm.model_executor.onevision_config import ONEVISION_ARCHITECTURE, onevision_text_config
from trillm.model_executor.qwen2_audio_config import (
    QWEN2_AUDIO_ARCHITECTURE,
    qwen2_audio_text_config,
)
from trillm.model_executor.qwen2_vl_config import (
    QWEN2_VL_ARCHITECTURES,
    is_qwen2_vl,
    qwen2_vl_image_tokens,
    qwen2_vl_text_config,
)
from trillm.model_executor.registry import model_entry

# The language models and vision towers a LLaVA checkpoint may name, as implemented.
LLAVA_TEXT_MODELS = ("llama",)
LLAVA_VISION_MODELS = ("clip_vision_model",)
VISION_FEATURE_STRATEGIES = ("default", "full")
# Top-level keys that hold for the whole checkpoint (its dtype), copied into the text config.
_SHARED_KEYS = ("dtype", "torch_dtype")


def split_config(hf: dict[str, Any], architecture: str) -> tuple[dict[str, Any], dict | None]:
    """(the language model's config, the multimodal config or None for a text model)."""
    if architecture == llama4_config.CONDITIONAL:  # its vision side: models/llama4_vision.py
        return llama4_config.conditional_text_config(hf), hf
    if not model_entry(architecture).modalities:
        return hf, None
    if architecture in QWEN2_VL_ARCHITECTURES:
        return qwen2_vl_text_config(hf, architecture), hf
    if architecture == GEMMA3_MM_ARCHITECTURE:
        return gemma3_text_config(hf), hf
    if architecture == QWEN2_AUDIO_ARCHITECTURE:
        return qwen2_audio_text_config(hf), hf
    if architecture == ONEVISION_ARCHITECTURE:  # its defaults (token ids) made explicit
        return onevision_text_config(hf), {**ONEVISION_DEFAULTS, **hf}
    text = dict(hf.get("text_config") or {})
    vision = hf.get("vision_config") or {}
    text_type = text.get("model_type", "llama")
    vision_type = vision.get("model_type", "clip_vision_model")
    if text_type not in LLAVA_TEXT_MODELS:
        raise ValueError(
            f"{architecture} with a {text_type!r} language model is not supported yet; "
            f"supported: {', '.join(LLAVA_TEXT_MODELS)}."
        )
    if vision_type not in LLAVA_VISION_MODELS:
        raise ValueError(
            f"{architecture} with a {vision_type!r} vision tower is not supported yet; "
            f"supported: {', '.join(LLAVA_VISION_MODELS)}."
        )
    strategy = hf.get("vision_feature_select_strategy", "default")
    if strategy not in VISION_FEATURE_STRATEGIES:
        raise ValueError(
            f"vision_feature_select_strategy {strategy!r} is not supported; supported: "
            f"{', '.join(VISION_FEATURE_STRATEGIES)}."
        )
    if hf.get("image_grid_pinpoints") or hf.get("multimodal_projector_type", "mlp") != "mlp":
        raise ValueError(f"{architecture}: any-resolution tiling is not supported yet.")
    for key in _SHARED_KEYS:
        if key in hf and key not in text:
            text[key] = hf[key]
    return text, hf


def image_token_id(mm_config: dict[str, Any]) -> int:
    """The placeholder token an image's features replace (LLaVA's ``image_token_index``)."""
    return int(mm_config.get("image_token_index", mm_config.get("image_token_id", 32000)))


def num_image_tokens(mm_config: dict[str, Any], shape: list[int]) -> int:
    """Feature vectors (and so placeholder tokens) of one processed image of ``shape``: LLaVA's
    [3, H, W] one per patch, plus the CLS vector with the "full" strategy; Qwen2-VL's
    [t, h, w, patch_dim] one per merged block of patches."""
    if is_qwen2_vl(mm_config):
        return qwen2_vl_image_tokens(mm_config, shape)
    if is_gemma3_mm(mm_config):
        return gemma3_token(mm_config, "mm_tokens_per_image")
    height, width = shape[-2:]
    patch = int(mm_config["vision_config"].get("patch_size", 32))
    full = mm_config.get("vision_feature_select_strategy", "default") == "full"
    return (height // patch) * (width // patch) + (1 if full else 0)


def bidirectional_image_tokens(mm_config: dict[str, Any]) -> int:
    """An image's tokens when they attend to each other both ways (Gemma 3), else 0."""
    return gemma3_token(mm_config, "mm_tokens_per_image") if is_gemma3_mm(mm_config) else 0
