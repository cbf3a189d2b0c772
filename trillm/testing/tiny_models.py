"""Tiny random-weight checkpoints in Hugging Face format, one per supported architecture.

``build_tiny_model("llama", path)`` writes config.json, model.safetensors (random weights,
seeded), generation_config.json and the project's shipped tokenizer into ``path``, exactly as a
real checkpoint folder looks, so loading goes through the same code as a downloaded model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "default_model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
EOS_IDS = [2, 0]  # <|im_end|>, <|endoftext|>

# Small but not degenerate: GQA, and head_dim != hidden/heads on some.
BASE: dict[str, Any] = dict(
    vocab_size=4096,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    initializer_range=0.2,  # peaky logits: fewer near-ties between greedy candidates
    bos_token_id=None,
    eos_token_id=EOS_IDS[0],
    pad_token_id=0,
)

ARCHES: dict[str, dict[str, Any]] = {
    "llama": dict(head_dim=32),
    "mistral": dict(),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(head_dim=24, tie_word_embeddings=False),
    # Windows of 8 positions (one block in the tests), small soft-caps that bite.
    "gemma": dict(head_dim=32),
    "gemma2": dict(
        head_dim=24,
        query_pre_attn_scalar=20,
        sliding_window=8,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=5.0,
        num_hidden_layers=3,
    ),
    "gemma3": dict(
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=8,
        num_hidden_layers=3,
        sliding_window_pattern=2,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 100000.0, "factor": 2.0},
        },
    ),
    "phi3": dict(sliding_window=8, partial_rotary_factor=0.5),
    "olmo2": dict(),
    "gpt_neox": dict(num_key_value_heads=4, hidden_act="gelu"),  # no GQA in GPT-NeoX
    # Mixture-of-experts: more experts than top_k, so routing matters.
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=80,
        num_hidden_layers=3,
        mlp_only_layers=[1],
        qkv_bias=True,
    ),
    "qwen3_moe": dict(
        head_dim=24,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
    # gpt-oss: windows of 8 on its even layers, YaRN (factor 4), a SwiGLU clamp that
    # bites (its sinks and expert biases are drawn larger than transformers' init: below).
    "gpt_oss": dict(
        head_dim=16,
        num_hidden_layers=3,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=32,  # MXFP4 groups: 32 inputs
        sliding_window=8,
        swiglu_limit=2.0,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 512,  # x factor = max_position_embeddings
        },
    ),
}

CONFIG_CLASSES = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "gemma": "GemmaConfig",
    "gemma2": "Gemma2Config",
    "gemma3": "Gemma3TextConfig",
    "phi3": "Phi3Config",
    "olmo2": "Olmo2Config",
    "gpt_neox": "GPTNeoXConfig",
    "mixtral": "MixtralConfig",
    "qwen2_moe": "Qwen2MoeConfig",
    "qwen3_moe": "Qwen3MoeConfig",
    "gpt_oss": "GptOssConfig",
}
MODEL_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}


def copy_tokenizer(out_dir: Path) -> None:
    for name in TOKENIZER_FILES:
        shutil.copy(DEFAULT_MODEL_DIR / name, out_dir / name)


def write_generation_config(out_dir: Path) -> None:
    """The tiny checkpoints' generation_config.json: every EOS id, pad 0."""
    gen = {"eos_token_id": EOS_IDS, "pad_token_id": 0}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def save_text_checkpoint(model: Any, out_dir: str | Path) -> Path:
    """A transformers text model saved as a checkpoint folder: weights, config, generation
    config and the shipped tokenizer."""
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    write_generation_config(out)
    copy_tokenizer(out)
    return out


def build_tiny_model(
    arch: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    dtype: str = "float32",
    **overrides: Any,
) -> Path:
    """Write a random ``arch`` checkpoint to ``out_dir``; ``overrides`` go into its config."""
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {**BASE, **ARCHES[arch], **overrides}
    config = getattr(transformers, CONFIG_CLASSES[arch])(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, MODEL_CLASSES[arch])(config)
    if arch == "gpt_oss":
        _draw_gpt_oss_extras(model)
    return save_text_checkpoint(model.to(getattr(torch, dtype)), out)


def _draw_gpt_oss_extras(model: Any) -> None:
    """Sinks and expert biases large enough to matter (transformers' init: sinks N(0, 0.2),
    expert biases zero), so a path that drops them fails the comparison."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("self_attn.sinks"):
                param.normal_(0.0, 2.0)
            elif name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
                param.normal_(0.0, 0.5)
