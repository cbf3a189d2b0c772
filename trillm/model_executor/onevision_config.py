"""LLaVA-OneVision (``LlavaOnevisionForConditionalGeneration``) config.json: the Qwen2 language
model's fields under ``text_config``, the SigLIP tower's under ``vision_config``, and the
any-resolution tiling (``image_grid_pinpoints``, ``vision_aspect_ratio``). What trillm cannot
run is refused by name. Torch-free: the frontend reads it."""

from __future__ import annotations

import re
from typing import Any

from trillm.model_executor.config_fields import COMMON_FIELDS, INERT, READ

ONEVISION_ARCHITECTURE = "LlavaOnevisionForConditionalGeneration"
# transformers' LlavaOnevisionConfig defaults
DEFAULTS: dict[str, Any] = {
    "image_token_index": 151_646,
    "video_token_index": 151_647,
    "vision_feature_select_strategy": "full",
    "vision_feature_layer": -1,
    "vision_aspect_ratio": "anyres_max_9",
}
DEFAULT_TILE = 384  # the default pinpoints' unit (SigLIP-so400m's image_size)
_ASPECT_RATIO = re.compile(r"anyres_max_([1-9][0-9]*)")
_SHARED_KEYS = ("dtype", "torch_dtype")

# Every LlavaOnevisionConfig field -> what trillm does with it (a test checks it names them all)
FIELDS: dict[str, str] = {
    "text_config": "read: a qwen2 language model, others refused by name",
    "vision_config": "read: a siglip_vision_model tower (VISION_FIELDS), others refused by name",
    "image_token_index": READ,
    "video_token_index": READ,
    "projector_hidden_act": "read; one trillm has no activation for is refused by name",
    "multimodal_projector_bias": READ,
    "vision_feature_layer": "read (an index or a list of them)",
    "vision_feature_select_strategy": "full; default refused by name",
    "vision_aspect_ratio": "anyres_max_N; other forms refused by name",
    "image_grid_pinpoints": "read; not whole tiles, or not the image processor's: refused",
    "tie_word_embeddings": "read (either level ties the head, as transformers)",
    "is_encoder_decoder": "must be false: refused otherwise",
    **COMMON_FIELDS,
}
# Every SiglipVisionConfig field -> what trillm does with it
VISION_FIELDS: dict[str, str] = {
    **dict.fromkeys(
        ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"), READ
    ),
    **dict.fromkeys(("image_size", "patch_size", "layer_norm_eps"), READ),
    "hidden_act": "read; one trillm has no activation for is refused by name",
    "num_channels": "3 (the processor's RGB), else refused by name",
    "vision_use_head": "its pooling head makes the pooled output, which is not read: skipped",
    "attention_dropout": INERT,
    **COMMON_FIELDS,
}


def is_onevision(mm_config: dict[str, Any]) -> bool:
    return ONEVISION_ARCHITECTURE in (mm_config.get("architectures") or [])


def onevision_field(mm_config: dict[str, Any], name: str) -> Any:
    return mm_config.get(name, DEFAULTS[name])


def grid_pinpoints(mm_config: dict[str, Any]) -> list[list[int]]:
    """The (height, width) resolutions an image is tiled at (transformers' default: 1..6
    tiles of 384 a side)."""
    given = mm_config.get("image_grid_pinpoints")
    if given is None:
        return [[a * DEFAULT_TILE, b * DEFAULT_TILE] for a in range(1, 7) for b in range(1, 7)]
    return [[int(side) for side in pinpoint] for pinpoint in given]


def max_tiles(mm_config: dict[str, Any]) -> int:
    """``vision_aspect_ratio`` "anyres_max_N": the N tiles' worth of features an image keeps."""
    value = str(onevision_field(mm_config, "vision_aspect_ratio"))
    match = _ASPECT_RATIO.fullmatch(value)
    if match is None:
        raise ValueError(
            f"{ONEVISION_ARCHITECTURE}: vision_aspect_ratio {value!r} is not supported; "
            "supported: 'anyres_max_N' (N a whole number >= 1)."
        )
    return int(match.group(1))


def onevision_text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config (with the checkpoint's dtype and tied head); the tower, the
    tiling and the feature selection checked."""
    if hf.get("is_encoder_decoder"):
        raise ValueError(f"is_encoder_decoder=true is not a {ONEVISION_ARCHITECTURE} config.")
    text = dict(hf.get("text_config") or {})
    text_type = text.get("model_type", "qwen2")
    if text_type != "qwen2":
        raise ValueError(
            f"{ONEVISION_ARCHITECTURE} with a {text_type!r} language model is not supported; "
            "supported: qwen2."
        )
    if text.get("use_sliding_window"):
        raise ValueError(f"{ONEVISION_ARCHITECTURE}: use_sliding_window is not supported yet.")
    text["sliding_window"] = None  # what transformers sets without use_sliding_window
    for key in _SHARED_KEYS:
        if key in hf and key not in text:
            text[key] = hf[key]
    # transformers ties the head when either level says so
    text["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings")) or bool(
        text.get("tie_word_embeddings")
    )
    _check_vision(hf)
    return text


def _check_vision(hf: dict[str, Any]) -> None:
    vc = hf.get("vision_config") or {}
    vision_type = vc.get("model_type", "siglip_vision_model")
    if vision_type != "siglip_vision_model":
        raise ValueError(
            f"{ONEVISION_ARCHITECTURE} with a {vision_type!r} vision tower is not supported; "
            "supported: siglip_vision_model."
        )
    if int(vc.get("num_channels", 3)) != 3:
        raise ValueError(
            f"{ONEVISION_ARCHITECTURE}: vision_config num_channels {vc['num_channels']} is not "
            "supported; the image processor gives RGB (3)."
        )
    strategy = onevision_field(hf, "vision_feature_select_strategy")
    if strategy != "full":
        # transformers' own model cannot pack a single image's base tile without its first
        # patch (its pack_image_features raises), and its processor counts one token less
        raise ValueError(
            f"{ONEVISION_ARCHITECTURE}: vision_feature_select_strategy {strategy!r} is not "
            "supported (SigLIP has no CLS vector to drop); supported: 'full'."
        )
    max_tiles(hf)
    tile = int(vc.get("image_size", DEFAULT_TILE))
    for pinpoint in grid_pinpoints(hf):
        if len(pinpoint) != 2 or any(side <= 0 or side % tile for side in pinpoint):
            raise ValueError(
                f"{ONEVISION_ARCHITECTURE}: image_grid_pinpoints {pinpoint} must be a "
                f"(height, width) of whole tiles of the tower's image_size {tile}."
            )
