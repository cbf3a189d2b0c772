"""Architecture name (config.json ``architectures[0]``) -> model class.

Adding an architecture is one module under ``models/`` plus one line here.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch import nn

from trillm.distributed.pipeline import IntermediateTensors

# architecture -> (module under trillm.model_executor.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "GemmaForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
    "GPTNeoXForCausalLM": ("gpt_neox", "GPTNeoXForCausalLM"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "Olmo2ForCausalLM": ("olmo2", "Olmo2ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "MixtralForCausalLM": ("moe", "MixtralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen2MoeForCausalLM": ("moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("moe", "Qwen3MoeForCausalLM"),
}


class CausalLM(Protocol):
    """What the runner needs of a model class (``models/llama.py`` is the reference)."""

    PP_CARRIES_RESIDUAL: bool  # a pipeline stage hands the next the residual stream too

    def __call__(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # per stage layer [2, num_blocks, block_size, Hkv, D]
        meta: Any,  # AttentionMetadata
        intermediate: IntermediateTensors | None = None,  # from the stage before
    ) -> torch.Tensor | IntermediateTensors: ...  # [T, H]; to the next stage if not last

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # [n, H] -> [n, V]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def tie_weights(self) -> None: ...


class UnsupportedArchitectureError(ValueError):
    """config.json names an architecture trillm has no model for."""


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def is_supported(architecture: str) -> bool:
    return architecture in _MODELS


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise UnsupportedArchitectureError(
            f"Model architecture {architecture!r} is not supported; supported architectures: "
            f"{', '.join(supported_architectures())}."
        )
    module_name, class_name = _MODELS[architecture]
    module = importlib.import_module(f"trillm.model_executor.models.{module_name}")
    return getattr(module, class_name)
