"""BERT-family encoders (``BertModel``, ``XLMRobertaModel``) and their one-head cross-encoders
(``*ForSequenceClassification``), as transformers computes them: word + absolute position +
token type embeddings, LayerNorm; post-norm layers of bidirectional attention and a GELU MLP.

A padded batch of whole prompts runs at once (``worker/encoder_runner.py``): no KV cache, no
chunks, since every row attends to every other row of its prompt. Module names are
transformers' so the checkpoint loads by name.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trillm.attention.kv_layout import KVCacheLayout
from trillm.config import ModelConfig
from trillm.model_executor import classification
from trillm.model_executor.encoder_config import CROSS_ENCODERS, is_roberta, position_offset
from trillm.model_executor.models.stacked_weights import MissingWeightsError

_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
# checkpoint prefixes of the encoder under a head (transformers' base_model_prefix)
_BASE_PREFIXES = ("bert.", "roberta.")


class _Embeddings(nn.Module):
    def __init__(self, hf: dict[str, Any]) -> None:
        super().__init__()
        hidden = int(hf["hidden_size"])
        self.word_embeddings = nn.Embedding(int(hf["vocab_size"]), hidden)
        self.position_embeddings = nn.Embedding(int(hf["max_position_embeddings"]), hidden)
        self.token_type_embeddings = nn.Embedding(int(hf.get("type_vocab_size", 2)), hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=float(hf.get("layer_norm_eps", 1e-12)))

    def forward(
        self, ids: torch.Tensor, types: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:  # [B, S] each -> [B, S, H]
        x = self.word_embeddings(ids) + self.token_type_embeddings(types)
        return self.LayerNorm(x + self.position_embeddings(positions))


class _SelfAttention(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)


class _Output(nn.Module):
    """A projection added to the residual, then LayerNorm (post-norm)."""

    def __init__(self, n_in: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(n_in, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.self = _SelfAttention(hidden)
        self.output = _Output(hidden, hidden, eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape  # x [B, S, H]; mask [B, 1, 1, S] bool (True: a prompt token)

        def split(t: torch.Tensor) -> torch.Tensor:  # [B, S, H] -> [B, heads, S, H / heads]
            return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)

        q, k, v = split(self.self.query(x)), split(self.self.key(x)), split(self.self.value(x))
        scale = 1.0 / math.sqrt(h // self.heads)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return self.output(attn.transpose(1, 2).reshape(b, s, h), x)


class _Intermediate(nn.Module):
    def __init__(self, hidden: int, inner: int, act: str) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, inner)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class _Layer(nn.Module):
    def __init__(self, hf: dict[str, Any]) -> None:
        super().__init__()
        hidden, eps = int(hf["hidden_size"]), float(hf.get("layer_norm_eps", 1e-12))
        self.attention = _Attention(hidden, int(hf["num_attention_heads"]), eps)
        act = str(hf.get("hidden_act", "gelu"))
        self.intermediate = _Intermediate(hidden, int(hf["intermediate_size"]), act)
        self.output = _Output(int(hf["intermediate_size"]), hidden, eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class _Encoder(nn.Module):
    def __init__(self, hf: dict[str, Any]) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(hf) for _ in range(int(hf["num_hidden_layers"])))


class _BertScoreHead(nn.Module):
    """BERT's: the pooler (dense + tanh on the [CLS] row), then the classifier."""

    def __init__(self, hidden: int, num_labels: int) -> None:
        super().__init__()
        self.pooler = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, num_labels)

    def forward(self, cls_rows: torch.Tensor) -> torch.Tensor:  # [B, H] -> [B, num_labels]
        return self.classifier(torch.tanh(self.pooler(cls_rows)))


class _RobertaScoreHead(nn.Module):
    """RoBERTa's classification head: dense + tanh + out_proj on the <s> row."""

    def __init__(self, hidden: int, num_labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, num_labels)

    def forward(self, cls_rows: torch.Tensor) -> torch.Tensor:  # [B, H] -> [B, num_labels]
        return self.out_proj(torch.tanh(self.dense(cls_rows)))


class BertEncoder(nn.Module):
    """The encoder and, for a cross-encoder, its score head (``score_head``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hf, arch = cfg.hf_config, cfg.architecture
        self.roberta = is_roberta(arch)
        self.pad_id = int(hf.get("pad_token_id") or 0)
        self.embeddings = _Embeddings(hf)
        self.encoder = _Encoder(hf)
        self.score_head: nn.Module | None = None
        if arch in CROSS_ENCODERS:
            hidden, labels = int(hf["hidden_size"]), len(classification.labels(hf))
            head = _RobertaScoreHead if self.roberta else _BertScoreHead
            self.score_head = head(hidden, labels)
        self.position_offset = position_offset(hf, arch)

    @classmethod
    def kv_cache_layout(cls, cfg: ModelConfig, num_kv_heads: int) -> KVCacheLayout:
        """An encoder caches nothing; the scheduler's blocks only count a prompt's tokens."""
        return KVCacheLayout.key_value(1, 1)

    def positions(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # [B, S]
        """BERT: 0..S-1. RoBERTa: from pad_id + 1, skipping pad ids inside a prompt, as
        transformers counts them (a pad row keeps position pad_id)."""
        if not self.roberta:
            return torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        real = (ids != self.pad_id) & mask
        return torch.cumsum(real, dim=1) * real + self.pad_id

    def forward(
        self, ids: torch.Tensor, types: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:  # ids, types [B, S] int64; mask [B, S] bool -> [B, S, H]
        x = self.embeddings(ids, types, self.positions(ids, mask))
        attn_mask = mask[:, None, None, :]
        for layer in self.encoder.layer:
            x = layer(x, attn_mask)
        return x

    def score(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The cross-encoder's logits [B, num_labels] from the [CLS] rows of ``hidden``."""
        assert self.score_head is not None
        logits: torch.Tensor = self.score_head(hidden[:, 0])
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target = self._param_name(name)
            if target is None or target not in params:
                continue  # the embedding model's unused pooler, buffers (position_ids)
            with torch.no_grad():
                params[target].copy_(tensor)
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise MissingWeightsError(f"Checkpoint is missing weights: {', '.join(missing)}")

    def _param_name(self, name: str) -> str | None:
        """A checkpoint name -> this module's (the heads renamed; None: not ours)."""
        for prefix in _BASE_PREFIXES:
            name = name.removeprefix(prefix)
        renames = {
            "pooler.dense.": "score_head.pooler.",
            "classifier.dense.": "score_head.dense.",
            "classifier.out_proj.": "score_head.out_proj.",
            "classifier.": "score_head.classifier.",
        }
        if self.score_head is None:
            return None if name.startswith(("pooler.", "classifier.")) else name
        for old, new in renames.items():
            if name.startswith(old):
                return new + name.removeprefix(old)
        return name
