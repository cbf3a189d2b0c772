"""Tiny random Bamba and GraniteMoeHybrid checkpoints (Mamba-2 layers around one attention
layer) in Hugging Face format, as ``tiny_models.build_tiny_model`` writes the other families.

Two SSD chunks of 8 positions are crossed by any prompt longer than 8 tokens; 2 groups of
4 heads (so B and C are shared per group); a conv kernel of 4 (3 positions of history).
``A_log``, ``dt_bias`` and ``D`` are drawn at random (transformers initializes them to fixed
values), so a path that mixes up heads or drops a term changes the output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trillm.testing.tiny_models import EOS_IDS, save_text_checkpoint

BASE: dict[str, Any] = dict(
    vocab_size=4096,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    attn_layer_indices=[1],
    mamba_n_heads=8,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=8,
    max_position_embeddings=512,
    initializer_range=0.2,  # peaky logits: fewer near-ties between greedy candidates
    bos_token_id=None,
    eos_token_id=EOS_IDS[0],
    pad_token_id=0,
)


# GraniteMoeHybrid: the same Mamba-2 shapes; 4 experts (top 2) of 32 and a shared MLP of 48;
# multipliers away from 1 so that a path that drops one changes the output.
GRANITE: dict[str, Any] = dict(
    {k: v for k, v in BASE.items() if k != "attn_layer_indices"},
    intermediate_size=32,
    shared_intermediate_size=48,
    layer_types=["mamba", "attention", "mamba"],
    num_local_experts=4,
    num_experts_per_tok=2,
    position_embedding_type="rope",
    embedding_multiplier=2.0,
    residual_multiplier=0.7,
    attention_multiplier=0.2,
    logits_scaling=0.5,
)


def build_tiny_bamba(out_dir: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    return _build("Bamba", {**BASE, **overrides}, out_dir, seed)


def build_tiny_granite_hybrid(out_dir: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    return _build("GraniteMoeHybrid", {**GRANITE, **overrides}, out_dir, seed)


def _build(family: str, fields: dict[str, Any], out_dir: str | Path, seed: int) -> Path:
    import torch
    import transformers

    config = getattr(transformers, f"{family}Config")(**fields)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mamba.A_log"):
                param.uniform_(-1.0, 1.5)  # decays exp(-exp(A_log) * dt) spread over (0, 1)
            elif name.endswith(("mamba.dt_bias", "mamba.D")):
                param.normal_(0.0, 1.0)
    return save_text_checkpoint(model, out_dir)
