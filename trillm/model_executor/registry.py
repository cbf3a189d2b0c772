"""Architecture name (config.json ``architectures[0]``) -> model class.

Adding an architecture is one module under ``models/`` plus one line here.
"""

from __future__ import annotations

import importlib

from torch import nn

# architecture -> (module under trillm.model_executor.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
}


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
