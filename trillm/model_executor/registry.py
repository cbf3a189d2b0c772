"""Architecture name (config.json ``architectures[0]``) -> model class, and what the class
computes that config.json may ask otherwise (its MLP activations, a partial rotary embedding).

Adding an architecture is one module under ``models/`` plus one line here. This table is read
without importing the model modules (and so torch): the frontend checks a config with it.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from trillm.model_executor.encoder_config import ACTIVATIONS as ENCODER_ACTIVATIONS
from trillm.model_executor.encoder_config import BERT_ARCHITECTURES as ENCODERS
from trillm.model_executor.modernbert_config import ACTIVATIONS as MODERNBERT_ACTIVATIONS
from trillm.model_executor.modernbert_config import ARCHITECTURES as MODERNBERTS

if TYPE_CHECKING:
    import torch
    from torch import nn

    from trillm.attention.kv_layout import KVCacheLayout
    from trillm.attention.ssm_state import SSMStateLayout
    from trillm.config import ModelConfig
    from trillm.distributed.pipeline import IntermediateTensors


class ModelEntry(NamedTuple):
    module: str  # under trillm.model_executor.models
    class_name: str
    activations: tuple[str, ...] = ("silu",)  # config.json's hidden_act the MLP computes
    partial_rotary: bool = False  # RoPE over part of each head (partial_rotary_factor < 1)
    # The input modalities besides text (a vision-language model: ("image",)); config.json
    # nests the language model's fields under ``text_config`` (model_config.py reads them).
    modalities: tuple[str, ...] = ()
    # Hybrid state-space: its Mamba layers keep a per-request state (``ssm_state_layout``).
    ssm_state: bool = False


_GEMMA_ACTS = ("gelu_pytorch_tanh", "gelu")  # models/gemma.py's _GELU: tanh-approximate, exact
_MODELS: dict[str, ModelEntry] = {
    **{arch: ModelEntry("bert", "BertEncoder", ENCODER_ACTIVATIONS) for arch in ENCODERS},
    **{
        arch: ModelEntry("modernbert", "ModernBertEncoder", MODERNBERT_ACTIVATIONS)
        for arch in MODERNBERTS
    },
    "BambaForCausalLM": ModelEntry(
        "bamba", "BambaForCausalLM", partial_rotary=True, ssm_state=True
    ),
    "DeepseekV2ForCausalLM": ModelEntry("deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ModelEntry("deepseek", "DeepseekV3ForCausalLM"),
    "GemmaForCausalLM": ModelEntry("gemma", "GemmaForCausalLM", _GEMMA_ACTS),
    "GraniteMoeHybridForCausalLM": ModelEntry(
        "granitemoehybrid", "GraniteMoeHybridForCausalLM", ssm_state=True
    ),
    "Gemma2ForCausalLM": ModelEntry("gemma", "Gemma2ForCausalLM", _GEMMA_ACTS),
    "Gemma3ForCausalLM": ModelEntry("gemma", "Gemma3ForCausalLM", _GEMMA_ACTS),
    "Gemma3ForConditionalGeneration": ModelEntry(
        "gemma3_mm", "Gemma3ForConditionalGeneration", _GEMMA_ACTS, modalities=("image",)
    ),
    "GPTNeoXForCausalLM": ModelEntry("gpt_neox", "GPTNeoXForCausalLM", ("gelu",), True),
    "GptOssForCausalLM": ModelEntry("gpt_oss", "GptOssForCausalLM"),
    "LlamaForCausalLM": ModelEntry("llama", "LlamaForCausalLM"),
    "Llama4ForCausalLM": ModelEntry("llama4", "Llama4ForCausalLM"),
    "Llama4ForConditionalGeneration": ModelEntry(
        "llama4", "Llama4ForConditionalGeneration", modalities=("image",)
    ),
    "LlavaForConditionalGeneration": ModelEntry(
        "llava", "LlavaForConditionalGeneration", modalities=("image",)
    ),
    "LlavaOnevisionForConditionalGeneration": ModelEntry(
        "llava_onevision",
        "LlavaOnevisionForConditionalGeneration",
        modalities=("image", "video"),
    ),
    "MistralForCausalLM": ModelEntry("mistral", "MistralForCausalLM"),
    "NemotronHForCausalLM": ModelEntry(
        "nemotron_h", "NemotronHForCausalLM", ("relu2",), ssm_state=True
    ),
    "Olmo2ForCausalLM": ModelEntry("olmo2", "Olmo2ForCausalLM"),
    "Phi3ForCausalLM": ModelEntry("phi3", "Phi3ForCausalLM", partial_rotary=True),
    "MixtralForCausalLM": ModelEntry("moe", "MixtralForCausalLM"),
    "Qwen2ForCausalLM": ModelEntry("qwen2", "Qwen2ForCausalLM"),
    "Qwen2VLForConditionalGeneration": ModelEntry(
        "qwen2_vl", "Qwen2VLForConditionalGeneration", modalities=("image", "video")
    ),
    "Qwen2_5_VLForConditionalGeneration": ModelEntry(
        "qwen2_vl", "Qwen2_5_VLForConditionalGeneration", modalities=("image", "video")
    ),
    "Qwen2AudioForConditionalGeneration": ModelEntry(
        "qwen2_audio", "Qwen2AudioForConditionalGeneration", modalities=("audio",)
    ),
    "Qwen3ForCausalLM": ModelEntry("qwen3", "Qwen3ForCausalLM"),
    "Qwen2MoeForCausalLM": ModelEntry("moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ModelEntry("moe", "Qwen3MoeForCausalLM"),
}


class CausalLM(Protocol):
    """What the runner needs of a model class (``models/llama.py`` is the reference)."""

    PP_CARRIES_RESIDUAL: bool  # a pipeline stage hands the next the residual stream too

    def __call__(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # per stage layer, kv_cache_layout().shape(...)
        meta: Any,  # AttentionMetadata
        intermediate: IntermediateTensors | None = None,  # from the stage before
    ) -> torch.Tensor | IntermediateTensors: ...  # [T, H]; to the next stage if not last

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # [n, H] -> [n, V]

    @classmethod
    def kv_cache_layout(cls, cfg: ModelConfig, num_kv_heads: int) -> KVCacheLayout: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def tie_weights(self) -> None: ...


class UnsupportedArchitectureError(ValueError):
    """config.json names an architecture trillm has no model for."""


# Architectures people ask for that need what trillm cannot run yet: the refusal says why.
_NOT_IMPLEMENTED = {
    "MllamaForConditionalGeneration": "Llama 3.2 Vision: its cross-attention layers (text "
    "attending to the vision encoder's states) are not implemented",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_entry(architecture: str) -> ModelEntry:
    if architecture not in _MODELS:
        why = f" ({_NOT_IMPLEMENTED[architecture]})" if architecture in _NOT_IMPLEMENTED else ""
        raise UnsupportedArchitectureError(
            f"Model architecture {architecture!r} is not supported{why}; supported "
            f"architectures: {', '.join(supported_architectures())}."
        )
    return _MODELS[architecture]


def kv_cache_layout(cfg: ModelConfig, num_kv_heads: int) -> KVCacheLayout:
    """One layer's KV cache per token as the model class declares it (``CausalLM``), for a
    rank holding ``num_kv_heads`` KV heads; known before the model is built."""
    model_class: Any = get_model_class(cfg.architecture)
    layout: KVCacheLayout = model_class.kv_cache_layout(cfg, num_kv_heads)
    return layout


def ssm_state_layout(cfg: ModelConfig, tp_size: int = 1) -> SSMStateLayout | None:
    """A hybrid state-space model's per-request state on one of ``tp_size`` ranks (its class's
    ``ssm_state_layout``); None for a model whose layers all keep the paged KV cache."""
    model_class: Any = get_model_class(cfg.architecture)
    layout_of = getattr(model_class, "ssm_state_layout", None)
    return None if layout_of is None else layout_of(cfg, tp_size)


def get_model_class(architecture: str) -> type[nn.Module]:
    entry = model_entry(architecture)
    module = importlib.import_module(f"trillm.model_executor.models.{entry.module}")
    return getattr(module, entry.class_name)
