"""A random-weight LLaVA-1.5-shaped checkpoint at the largest size this host holds twice
(trillm's worker and transformers side by side): CLIP ViT-L/14-336's vision tower (24 layers,
width 1,024, 336 px, 576 image tokens) and a Llama-3.2-1B-shaped language model, ~1.5 B
parameters. LLaVA-1.5-7B's Vicuna-7B would need ~27 GB per copy in float32, more than this
host's 24 GiB. Built once outside the repository; skipped when ``model.safetensors`` exists.

    python benchmarks/peers/make_llava_1b.py [--out ~/.cache/trillm-bench]

Saved in bfloat16 (3 GB on disk); the benchmark loads it in float32 on both sides, because on
this AVX2-only host torch's bf16 matmuls run at ~1/7 of its fp32 rate. The tokenizer is
SmolLM2-135M's with ``<image>`` added, padded with reserved special tokens to Llama-3.2-1B's
vocabulary (as ``benchmarks/serving/make_1b_checkpoints.py`` does); the processor is
LLaVA-1.5's (CLIP, shortest edge 336, centre crop 336). Weights are transformers' own init.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.serving.make_1b_checkpoints import BOS, EOS, LLAMA_3_2_1B, SMOLLM2  # noqa: E402

NAME = "llava-clip336-llama3.2-1b"
IMAGE_TOKEN = "<image>"
IMAGE_SIZE, PATCH_SIZE = 336, 14
CLIP_VIT_L_14_336 = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=24,
    num_attention_heads=16,
    image_size=IMAGE_SIZE,
    patch_size=PATCH_SIZE,
    projection_dim=768,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
)


def write_tokenizer(folder: Path, vocab_size: int) -> int:
    """SmolLM2's tokenizer, then ``<image>``, then reserved tokens up to ``vocab_size``;
    returns the image token's id."""
    tok = Tokenizer.from_file(str(SMOLLM2 / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True)])
    base = tok.get_vocab_size(with_added_tokens=True)
    pads = [AddedToken(f"<|reserved_{i}|>", special=True) for i in range(vocab_size - base)]
    tok.add_special_tokens(pads)
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    tok.save(str(folder / "tokenizer.json"))
    tok_cfg = json.loads((SMOLLM2 / "tokenizer_config.json").read_text())
    tok_cfg.pop("added_tokens_decoder", None)  # tokenizer.json holds them
    tok_cfg["model_max_length"] = LLAMA_3_2_1B["max_position_embeddings"]
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    shutil.copy(SMOLLM2 / "chat_template.jinja", folder / "chat_template.jinja")
    image_id = tok.token_to_id(IMAGE_TOKEN)
    assert image_id is not None
    return image_id


def write_model(folder: Path, image_id: int, seed: int) -> int:
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    text = {k: v for k, v in LLAMA_3_2_1B.items() if k not in ("architectures", "torch_dtype")}
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**CLIP_VIT_L_14_336),
        text_config=LlamaConfig(**text, bos_token_id=BOS, eos_token_id=EOS),
        image_token_index=image_id,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    staging = folder / "staging"  # moved in whole, so a killed build leaves no model file
    model.save_pretrained(staging, safe_serialization=True, max_shard_size="20GB")
    (staging / "config.json").replace(folder / "config.json")
    (staging / "model.safetensors").replace(folder / "model.safetensors")
    shutil.rmtree(staging)
    return n


def write_processor(folder: Path) -> None:
    from transformers import AutoTokenizer, LlavaProcessor
    from transformers.models.clip import CLIPImageProcessorPil

    images = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=AutoTokenizer.from_pretrained(str(folder)),
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,  # CLIP's CLS vector ("default" drops it again)
    )
    processor.save_pretrained(folder)


def build(out: Path, seed: int) -> Path:
    folder = out / NAME
    if (folder / "model.safetensors").exists():
        print(f"{folder}: exists, skipped")
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    image_id = write_tokenizer(folder, LLAMA_3_2_1B["vocab_size"])
    write_processor(folder)
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS, "eos_token_id": EOS})
    )
    n = write_model(folder, image_id, seed)  # last: model.safetensors means complete
    print(f"{folder}: {n / 1e9:.3f} B parameters, {n * 2 / 1e9:.2f} GB bf16")
    return folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("~/.cache/trillm-bench"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    build(args.out.expanduser(), args.seed)


if __name__ == "__main__":
    sys.exit(main())
