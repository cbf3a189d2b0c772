"""A tiny random Nemotron-H checkpoint in Hugging Face format (``hybrid_override_pattern``
``M*-M``: Mamba-2, attention, MLP, Mamba-2), as ``tiny_bamba`` writes Bamba's.

The Mamba-2 layers have ``tiny_bamba``'s shapes (SSD chunks of 8 positions, 2 groups of 4 heads,
a conv kernel of 4) but a width ``mamba_num_heads * mamba_head_dim`` = 96 that
``expand * hidden_size`` (128) is not, and the attention a ``head_dim`` of 24 that
``hidden_size / num_attention_heads`` (16) is not: a path that took either from the other fields
fails. ``A_log``, ``dt_bias``, ``D``, the projections' biases (``use_bias``, ``mlp_bias``) and
an expert router's ``e_score_correction_bias`` (transformers initializes them to fixed values
or zero) are drawn at random.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trillm.testing.tiny_models import EOS_IDS, save_text_checkpoint

NEMOTRON_H: dict[str, Any] = dict(
    vocab_size=4096,
    hidden_size=64,
    intermediate_size=96,
    hybrid_override_pattern="M*-M",
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    mamba_num_heads=8,
    mamba_head_dim=12,
    n_groups=2,
    ssm_state_size=16,
    conv_kernel=4,
    chunk_size=8,
    use_bias=True,
    mlp_bias=True,
    max_position_embeddings=512,
    initializer_range=0.2,  # peaky logits: fewer near-ties between greedy candidates
    bos_token_id=None,
    eos_token_id=EOS_IDS[0],
    pad_token_id=0,
)
# The mixture-of-experts variant (Nemotron 3's 'E' layers): 4 experts in 2 groups, top 2 of the
# best group, on a latent width of 32, beside a shared MLP of 48.
MOE: dict[str, Any] = dict(
    hybrid_override_pattern="M*EM",
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=48,
    moe_latent_size=32,
)


def build_tiny_nemotron_h(out_dir: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    import torch
    import transformers

    config = transformers.NemotronHConfig(**{**NEMOTRON_H, **overrides})
    torch.manual_seed(seed)
    model = transformers.NemotronHForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mixer.A_log"):
                param.uniform_(-1.0, 1.5)  # decays exp(-exp(A_log) * dt) spread over (0, 1)
            elif name.endswith(("mixer.dt_bias", "mixer.D")):
                param.normal_(0.0, 1.0)
            elif name.endswith("_proj.bias"):
                param.normal_(0.0, 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("gate.e_score_correction_bias"):  # 'E' layers' router
                buffer.normal_(0.0, 0.3)
    return save_text_checkpoint(model, out_dir)
