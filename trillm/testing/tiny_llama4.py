"""A tiny random Llama 4 text checkpoint (``Llama4ForCausalLM``) in Hugging Face format, as
``tiny_models.build_tiny_model`` writes the other families.

Four layers: RoPE layers 0-2 with chunked local attention over 12-token chunks (not a multiple
of the tests' 8-token KV blocks, nor of their prefill chunks) and the qk norm, NoPE layer 3
with full attention and the temperature tuning (``floor_scale`` 4: it moves from position 3 on);
dense MLPs on layers 0 and 2, experts with a shared expert on 1 and 3; llama3 RoPE scaling.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trillm.testing.tiny_models import DEFAULT_MODEL_DIR, EOS_IDS, save_text_checkpoint

CHUNK = 12  # attention_chunk_size
CONFIG: dict[str, Any] = dict(
    vocab_size=4096,
    hidden_size=64,
    intermediate_size=32,  # each expert's and the shared expert's
    intermediate_size_mlp=96,  # the dense layers'
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=1,
    interleave_moe_layer_step=2,
    attention_chunk_size=CHUNK,
    floor_scale=4,
    attn_scale=0.5,
    max_position_embeddings=256,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    initializer_range=0.2,  # peaky logits: fewer near-ties between greedy candidates
    bos_token_id=None,
    eos_token_id=EOS_IDS[0],
    pad_token_id=0,
)


def build_tiny_llama4(out_dir: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Write the random checkpoint (``CONFIG`` with ``overrides``) to ``out_dir``."""
    import torch
    import transformers

    config = transformers.Llama4TextConfig(**{**CONFIG, **overrides})
    torch.manual_seed(seed)
    model = transformers.Llama4ForCausalLM(config)
    with torch.no_grad():  # transformers' init zeroes them: draw ones a dropped bias shows
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):
                param.normal_(0.0, 0.5)
    return save_text_checkpoint(model, out_dir)


# A vision tower as small as Llama4VisionConfig's shapes allow: 32-pixel tiles of 4x4 patches,
# pixel-shuffled to 4 <|patch|> tokens a tile (the adapter's fc1 reads 4 x hidden_size).
TILE, PATCH = 32, 8
TINY_VISION: dict[str, Any] = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=128,
    vision_output_dim=32,
    image_size=TILE,
    patch_size=PATCH,
    projector_input_dim=32,
    projector_output_dim=32,
)
IMAGE_TOKENS = (
    "<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>",
    "<|tile_y_separator|>",
)  # fmt: skip
MAX_PATCHES = 4  # the image processor's tiles per image (its canvases 1x1 .. 4x1)


def build_tiny_llama4_conditional(out_dir: str | Path, *, seed: int = 0) -> Path:
    """A ``Llama4ForConditionalGeneration`` checkpoint: ``CONFIG`` as its ``text_config``
    (``language_model.*``), ``TINY_VISION`` as its vision model and projector (biases and norms
    drawn, not transformers' zeros and ones), the shipped tokenizer plus Llama 4's image tokens,
    and the processor's files as a hub folder holds them."""
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = transformers.AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    tok.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
    ids = dict(zip(IMAGE_TOKENS, tok.convert_tokens_to_ids(list(IMAGE_TOKENS)), strict=True))
    config = transformers.Llama4Config(
        text_config={**CONFIG, "vocab_size": 4104},
        vision_config=TINY_VISION,
        boi_token_index=ids["<|image_start|>"],
        eoi_token_index=ids["<|image_end|>"],
        image_token_index=ids["<|patch|>"],
    )
    torch.manual_seed(seed)
    model = transformers.Llama4ForConditionalGeneration(config)
    with torch.no_grad():  # as build_tiny_llama4: biases (and norms) a dropped one would show
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias") or ("vision" in name and name.endswith("bias")):
                param.normal_(0.0, 0.5)
            elif "vision" in name and "norm" in name:
                param.normal_(1.0, 0.3)
    save_text_checkpoint(model, out)
    tok.save_pretrained(out)
    processor = {
        "image_processor_type": "Llama4ImageProcessorFast",
        "size": {"height": TILE, "width": TILE},
        "max_patches": MAX_PATCHES,
        "resize_to_max_canvas": False,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    fields = {"processor_class": "Llama4Processor", "patch_size": PATCH, "image_token": "<|image|>"}
    (out / "processor_config.json").write_text(json.dumps(fields, indent=2))
    return out
