"""Mixture-of-experts decoders: the Llama decoder with a ``SparseMoeBlock`` in place of the
MLP on its sparse layers (Mixtral: every layer; Qwen MoE: as ``decoder_sparse_step`` and
``mlp_only_layers`` say). Subclasses say how their config names the experts.

Loading: expert weights (``mlp.experts.N.{w1,w3,w2|gate_proj,up_proj,down_proj}.weight``, or
the fused ``mlp.experts.gate_up_proj`` / ``down_proj``) go to the layer's ``FusedMoE``; every
other name goes through the Llama loader; a missing expert weight is an error naming it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from trillm.attention.backend import AttentionBackend
from trillm.config import ModelConfig
from trillm.model_executor.layers.fused_moe import EXPERT_PARTS, FusedMoE, SparseMoeBlock
from trillm.model_executor.models.llama import (
    DecoderStack,
    LlamaDecoderFlags,
    LlamaForCausalLM,
    LlamaModel,
)
from trillm.model_executor.models.stacked_weights import MissingWeightsError
from trillm.model_executor.quantization import UnsupportedQuantizationError

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight$")
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def num_experts(hf: dict) -> int:
    """Checkpoints name it ``num_experts`` (Qwen MoE) or ``num_local_experts`` (Mixtral, and
    transformers 5 for both)."""
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)


def refuse_quantized_experts(cfg: ModelConfig, subject: str, note: str = "") -> None:
    """A --quantization method replaces nn.Linear layers; experts are not ones, so it would
    skip most weights: refused, naming ``subject`` (the layers it does not cover)."""
    if cfg.quantization is not None:
        raise UnsupportedQuantizationError(
            f"--quantization {cfg.quantization} does not cover {subject}; serve this model "
            f"unquantized{note}."
        )


def check_experts_loaded(model: nn.Module) -> None:
    """Raises naming the first few expert weights that no checkpoint tensor filled."""
    missing = [
        f"{name}.{part}"
        for name, module in model.named_modules()
        if isinstance(module, FusedMoE)
        for part in module.missing()
    ]
    if missing:
        raise MissingWeightsError(
            f"Checkpoint is missing {len(missing)} expert weight(s), e.g. {missing[:5]}."
        )


class MoEModel(LlamaModel):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, flags: LlamaDecoderFlags):
        super().__init__(cfg, backend, flags)
        owner = _MOE_CLASSES[cfg.architecture]
        for index, layer in enumerate(self.layers):
            if owner.is_sparse(cfg, index):
                layer.mlp = owner.moe_block(cfg)


class MoEForCausalLM(LlamaForCausalLM):
    MODEL_CLASS: type[DecoderStack] = MoEModel  # DeepSeek: its own
    RENAMES: tuple[tuple[str, str], ...] = ()  # checkpoint name part -> ours

    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, device: torch.device | str = "cpu"
    ) -> None:
        refuse_quantized_experts(cfg, f"mixture-of-experts layers yet ({cfg.architecture})")
        super().__init__(cfg, backend, device)

    @classmethod
    def is_sparse(cls, cfg: ModelConfig, layer: int) -> bool:
        return True

    @classmethod
    def moe_block(cls, cfg: ModelConfig) -> SparseMoeBlock:
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._route_experts(weights))
        check_experts_loaded(self)

    def _route_experts(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Loads the expert tensors into their FusedMoE; yields every other tensor."""
        for name, tensor in weights:
            for old, new in self.RENAMES:
                name = name.replace(old, new)
            if match := _EXPERT.match(name):
                path, expert, proj = match.groups()
                if proj not in EXPERT_PARTS:
                    raise MissingWeightsError(f"Checkpoint has an unexpected weight {name!r}.")
                self._experts(path).load_expert(int(expert), EXPERT_PARTS[proj], tensor)
            elif match := _FUSED.match(name):
                self._experts(match.group(1)).load_fused(match.group(2), tensor)
            else:
                yield name, tensor

    def _experts(self, path: str) -> FusedMoE:
        try:
            module = self.get_submodule(path)
        except AttributeError:
            module = None
        if not isinstance(module, FusedMoE):
            raise MissingWeightsError(f"Checkpoint has experts at {path!r}, a dense layer here.")
        return module


class MixtralForCausalLM(MoEForCausalLM):
    """Mixtral: every layer sparse, top-k weights always renormalized."""

    O_BIAS_FOLLOWS_CONFIG = False
    RENAMES = ((".block_sparse_moe.", ".mlp."),)

    @classmethod
    def moe_block(cls, cfg: ModelConfig) -> SparseMoeBlock:
        hf = cfg.hf_config
        return SparseMoeBlock(
            cfg,
            num_experts(hf),
            int(hf["num_experts_per_tok"]),
            cfg.intermediate_size,
            renormalize=True,
        )


class _QwenMoE(MoEForCausalLM):
    @classmethod
    def is_sparse(cls, cfg: ModelConfig, layer: int) -> bool:
        hf = cfg.hf_config
        step = int(hf.get("decoder_sparse_step", 1) or 1)
        return (
            layer not in (hf.get("mlp_only_layers") or [])
            and num_experts(hf) > 0
            and (layer + 1) % step == 0
        )

    @classmethod
    def moe_block(cls, cfg: ModelConfig) -> SparseMoeBlock:
        hf = cfg.hf_config
        return SparseMoeBlock(
            cfg,
            num_experts(hf),
            int(hf["num_experts_per_tok"]),
            int(hf["moe_intermediate_size"]),
            renormalize=bool(hf.get("norm_topk_prob", False)),
            shared_inter=int(hf.get("shared_expert_intermediate_size", 0) or 0)
            if cls.SHARED_EXPERT
            else 0,
        )

    SHARED_EXPERT = False


class Qwen2MoeForCausalLM(_QwenMoE):
    """Qwen2-MoE: Qwen2's q/k/v biases, a sigmoid-gated shared expert beside the routed ones."""

    QKV_BIAS_ALWAYS = True
    O_BIAS_FOLLOWS_CONFIG = False
    SHARED_EXPERT = True


class Qwen3MoeForCausalLM(_QwenMoE):
    """Qwen3-MoE: Qwen3's q/k norms, no shared expert."""

    QK_NORM = True


_MOE_CLASSES: dict[str, type[MoEForCausalLM]] = {
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}
