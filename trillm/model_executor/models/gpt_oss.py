"""gpt-oss (``GptOssForCausalLM``): the Llama decoder with gpt-oss's attention and experts, as
transformers' ``modeling_gpt_oss`` computes them.

- Attention: q/k/v/o biased (``attention_bias``), a window on the layers ``layer_types`` calls
  sliding, and a learned sink logit per head (``self_attn.sinks``) that joins each row's
  softmax without a value, so a row may give attention to nothing. Backends without sinks are
  refused when the model is built (``check_backend_supports_sinks``).
- MLP: every layer a mixture of experts. The router (``mlp.router``, [E, H] with a bias)
  picks the ``num_experts_per_tok`` largest logits and softmaxes those (top-k, then softmax).
  Each expert: ``gate_up = x @ gate_up_proj[e] + bias`` ([H, 2I], gate and up interleaved
  column by column), the clamped SwiGLU ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)``
  with ``g = clamp(gate, max=l)`` (``swiglu_limit``, ``swiglu_alpha``), then
  ``@ down_proj[e] + bias`` ([I, H]).
- YaRN RoPE as its config has it (``layers/rotary.py``; ``truncate`` honoured).

Expert tensors keep transformers' names and layouts, so the Llama loader loads them by name;
an MXFP4 checkpoint's ``*_blocks`` / ``*_scales`` pairs are dequantized on the way in
(``model_executor/mxfp4.py``), with a warning saying what it costs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from trillm.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    check_backend_supports_sinks,
)
from trillm.config import ModelConfig
from trillm.distributed.parallel_state import get_tp_group
from trillm.model_executor import mxfp4
from trillm.model_executor.gpt_oss_config import MXFP4
from trillm.model_executor.layer_types import layer_windows
from trillm.model_executor.layers.rotary import RotaryEmbedding
from trillm.model_executor.models.llama import (
    LlamaAttention,
    LlamaDecoderFlags,
    LlamaForCausalLM,
    LlamaModel,
    rank_shapes,
)
from trillm.model_executor.models.moe import num_experts, refuse_quantized_experts
from trillm.model_executor.models.stacked_weights import MissingWeightsError
from trillm.model_executor.quantization import checkpoint_method


class GptOssAttention(LlamaAttention):
    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        flags: LlamaDecoderFlags,
        window: int | None,
    ) -> None:
        super().__init__(cfg, backend, flags, window)
        check_backend_supports_sinks(backend)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))  # [Hq] logits

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H]
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        q, k, v = self.project_qkv(hidden)  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
        rotary(positions, q, k)  # in place: q and k are views of the qkv buffer
        out = self.backend.forward(
            q, k, v, kv_cache, meta, self.scale, window=self.window, sinks=self.sinks
        )  # [T, Hq, D]
        return self.project_out(out)


class GptOssExperts(nn.Module):
    """Every expert's projections in transformers' layout and names (``[E, in, out]``); under
    tensor parallelism this rank's share of each expert's intermediate size (its gate/up
    column pairs, its down rows: ``sharding.RankShapes._gpt_oss_shard``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hf = cfg.hf_config
        experts, hidden = num_experts(hf), cfg.hidden_size
        inter = rank_shapes(cfg)[1].inter_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, hidden, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(experts, inter, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden))
        self.alpha = float(hf["swiglu_alpha"])
        self.limit = float(hf["swiglu_limit"])

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:  # [n, 2I] -> [n, I]
        gate = gate_up[:, ::2].clamp(max=self.limit)
        up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        weights: torch.Tensor,  # [T, k] routing weights
        ids: torch.Tensor,  # [T, k] expert of each
    ) -> torch.Tensor:  # [T, H]
        out = torch.zeros_like(x)
        for expert in torch.unique(ids).tolist():  # ascending, as transformers adds them
            tokens, slot = torch.where(ids == expert)
            gate_up = x[tokens] @ self.gate_up_proj[expert] + self.gate_up_proj_bias[expert]
            y = self.swiglu(gate_up) @ self.down_proj[expert] + self.down_proj_bias[expert]
            out.index_add_(0, tokens, y * weights[tokens, slot, None])
        return out


class GptOssMoE(nn.Module):
    """Router and experts (HF's ``mlp.router`` / ``mlp.experts``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        experts, self.top_k = num_experts(cfg.hf_config), int(cfg.hf_config["num_experts_per_tok"])
        if not 0 < self.top_k <= experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in 1..{experts}.")
        self.router = nn.Linear(cfg.hidden_size, experts, bias=True)  # replicated
        self.experts = GptOssExperts(cfg)
        self.tp = get_tp_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        top, ids = torch.topk(self.router(x), self.top_k, dim=-1)  # [T, k] each
        out = self.experts(x, torch.softmax(top, dim=-1), ids)
        return self.tp.all_reduce(out)  # the ranks' partial sums


class GptOssModel(LlamaModel):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, flags: LlamaDecoderFlags):
        super().__init__(cfg, backend, flags)
        windows = layer_windows(cfg.hf_config, cfg.architecture, cfg.num_hidden_layers)
        for layer, window in zip(self.layers, windows):
            layer.self_attn = GptOssAttention(cfg, backend, flags, window)
            layer.mlp = GptOssMoE(cfg)


class GptOssForCausalLM(LlamaForCausalLM):
    MODEL_CLASS = GptOssModel

    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, device: torch.device | str = "cpu"
    ) -> None:
        refuse_quantized_experts(
            cfg, "gpt-oss's experts", " (an MXFP4 checkpoint is dequantized at load)"
        )
        super().__init__(cfg, backend, device)
        method = checkpoint_method(cfg.hf_config)
        self.mxfp4 = method is not None and method.lower() == MXFP4

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._dequantized(weights) if self.mxfp4 else weights)

    def _dequantized(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each ``*_blocks`` / ``*_scales`` pair as the dequantized tensor it stands for (in
        whichever order the files hold them); every other tensor as it is."""
        dtype = getattr(torch, self.config.dtype)
        pending: dict[str, dict[str, torch.Tensor]] = {}  # tensor name -> its parts so far
        warned = False
        for name, tensor in weights:
            suffix = next((s for s in (mxfp4.BLOCKS, mxfp4.SCALES) if name.endswith(s)), None)
            if suffix is None:
                yield name, tensor
                continue
            base = name.removesuffix(suffix)
            parts = pending.setdefault(base, {})
            parts[suffix] = tensor
            if len(parts) < 2:
                continue
            del pending[base]
            if not warned:
                mxfp4.warn_dequantized(self._num_expert_weights(), dtype)
                warned = True
            yield base, mxfp4.dequantize(parts[mxfp4.BLOCKS], parts[mxfp4.SCALES], dtype)
        if pending:
            name, parts = next(iter(pending.items()))
            raise MissingWeightsError(
                f"MXFP4 checkpoint has {name}{next(iter(parts))} without its other half "
                f"({len(pending)} such tensor(s))."
            )

    def _num_expert_weights(self) -> int:
        cfg = self.config
        per_layer = num_experts(cfg.hf_config) * 3 * cfg.hidden_size * cfg.intermediate_size
        return per_layer * cfg.num_hidden_layers
