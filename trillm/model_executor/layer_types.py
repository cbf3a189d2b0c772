"""Per-layer attention settings read from config.json: which layers use a sliding window, and
what share of each head the rotary embedding turns.

transformers 5 writes ``layer_types`` ("sliding_attention" / "full_attention" per layer); older
configs leave it out, and each architecture then has its own rule (below, as transformers
derives ``layer_types`` for them).
"""

from __future__ import annotations

from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"
# The rope scalings layers/rotary.py computes (kept here, torch-free: the frontend checks them).
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


GEMMA3_ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")


def _default_layer_types(hf: dict[str, Any], architecture: str, num_layers: int) -> list[str]:
    if architecture == "Gemma2ForCausalLM":  # every other layer, the first one sliding
        return [SLIDING if i % 2 == 0 else FULL for i in range(num_layers)]
    if architecture in GEMMA3_ARCHITECTURES:  # every ``sliding_window_pattern``-th layer global
        pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
        return [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not hf.get("use_sliding_window"):
            return [FULL] * num_layers
        first = int(hf.get("max_window_layers") or 0)
        return [SLIDING if i >= first else FULL for i in range(num_layers)]
    if architecture == "Qwen2MoeForCausalLM":  # every other layer below max_window_layers
        last = int(hf.get("max_window_layers") or 0) if hf.get("use_sliding_window") else 0
        return [SLIDING if (i + 1) % 2 and i < last else FULL for i in range(num_layers)]
    if architecture == "Qwen3MoeForCausalLM":
        return [SLIDING if hf.get("use_sliding_window") else FULL] * num_layers
    if architecture in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
        return [SLIDING] * num_layers  # a configured window covers every layer
    return [FULL] * num_layers  # transformers ignores a sliding_window key on the others


def layer_windows(hf: dict[str, Any], architecture: str, num_layers: int) -> list[int | None]:
    """The sliding window of each layer (None: full causal attention)."""
    window = hf.get("sliding_window")
    if not window:
        return [None] * num_layers
    types = hf.get("layer_types") or _default_layer_types(hf, architecture, num_layers)
    if len(types) != num_layers:
        raise ValueError(f"config.json has {len(types)} layer_types for {num_layers} layers.")
    unknown = set(types) - {SLIDING, FULL}
    if unknown:
        raise ValueError(
            f"Unsupported layer types {sorted(unknown)}; supported: {SLIDING}, {FULL}."
        )
    return [int(window) if kind == SLIDING else None for kind in types]


def partial_rotary_factor(hf: dict[str, Any]) -> float:
    """The share of each head's dims that RoPE rotates (GPT-NeoX ``rotary_pct``)."""
    params = hf.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if factor is None:
        factor = hf.get("rotary_pct", 1.0)
    return float(factor)
