"""Tiny random DeepSeek-V2 / V3 checkpoints (MLA, a dense first layer, routed + shared experts)
in Hugging Face format, as ``tiny_models.build_tiny_model`` writes the other families.

Each case exercises a different path: ``v2_lite`` no q-LoRA and greedy routing (DeepSeek-V2-Lite's
shape); ``v2`` q-LoRA and group-limited routing; ``v3`` noaux_tc routing with a correction bias
drawn large enough to change the choice, interleaved RoPE, YaRN with ``mscale`` /
``mscale_all_dim`` (the softmax scale); ``v3_plain_rope`` without ``rope_interleave``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trillm.testing.tiny_models import EOS_IDS, save_text_checkpoint

# kv_lora_rank 32 + rope 8 = 40 cached values a token and layer; a Llama of the same width
# (4 heads of 16) caches 2 x 4 x 16 = 128.
BASE: dict[str, Any] = dict(
    vocab_size=4096,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=24,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    max_position_embeddings=2048,
    initializer_range=0.2,  # peaky logits: fewer near-ties between greedy candidates
    bos_token_id=None,
    eos_token_id=EOS_IDS[0],
    pad_token_id=0,
)
_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "mscale": 0.8,
    "mscale_all_dim": 1.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "v2_lite": ("V2", dict(q_lora_rank=None, topk_method="greedy")),
    "v2": (
        "V2",
        dict(
            q_lora_rank=48,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
        ),
    ),
    "v3": (
        "V3",
        dict(
            q_lora_rank=48,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            rope_parameters=_YARN,
            max_position_embeddings=256,  # factor x original, as transformers expects
        ),
    ),
    "v3_plain_rope": ("V3", dict(q_lora_rank=None, n_group=2, topk_group=1, rope_interleave=False)),
}


def build_tiny_deepseek(case: str, out_dir: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Write the random checkpoint of ``case`` (a key of ``CASES``) to ``out_dir``."""
    import torch
    import transformers

    version, fields = CASES[case]
    config = getattr(transformers, f"Deepseek{version}Config")(**{**BASE, **fields, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, f"Deepseek{version}ForCausalLM")(config)
    with torch.no_grad():  # transformers' init zeroes it: draw one that changes the routing
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.5)
    return save_text_checkpoint(model, out_dir)
