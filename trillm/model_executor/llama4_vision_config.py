"""Llama 4's ``vision_config`` (transformers' ``Llama4VisionConfig``) as trillm reads it.

transformers' vision model reads ``hidden_size``, ``num_hidden_layers``,
``num_attention_heads``, ``num_channels``, ``intermediate_size``, ``vision_output_dim``,
``image_size``, ``patch_size``, ``pixel_shuffle_ratio``, ``projector_input_dim``,
``projector_output_dim`` and ``rope_parameters.rope_theta``; its GELU, LayerNorm eps (1e-5),
and the projector's missing biases are fixed in its code, so ``hidden_act``, ``norm_eps``,
``multi_modal_projector_bias`` and ``vision_feature_select_strategy`` are inert there and here
(as are the dropouts and ``initializer_range`` at inference). The refusals below are shapes
transformers' model cannot run either, named before the weights load.
"""

from __future__ import annotations

from typing import Any

ARCHITECTURE = "Llama4ForConditionalGeneration"
_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "num_hidden_layers": 34,
    "num_attention_heads": 16,
    "num_channels": 3,
    "intermediate_size": 5632,
    "vision_output_dim": 7680,
    "image_size": 448,
    "patch_size": 14,
    "pixel_shuffle_ratio": 0.5,
    "projector_input_dim": 4096,
    "projector_output_dim": 4096,
}
_ROPE_THETA = 10000.0  # Llama4VisionConfig's default rope_parameters


def vision_fields(mm_config: dict[str, Any]) -> dict[str, Any]:
    """The vision config's fields the model reads, defaults filled in, checked."""
    vc = mm_config.get("vision_config") or {}
    out = {key: vc.get(key, default) for key, default in _DEFAULTS.items()}
    for key in ("image_size", "patch_size"):
        if not isinstance(out[key], int):
            raise ValueError(f"{ARCHITECTURE}: vision_config.{key} {out[key]!r} must be one int.")
    rope = vc.get("rope_parameters") or {}
    out["rope_theta"] = float(rope.get("rope_theta", vc.get("rope_theta", _ROPE_THETA)))
    side, ratio = out["image_size"] // out["patch_size"], float(out["pixel_shuffle_ratio"])
    if side * ratio != int(side * ratio) or out["hidden_size"] % out["num_attention_heads"]:
        raise ValueError(
            f"{ARCHITECTURE}: a tile of {side}x{side} patches cannot be pixel-shuffled by "
            f"{ratio}, or hidden_size is not a multiple of num_attention_heads."
        )
    return out


def tile_size(mm_config: dict[str, Any]) -> int:
    return int(vision_fields(mm_config)["image_size"])


def patches_per_tile(mm_config: dict[str, Any]) -> int:
    """``<|patch|>`` tokens per tile: the tile's patches after the pixel shuffle (the
    processor's ``(S / patch)^2 // round(1 / ratio^2)``)."""
    fields = vision_fields(mm_config)
    side = fields["image_size"] // fields["patch_size"]
    return side * side // int(round(1.0 / float(fields["pixel_shuffle_ratio"]) ** 2))


def is_llama4_mm(mm_config: dict[str, Any]) -> bool:
    return mm_config.get("model_type") == "llama4"
