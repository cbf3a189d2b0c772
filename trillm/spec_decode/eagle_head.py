"""The EAGLE / EAGLE-3 head as a module (its config: ``eagle_config.py``).

``forward(embeds, positions, hidden, kv_caches, meta)`` takes, per row at position ``p``, the
embedding of token ``p + 1`` and a hidden state for ``p`` (the target's, ``combine``d for
EAGLE-3, or the head's own from its previous draft) and returns ``(for the logits, to feed
back)``: EAGLE's residual stream is both (no final norm; the target's head reads it), EAGLE-3's
final norm gives the first and its pre-norm stream the second.

Checkpoint names: EAGLE's are the layers' (``layers.0.*``, no ``input_layernorm`` in the
first), ``fc``, optionally ``embed_tokens`` / ``lm_head``; EAGLE-3's first layer is
``midlayer.*`` (with ``hidden_norm``), then ``fc`` [H, 3H], ``norm``, ``lm_head`` [draft_vocab,
H], ``d2t`` (draft id -> target id offset) and ``t2d`` (its inverse as a mask, not needed
here). A leading ``model.`` is dropped. Without ``embed_tokens`` / ``lm_head`` the head uses the
target's (``eagle_proposer.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from trillm.attention.backend import AttentionBackend, AttentionMetadata
from trillm.config import ModelConfig
from trillm.model_executor.layers.norm import RMSNorm
from trillm.model_executor.layers.rotary import RotaryEmbedding
from trillm.model_executor.models.llama import (
    FoldedResidualLayer,
    LlamaAttention,
    LlamaDecoderFlags,
    LlamaDecoderLayer,
    LlamaMLP,
)
from trillm.model_executor.models.stacked_weights import (
    MissingWeightsError,
    StackedLinear,
    StackedWeightLoader,
)

_SKIPPED = ("t2d",)  # the target ids the draft vocabulary holds: d2t says it all


class Eagle3FirstLayer(FoldedResidualLayer):
    """EAGLE-3's first layer: attention over ``cat(norm(embeds), norm(hidden))`` (2H wide);
    the residual is the hidden state (after its norm with ``norm_before_residual``)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, flags: LlamaDecoderFlags):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, backend, flags)
        attn = self.self_attn
        shards = {"q": attn.q_size, "k": attn.kv_size, "v": attn.kv_size}
        attn.qkv_proj = StackedLinear(2 * cfg.hidden_size, shards, bias=flags.qkv_bias)
        self.mlp = LlamaMLP(cfg, flags.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm_before_residual = bool(cfg.hf_config.get("norm_before_residual", False))

    def forward_first(
        self,
        positions: torch.Tensor,  # [T]
        embeds: torch.Tensor,  # [T, H]
        hidden: torch.Tensor,  # [T, H]
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output, residual stream), both [T, H]
        embeds = self.input_layernorm(embeds)
        if self.norm_before_residual:
            hidden = self.hidden_norm(hidden)
            residual = hidden.clone()  # the norm below adds into it in place
        else:
            residual, hidden = hidden, self.hidden_norm(hidden)
        both = torch.cat([embeds, hidden], dim=-1)  # [T, 2H]
        out = self.self_attn(positions, both, rotary, kv_cache, meta)
        out = self.post_attention_layernorm(out, residual)
        return self.mlp(out), residual


class EagleHead(nn.Module):
    d2t: torch.Tensor | None

    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, names: set[str], device: str
    ) -> None:
        """``names``: the checkpoint's (normalized) entries, which say whether the head has
        its own embeddings, lm_head, fc bias."""
        super().__init__()
        hf = cfg.hf_config
        self.eagle3 = hf["eagle_method"] == "eagle3"
        h = cfg.hidden_size
        bias = cfg.attention_bias
        flags = LlamaDecoderFlags(bias, bias, False, bool(hf.get("mlp_bias", False)))
        first: nn.Module
        if self.eagle3:
            first = Eagle3FirstLayer(cfg, backend, flags)
        else:
            first = LlamaDecoderLayer(cfg, backend, flags)
            first.input_layernorm = nn.Identity()  # EAGLE's first layer has none
        rest = [LlamaDecoderLayer(cfg, backend, flags) for _ in range(cfg.num_hidden_layers - 1)]
        self.layers = nn.ModuleList([first, *rest])
        width = 3 * h if self.eagle3 else 2 * h
        self.fc = nn.Linear(width, h, bias="fc.bias" in names)
        self.para_norms = bool(hf.get("add_para_norm", False))  # EAGLE (HASS)
        if self.para_norms:
            self.embedding_layernorm = RMSNorm(h, cfg.rms_norm_eps)
            self.hidden_states_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.norm = RMSNorm(h, cfg.rms_norm_eps) if self.eagle3 else None
        own_embed = "embed_tokens.weight" in names
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h) if own_embed else None
        vocab = int(hf.get("draft_vocab_size") or cfg.vocab_size)
        self.lm_head = nn.Linear(h, vocab, bias=False) if "lm_head.weight" in names else None
        if "d2t" in names:  # draft id -> target id - draft id
            self.register_buffer("d2t", torch.zeros(vocab, dtype=torch.int64))
        else:
            self.d2t = None
        self.rotary = RotaryEmbedding(
            cfg.head_dim,
            cfg.rope_theta,
            cfg.rope_scaling,
            cfg.max_position_embeddings,
            max_positions=cfg.max_model_len,
            device=device,
        )

    def combine(self, aux: list[torch.Tensor]) -> torch.Tensor:  # 3 x [T, H] -> [T, H]
        """EAGLE-3: the target's three auxiliary states, projected to the head's input."""
        return self.fc(torch.cat(aux, dim=-1))

    def forward(
        self,
        embeds: torch.Tensor,  # [T, H]: token p + 1's embedding
        positions: torch.Tensor,  # [T]: p
        hidden: torch.Tensor,  # [T, H]: the state at p
        kv_caches: list[torch.Tensor],  # one per head layer
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (for the logits, to feed back), both [T, H]
        layers = list(self.layers)
        if isinstance(layers[0], Eagle3FirstLayer):
            x, residual = layers[0].forward_first(
                positions, embeds, hidden, self.rotary, kv_caches[0], meta
            )
        else:
            if self.para_norms:
                embeds = self.embedding_layernorm(embeds)
                hidden = self.hidden_states_layernorm(hidden)
            x = self.fc(torch.cat([embeds, hidden], dim=-1))
            x, residual = layers[0](positions, x, None, self.rotary, kv_caches[0], meta)
        for layer, kv_cache in zip(layers[1:], kv_caches[1:]):
            x, residual = layer(positions, x, residual, self.rotary, kv_cache, meta)
        if self.norm is None:
            out = x + residual
            return out, out
        return self.norm(x, residual), residual

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Normalized checkpoint names -> parameters; MissingWeightsError naming the gaps."""
        params = dict(self.named_parameters())
        if self.d2t is not None:
            params["d2t"] = self.d2t  # type: ignore[assignment]  # a buffer, loaded alike
        loader = StackedWeightLoader(self, params, "EAGLE head checkpoint")
        for name, tensor in weights:
            if name not in _SKIPPED:
                loader.load(name, tensor)
        loader.check_complete()


def normalized_weights(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The head's checkpoint entries under the names ``EagleHead`` uses (safetensors, or the
    ``pytorch_model.bin`` the EAGLE authors publish)."""
    folder = Path(folder)
    if any(folder.glob("*.safetensors")):
        from trillm.model_executor.loader import iterate_weights

        entries: Iterable[tuple[str, torch.Tensor]] = iterate_weights(folder)
    else:
        binary = folder / "pytorch_model.bin"
        if not binary.is_file():
            raise MissingWeightsError(
                f"EAGLE head {str(folder)!r} has no *.safetensors or pytorch_model.bin."
            )
        entries = torch.load(binary, map_location="cpu", weights_only=True).items()
    for name, tensor in entries:
        name = name.removeprefix("model.")
        if name.startswith("midlayer."):
            name = "layers.0." + name.removeprefix("midlayer.")
        yield name, tensor
