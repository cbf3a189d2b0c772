"""A tiny random Gemma 3 with images (SigLIP tower + projector + Gemma 3 decoder) with its
processor: the shipped tokenizer plus Gemma 3's image tokens (named as the tokenizer's
``boi_token`` / ``eoi_token`` / ``image_token``, as Gemma 3's processor reads them), the Gemma 3
image processor's config in ``preprocessor_config.json`` and a chat template that walks each
message's content parts as Gemma 3's does (an image part writes ``<start_of_image>``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trillm.testing.tiny_models import ARCHES, BASE, DEFAULT_MODEL_DIR, write_generation_config

IMAGE_SIZE = 32
TOKENS_PER_IMAGE = 16  # the tower's 8x8 patches average-pooled 2x2
SPECIAL = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
VISION: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=IMAGE_SIZE,
    patch_size=4,
    vision_use_head=False,
)
# Gemma 3's template, cut down: content parts walked in order, an image as <start_of_image>
CHAT_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role'])"
    " + '\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def build_tiny_gemma3(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write the checkpoint, tokenizer and processor to ``out_dir``."""
    import torch
    from transformers import AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration
    from transformers.models.gemma3 import Gemma3ImageProcessorPil

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR), extra_special_tokens=SPECIAL)
    tok.chat_template = CHAT_TEMPLATE
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in SPECIAL.items()}
    text = {**BASE, **ARCHES["gemma3"], "vocab_size": 4104}
    config = Gemma3Config(
        text_config=text,
        vision_config=VISION,
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"],
        initializer_range=0.2,  # peaky logits: fewer near-ties between greedy candidates
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # transformers initializes the projection to zeros: images unseen
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    size = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    Gemma3ImageProcessorPil(size=size).save_pretrained(out)  # preprocessor_config.json
    tok.save_pretrained(out)
    write_generation_config(out)
    return out
