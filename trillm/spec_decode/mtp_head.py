"""DeepSeek-V3's multi-token-prediction layer as a drafting head (its config: ``mtp_config.py``).

The checkpoint's ``model.layers.{L}`` (L = the decoder's layer count) holds ``enorm``, ``hnorm``,
``eh_proj`` [H, 2H], a whole decoder layer (MLA and, past ``first_k_dense_replace``, experts),
``shared_head.norm``, and usually ``embed_tokens`` and ``shared_head.head`` (else the target's
``model.embed_tokens`` / ``lm_head``, read from the same checkpoint). A row at position ``p`` is
fed token ``p + 1`` and the target's final (normed) state at ``p``:

    h' = layer(eh_proj(cat(enorm(embed(t[p+1])), hnorm(h[p]))))

``shared_head.head(shared_head.norm(h'))`` gives the draft for ``p + 2`` and ``h'`` is fed back
for the next draft. As vLLM, the embedding at position 0 is zeroed (the layer was trained
without the first token's).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from trillm.attention.backend import AttentionMetadata
from trillm.config import ModelConfig
from trillm.model_executor.layers.fused_moe import EXPERT_PARTS, FusedMoE
from trillm.model_executor.layers.norm import RMSNorm
from trillm.model_executor.layers.rotary import RotaryEmbedding
from trillm.model_executor.models.deepseek import DeepseekDecoderLayer, DeepseekV2ForCausalLM
from trillm.model_executor.models.deepseek_mla import MLAPlan
from trillm.model_executor.models.moe import check_experts_loaded
from trillm.model_executor.models.stacked_weights import MissingWeightsError, StackedWeightLoader

_EXPERT = re.compile(r"^(layer\.mlp\.experts)\.(\d+)\.(\w+)\.weight$")


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


class MtpLayer(DeepseekDecoderLayer):
    """The decoder layer (HF's names) with the MTP layer's own modules beside it."""

    def __init__(self, cfg: ModelConfig, plan: MLAPlan, index: int) -> None:
        super().__init__(cfg, plan, index)
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = SharedHead(cfg)


class MtpHead(nn.Module):
    """``embed_tokens`` and the one MTP ``layer``; forward as EAGLE heads' (``eagle_head.py``)."""

    d2t: torch.Tensor | None = None  # drafts are in the target's vocabulary

    def __init__(self, cfg: ModelConfig, device: str) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layer = MtpLayer(cfg, MLAPlan(), int(cfg.hf_config["mtp_layer"]))
        self.rotary = RotaryEmbedding(  # the target's (MLA ropes qk_rope_head_dim = head_dim)
            cfg.head_dim,
            cfg.rope_theta,
            cfg.rope_scaling,
            cfg.max_position_embeddings,
            max_positions=cfg.max_model_len,
            device=device,
        )

    def forward(
        self,
        embeds: torch.Tensor,  # [T, H]: token p + 1's embedding
        positions: torch.Tensor,  # [T]: p
        hidden: torch.Tensor,  # [T, H]: the target's final state at p, or h' of the row before
        kv_caches: list[torch.Tensor],  # the layer's latent cache
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (for the logits, to feed back), both [T, H]
        layer = self.layer
        embeds = embeds.masked_fill((positions == 0)[:, None], 0.0)
        x = layer.eh_proj(torch.cat([layer.enorm(embeds), layer.hnorm(hidden)], dim=-1))
        out, residual = layer(positions, x, None, self.rotary, kv_caches[0], meta)
        h = out + residual
        return layer.shared_head.norm(h), h

    def combine(self, aux: list[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError("an MTP layer reads the target's final state, no aux layers")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Names as ``mtp_weights`` gives them; MissingWeightsError naming the gaps."""
        params = dict(self.named_parameters())
        loader = StackedWeightLoader(self, params, "The MTP layer's checkpoint")
        for name, tensor in weights:
            if match := _EXPERT.match(name):
                experts = self.get_submodule(match.group(1))
                if not isinstance(experts, FusedMoE) or match.group(3) not in EXPERT_PARTS:
                    raise MissingWeightsError(f"MTP weight {name!r} does not fit the layer.")
                experts.load_expert(int(match.group(2)), EXPERT_PARTS[match.group(3)], tensor)
            else:
                loader.load(name, tensor, stacked=not DeepseekV2ForCausalLM.own_projection(name))
        loader.check_complete()
        check_experts_loaded(self)


def mtp_weights(folder: str, layer: int) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's MTP layer ``layer`` under ``MtpHead``'s names; its embeddings and head,
    or the target's where it ships none."""
    from trillm.model_executor.loader import iterate_weights

    prefix = f"model.layers.{layer}."
    shared = ("model.embed_tokens.weight", "lm_head.weight")
    found = dict(iterate_weights(folder, wanted=lambda n: n.startswith(prefix) or n in shared))
    embed = found.pop(prefix + "embed_tokens.weight", None)
    head = found.pop(prefix + "shared_head.head.weight", None)
    target_embed = found.pop(shared[0], None)
    target_head = found.pop(shared[1], target_embed)  # tied: the embedding is the head
    named = [("layer." + n.removeprefix(prefix), t) for n, t in found.items()]
    for name, tensor in (
        ("embed_tokens.weight", embed if embed is not None else target_embed),
        ("layer.shared_head.head.weight", head if head is not None else target_head),
    ):
        if tensor is not None:  # else reported missing by load_weights
            named.append((name, tensor))
    return named
