"""PEFT adapter folders: ``adapter_config.json`` + ``adapter_model.safetensors``.

What trillm runs: LoRA (``peft_type`` LORA) on the decoder's q/k/v/o/gate/up/down projections,
scale ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``). Everything else PEFT
can express (DoRA, ``modules_to_save``, trained biases, per-module rank/alpha patterns,
embedding or head targets, ``fan_in_fan_out``) is refused with ``LoRAAdapterError`` naming it,
never loaded as if it were plain LoRA.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trillm.config import ModelConfig
from trillm.lora.files import (
    MAX_CONFIG_BYTES,
    MAX_HEADER_BYTES,
    read_regular_file,
    regular_file_size,
)

if TYPE_CHECKING:  # torch only where weights load (the worker): the API server checks shapes
    import torch

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
# Decoders whose q/k/v/o and gate/up/down projections are LlamaAttention's and the gated MLP's.
LORA_ARCHITECTURES = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "GemmaForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
    }
)
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])"
    r"(?:\.default)?\.weight$"
)


class LoRAAdapterError(ValueError):
    """The adapter cannot be used: unreadable, or asks for something trillm does not run."""


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    target_modules: tuple[str, ...]


@dataclass
class AdapterWeights:
    config: AdapterConfig
    # (layer index, HF projection name) -> (A [r, in], B [out, r])
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def _refuse(path: Path, what: str) -> LoRAAdapterError:
    return LoRAAdapterError(f"LoRA adapter {str(path)!r}: {what}")


def read_adapter_config(path: str | Path, max_lora_rank: int) -> AdapterConfig:
    """The adapter's config, checked; ``LoRAAdapterError`` naming what is not implemented."""
    folder = Path(path)
    file = folder / CONFIG_NAME
    try:
        raw = json.loads(read_regular_file(file, MAX_CONFIG_BYTES))
    except (OSError, ValueError) as exc:
        raise _refuse(folder, f"cannot read {CONFIG_NAME}: {exc}") from exc
    if not isinstance(raw, dict):
        raise _refuse(folder, f"{CONFIG_NAME} is not a JSON object.")
    peft_type = str(raw.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise _refuse(folder, f"peft_type {peft_type} is not implemented (only LORA).")
    for key, what in (
        ("use_dora", "DoRA (use_dora)"),
        ("modules_to_save", "modules_to_save"),
        ("rank_pattern", "rank_pattern"),
        ("alpha_pattern", "alpha_pattern"),
        ("fan_in_fan_out", "fan_in_fan_out"),
        ("layer_replication", "layer_replication"),
        ("lora_bias", "lora_bias"),
        ("target_parameters", "target_parameters"),
        ("trainable_token_indices", "trainable_token_indices"),
        ("alora_invocation_tokens", "aLoRA (alora_invocation_tokens)"),
        ("use_qalora", "QA-LoRA (use_qalora)"),
        ("use_bdlora", "use_bdlora"),
    ):
        if raw.get(key):
            raise _refuse(folder, f"{what} is not implemented.")
    if raw.get("bias", "none") != "none":
        raise _refuse(folder, f"bias={raw['bias']!r} is not implemented (only 'none').")
    rank = raw.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise _refuse(folder, f"r must be a positive integer, got {rank!r}.")
    if rank > max_lora_rank:
        raise _refuse(folder, f"rank {rank} exceeds max_lora_rank={max_lora_rank}.")
    targets = raw.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise _refuse(folder, f"target_modules must be a list of module names, got {targets!r}.")
    bad = sorted(set(targets) - set(SUPPORTED_TARGETS))
    if bad:
        raise _refuse(
            folder,
            f"target module(s) {bad} are not supported (LoRA runs on "
            f"{', '.join(SUPPORTED_TARGETS)}).",
        )
    alpha = float(raw.get("lora_alpha", 8))
    scale = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    return AdapterConfig(rank, scale, tuple(sorted(targets)))


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """HF projection -> (in_features, out_features) of the decoder's linears."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def max_weights_bytes(cfg: ModelConfig, rank: int) -> int:
    """The largest weights file an adapter of ``rank`` on this model can be: every target on
    every layer, in float64, plus its header."""
    per_layer = sum(fan_in + fan_out for fan_in, fan_out in module_shapes(cfg).values())
    return cfg.num_hidden_layers * per_layer * rank * 8 + MAX_HEADER_BYTES


def check_adapter(path: str | Path, cfg: ModelConfig, max_lora_rank: int) -> AdapterConfig:
    """Config and weight names/shapes checked against the model, without reading the weights
    (the frontend's check before a request or a load is accepted)."""
    config = read_adapter_config(path, max_lora_rank)
    _read_weights(Path(path), cfg, config, load=False)
    return config


def load_adapter(path: str | Path, cfg: ModelConfig, max_lora_rank: int) -> AdapterWeights:
    """The adapter's A/B matrices (fp32, CPU), checked against the model (worker side)."""
    config = read_adapter_config(path, max_lora_rank)
    return AdapterWeights(config, _read_weights(Path(path), cfg, config, load=True))


def _read_weights(
    folder: Path, cfg: ModelConfig, config: AdapterConfig, *, load: bool
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    from safetensors import safe_open

    file = folder / WEIGHTS_NAME
    try:
        regular_file_size(file, max_weights_bytes(cfg, config.rank))
    except FileNotFoundError:
        raise _refuse(
            folder, f"{WEIGHTS_NAME} not found (only safetensors adapters load)."
        ) from None
    except OSError as exc:
        raise _refuse(folder, f"cannot read {WEIGHTS_NAME}: {exc}") from exc
    shapes = module_shapes(cfg)
    halves: dict[tuple[int, str], dict[str, Any]] = {}  # "A"/"B": a tensor, or its shape
    try:
        with safe_open(str(file), framework="pt" if load else "numpy") as f:
            for key in f.keys():
                layer, proj, half = _parse_key(folder, key, cfg, config)
                value = f.get_tensor(key) if load else tuple(f.get_slice(key).get_shape())
                halves.setdefault((layer, proj), {})[half] = value
    except LoRAAdapterError:
        raise
    except Exception as exc:  # safetensors raises its own types for a corrupt file
        raise _refuse(folder, f"cannot read {WEIGHTS_NAME}: {exc}") from exc
    if not halves:
        raise _refuse(folder, f"{WEIGHTS_NAME} holds no LoRA weights.")
    modules = {}
    for (layer, proj), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise _refuse(folder, f"layer {layer} {proj} lacks lora_A or lora_B.")
        a, b = pair["A"], pair["B"]
        a_shape = a if isinstance(a, tuple) else tuple(a.shape)
        b_shape = b if isinstance(b, tuple) else tuple(b.shape)
        fan_in, fan_out = shapes[proj]
        if a_shape != (config.rank, fan_in) or b_shape != (fan_out, config.rank):
            raise _refuse(
                folder,
                f"layer {layer} {proj}: lora_A {a_shape} / lora_B {b_shape} do not fit "
                f"the model ({config.rank}, {fan_in}) / ({fan_out}, {config.rank}).",
            )
        if load:
            modules[(layer, proj)] = (a.float().contiguous(), b.float().contiguous())
    return modules


def _parse_key(
    folder: Path, key: str, cfg: ModelConfig, config: AdapterConfig
) -> tuple[int, str, str]:
    m = _KEY.match(key)
    if m is None:
        raise _refuse(
            folder, f"weight {key!r} is not a LoRA weight of a decoder projection trillm supports."
        )
    layer, block, proj, half = int(m.group(1)), m.group(2), m.group(3), m.group(4)
    expected = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    if proj not in SUPPORTED_TARGETS or block != expected:
        raise _refuse(folder, f"weight {key!r} targets a module the model lacks.")
    if layer >= cfg.num_hidden_layers:
        raise _refuse(folder, f"weight {key!r}: the model has {cfg.num_hidden_layers} layers.")
    return layer, proj, half
