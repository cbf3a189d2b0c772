"""ModernBERT (``ModernBertModel``) and its cross-encoder (``ModernBertForSequenceClassification``),
as transformers computes them: token embeddings + LayerNorm; pre-norm layers (the first
without an attention norm) of bidirectional attention with rotary positions and a GeGLU MLP,
every ``global_attn_every_n_layers``-th layer global and the others within a window of
``local_attention`` tokens, each kind with its own rotary base; a final LayerNorm. The
cross-encoder pools the first row or the mean (``classifier_pooling``), then dense + act +
norm and the classifier.

A padded batch of whole prompts runs at once (``worker/encoder_runner.py``); the key mask
keeps each prompt's rows to its own tokens, as transformers' unpadded attention does. Module
names are transformers' so the checkpoint loads by name; the config is read by
``modernbert_config.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trillm.attention.kv_layout import KVCacheLayout
from trillm.config import ModelConfig
from trillm.model_executor import classification, modernbert_config
from trillm.model_executor.layer_types import FULL, SLIDING
from trillm.model_executor.models.stacked_weights import MissingWeightsError

_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def _norm(hf: dict[str, Any]) -> nn.LayerNorm:
    return nn.LayerNorm(
        int(hf["hidden_size"]), eps=float(hf.get("norm_eps", 1e-5)), bias=bool(hf.get("norm_bias"))
    )


class _Embeddings(nn.Module):
    def __init__(self, hf: dict[str, Any]) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(int(hf["vocab_size"]), int(hf["hidden_size"]))
        self.norm = _norm(hf)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [B, S] -> [B, S, H]
        return self.norm(self.tok_embeddings(ids))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the two halves of each head (x [B, heads, S, D]; cos, sin [S, D])."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class _Attention(nn.Module):
    def __init__(self, hf: dict[str, Any]) -> None:
        super().__init__()
        hidden, bias = int(hf["hidden_size"]), bool(hf.get("attention_bias"))
        self.heads = int(hf["num_attention_heads"])
        self.Wqkv = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.Wo = nn.Linear(hidden, hidden, bias=bias)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:  # x [B, S, H]; mask [B, 1, S, S] bool (True: may attend)
        b, s, h = x.shape
        qkv = self.Wqkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        q, k = _rotate(qkv[0], *rope), _rotate(qkv[1], *rope)  # [B, heads, S, D]
        out = F.scaled_dot_product_attention(q, k, qkv[2], attn_mask=mask)
        return self.Wo(out.transpose(1, 2).reshape(b, s, h))


class _GeGLU(nn.Module):
    """``Wi`` makes the input and its gate side by side: Wo(act(input) * gate)."""

    def __init__(self, hf: dict[str, Any]) -> None:
        super().__init__()
        hidden, inner = int(hf["hidden_size"]), int(hf["intermediate_size"])
        bias = bool(hf.get("mlp_bias"))
        self.Wi = nn.Linear(hidden, 2 * inner, bias=bias)
        self.Wo = nn.Linear(inner, hidden, bias=bias)
        self.act = _ACTIVATIONS[str(hf.get("hidden_activation", "gelu"))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inp, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.act(inp) * gate)


class _Layer(nn.Module):
    def __init__(self, hf: dict[str, Any], index: int) -> None:
        super().__init__()
        self.attn_norm: nn.Module = nn.Identity() if index == 0 else _norm(hf)
        self.attn = _Attention(hf)
        self.mlp_norm = _norm(hf)
        self.mlp = _GeGLU(hf)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), mask, rope)
        return x + self.mlp(self.mlp_norm(x))


class _Head(nn.Module):
    """The classifier's: dense + act + norm on the pooled row."""

    def __init__(self, hf: dict[str, Any]) -> None:
        super().__init__()
        hidden = int(hf["hidden_size"])
        self.dense = nn.Linear(hidden, hidden, bias=bool(hf.get("classifier_bias")))
        self.act = _ACTIVATIONS[str(hf.get("classifier_activation", "gelu"))]
        self.norm = _norm(hf)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(x)))


class _ScoreHead(nn.Module):
    def __init__(self, hf: dict[str, Any]) -> None:
        super().__init__()
        self.head = _Head(hf)
        self.classifier = nn.Linear(int(hf["hidden_size"]), len(classification.labels(hf)))

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:  # [B, H] -> [B, num_labels]
        return self.classifier(self.head(pooled))


class ModernBertEncoder(nn.Module):
    """The encoder and, for a cross-encoder, its score head (``score_head``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.kinds = modernbert_config.layer_types(hf)  # FULL or SLIDING per layer
        self.embeddings = _Embeddings(hf)
        self.layers = nn.ModuleList(_Layer(hf, i) for i in range(len(self.kinds)))
        self.final_norm = _norm(hf)
        self.half_window = modernbert_config.half_window(hf)
        head_dim = int(hf["hidden_size"]) // int(hf["num_attention_heads"])
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        for kind, name in ((FULL, "global_inv_freq"), (SLIDING, "local_inv_freq")):
            theta = modernbert_config.rope_theta(hf, kind)
            self.register_buffer(name, 1.0 / theta**exponents, persistent=False)
        self.pooling = modernbert_config.classifier_pooling(hf)
        self.score_head: nn.Module | None = None
        if cfg.architecture == modernbert_config.CROSS_ENCODER:
            self.score_head = _ScoreHead(hf)

    @classmethod
    def kv_cache_layout(cls, cfg: ModelConfig, num_kv_heads: int) -> KVCacheLayout:
        """An encoder caches nothing; the scheduler's blocks only count a prompt's tokens."""
        return KVCacheLayout.key_value(1, 1)

    def forward(
        self, ids: torch.Tensor, types: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:  # ids [B, S] int64 (types unused: no segment embeddings) -> [B, S, H]
        x = self.embeddings(ids)
        masks = self._masks(mask)
        ropes = {
            FULL: self._rope(self.global_inv_freq, x),
            SLIDING: self._rope(self.local_inv_freq, x),
        }
        for layer, kind in zip(self.layers, self.kinds, strict=True):
            x = layer(x, masks[kind], ropes[kind])
        out: torch.Tensor = self.final_norm(x)
        return out

    def score(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The cross-encoder's logits [B, num_labels] from the encoder's rows [B, S, H]."""
        assert self.score_head is not None
        if self.pooling == "mean":
            weights = mask.to(hidden.dtype)[..., None]  # [B, S, 1]
            pooled = (hidden * weights).sum(1) / weights.sum(1)
        else:
            pooled = hidden[:, 0]
        out: torch.Tensor = self.score_head(pooled)
        return out

    def _rope(self, inv_freq: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)  # [S, D]
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    def _masks(self, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """[B, 1, S, S] per layer kind: a row sees its prompt's tokens (within the window for
        a sliding layer). A padding row also sees itself, so no softmax row is empty (NaN
        would reach the real rows through the values)."""
        s = mask.shape[1]
        pos = torch.arange(s, device=mask.device)
        near = (pos[:, None] - pos[None, :]).abs() <= self.half_window  # [S, S]
        keys = mask[:, None, None, :]
        own = torch.eye(s, dtype=torch.bool, device=mask.device)
        return {FULL: keys | own, SLIDING: (keys & near) | own}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target = self._param_name(name)
            if target not in params:
                continue  # a masked-LM head or decoder beside the encoder
            with torch.no_grad():
                params[target].copy_(tensor)
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise MissingWeightsError(f"Checkpoint is missing weights: {', '.join(missing)}")

    def _param_name(self, name: str) -> str:
        """A checkpoint name -> this module's (under a head the encoder is ``model.``)."""
        name = name.removeprefix("model.")
        if name.startswith(("head.", "classifier.")):
            return "score_head." + name
        return name
