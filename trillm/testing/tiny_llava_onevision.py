"""A tiny random LLaVA-OneVision checkpoint (SigLIP tower + projector + ``image_newline`` +
Qwen2 decoder) with its processor's files: the shipped tokenizer plus ``<image>`` / ``<video>``, and
OneVision's image processor on its PIL path (``processor_config.json``) and its video
processor's config, as a hub folder holds them. Its grid pinpoints are the hub's scaled to a
32-pixel tile (1x1 .. 2x3 tiles) and ``anyres_max_4`` makes a 2x3-tile image's features shrink
(the bilinear interpolation)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trillm.testing.tiny_models import BASE, DEFAULT_MODEL_DIR, write_generation_config

TILE = 32  # the tower's image_size: one tile's side in pixels
PATCH_SIZE = 8  # 4x4 patches a tile
PINPOINTS = [[32, 32], [32, 64], [64, 32], [64, 64], [32, 96], [96, 32], [64, 96], [96, 64]]
VISION: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    image_size=TILE,
    patch_size=PATCH_SIZE,
    vision_use_head=False,
)
TOKENS = ("<image>", "<video>")
VIDEO_PROCESSOR = {
    "size": {"height": TILE, "width": TILE},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def build_tiny_llava_onevision(
    out_dir: str | Path,
    *,
    seed: int = 0,
    vision_feature_layer: int | list[int] = -1,
    vision_aspect_ratio: str = "anyres_max_4",
    vision_use_head: bool = False,
) -> Path:
    """Write the checkpoint, tokenizer and processor to ``out_dir``."""
    import torch
    from transformers import (
        AutoTokenizer,
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        Qwen2Config,
        SiglipVisionConfig,
    )
    from transformers.models.llava_onevision import LlavaOnevisionImageProcessorPil

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    tok.add_special_tokens({"additional_special_tokens": list(TOKENS)})
    image_id, video_id = tok.convert_tokens_to_ids(list(TOKENS))
    text = Qwen2Config(**{**BASE, "vocab_size": 4104, "head_dim": 16})
    config = LlavaOnevisionConfig(
        vision_config=SiglipVisionConfig(**{**VISION, "vision_use_head": vision_use_head}),
        text_config=text,
        image_token_index=image_id,
        video_token_index=video_id,
        vision_feature_layer=vision_feature_layer,
        vision_feature_select_strategy="full",
        image_grid_pinpoints=PINPOINTS,
        vision_aspect_ratio=vision_aspect_ratio,
    )
    torch.manual_seed(seed)
    LlavaOnevisionForConditionalGeneration(config).save_pretrained(out, safe_serialization=True)
    images = LlavaOnevisionImageProcessorPil(
        size={"height": TILE, "width": TILE}, image_grid_pinpoints=PINPOINTS
    )
    images.save_pretrained(out)  # preprocessor_config.json
    tok.save_pretrained(out)
    # The processor's own fields, as a hub folder holds them (transformers' processor class
    # cannot be built here: it needs torchvision's video processor)
    fields = {
        "processor_class": "LlavaOnevisionProcessor",
        "num_image_tokens": (TILE // PATCH_SIZE) ** 2,
        "vision_feature_select_strategy": "full",
        "vision_aspect_ratio": vision_aspect_ratio,
    }
    (out / "processor_config.json").write_text(json.dumps(fields, indent=2))
    # The video processor's own file (its mean and deviation not the image processor's, so a
    # test tells which one a video was processed with)
    video = {"video_processor_type": "LlavaOnevisionVideoProcessor", **VIDEO_PROCESSOR}
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    write_generation_config(out)
    return out
