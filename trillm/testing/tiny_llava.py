"""A tiny random LLaVA checkpoint (CLIP vision tower + projector + Llama decoder) with its
processor: the shipped tokenizer plus an ``<image>`` token, and a CLIP image processor whose
config the folder's ``processor_config.json`` holds, exactly as a hub LLaVA folder looks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trillm.testing.tiny_models import BASE, DEFAULT_MODEL_DIR, write_generation_config

IMAGE_SIZE = 32
PATCH_SIZE = 8
IMAGE_TOKEN = "<image>"
VISION: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    image_size=IMAGE_SIZE,
    patch_size=PATCH_SIZE,
    projection_dim=32,
)


def build_tiny_llava(
    out_dir: str | Path,
    *,
    seed: int = 0,
    vision_feature_layer: int | list[int] = -2,
    vision_feature_select_strategy: str = "default",
) -> Path:
    """Write the checkpoint, tokenizer and processor to ``out_dir``."""
    import torch
    from transformers import (
        AutoTokenizer,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )
    from transformers.models.clip import CLIPImageProcessorPil

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    text = LlamaConfig(**{**BASE, "vocab_size": 4104, "head_dim": 32})
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**VISION),
        text_config=text,
        image_token_index=image_id,
        vision_feature_layer=vision_feature_layer,
        vision_feature_select_strategy=vision_feature_select_strategy,
        projector_hidden_act="gelu",
    )
    torch.manual_seed(seed)
    LlavaForConditionalGeneration(config).save_pretrained(out, safe_serialization=True)
    images = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy=vision_feature_select_strategy,
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,  # CLIP's CLS vector ("default" drops it again)
    )
    processor.save_pretrained(out)
    write_generation_config(out)
    return out
