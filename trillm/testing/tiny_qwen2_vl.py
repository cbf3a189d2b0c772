"""Tiny random Qwen2-VL and Qwen2.5-VL checkpoints (vision tower + patch merger + Qwen2 decoder
with M-RoPE) with their processor: the shipped tokenizer plus Qwen's vision tokens, and the
Qwen2-VL image processor (its PIL path) in the folder's ``preprocessor_config.json``, as a hub
folder has them (no video processor: transformers' needs torchvision, and so does its
``Qwen2VLProcessor``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trillm.testing.tiny_models import BASE, DEFAULT_MODEL_DIR, write_generation_config

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
PATCH_SIZE = 4
MERGE_SIZE = 2
# The image processor's pixel budget: a 50x40 image becomes 48x40 pixels, 12x10 patches,
# 30 placeholder tokens after the 2x2 merge.
MIN_PIXELS = 16 * 16
MAX_PIXELS = 64 * 64
TEXT: dict[str, Any] = {
    **BASE,
    "vocab_size": 4104,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
}
VISION_COMMON: dict[str, Any] = dict(
    depth=2,
    num_heads=4,
    in_channels=3,
    patch_size=PATCH_SIZE,
    spatial_merge_size=MERGE_SIZE,
    temporal_patch_size=2,
)
VISION_2: dict[str, Any] = dict(embed_dim=32, hidden_size=64, mlp_ratio=2, hidden_act="quick_gelu")
VISION_2_5: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=48,
    out_hidden_size=64,
    hidden_act="silu",
    window_size=16,  # 2x2 merged patches a window: a 12x10 patch image has 3x3 windows
    fullatt_block_indexes=[1],
)


def build_tiny_qwen2_vl(out_dir: str | Path, *, version: str = "2", seed: int = 0) -> Path:
    """Write the checkpoint (``version`` "2" or "2.5"), tokenizer and processor to ``out_dir``."""
    import torch
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    tok.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    ids = dict(zip(VISION_TOKENS, tok.convert_tokens_to_ids(list(VISION_TOKENS)), strict=True))
    config = _config(version, ids)
    torch.manual_seed(seed)
    _model_class(version)(config).save_pretrained(out, safe_serialization=True)
    images = Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS
    )
    images.save_pretrained(out)  # preprocessor_config.json
    tok.save_pretrained(out)
    write_generation_config(out)
    return out


def _config(version: str, ids: dict[str, int]) -> Any:
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    tokens = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    if version == "2":
        return Qwen2VLConfig(
            text_config=TEXT, vision_config={**VISION_COMMON, **VISION_2}, **tokens
        )
    vision = {**VISION_COMMON, **VISION_2_5}
    return Qwen2_5_VLConfig(text_config=TEXT, vision_config=vision, **tokens)


def _model_class(version: str) -> Any:
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    if version == "2":
        return Qwen2VLForConditionalGeneration
    if version == "2.5":
        return Qwen2_5_VLForConditionalGeneration
    raise ValueError(f"version {version!r}: '2' or '2.5'.")
