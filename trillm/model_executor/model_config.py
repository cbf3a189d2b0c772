"""Model configuration: read the model folder's config.json (the folder: ``model_files.py``) or
a GGUF file's metadata into ``ModelConfig`` (architecture, dtype, RoPE, context length, EOS
ids, load format).

``config.json`` is read with both transformers-4 keys (``torch_dtype``, ``rope_theta``,
``rope_scaling``) and transformers-5 keys (``dtype``, ``rope_parameters``).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import trillm.model_executor.deepseek_config as deepseek_config
import trillm.model_executor.hybrid_ssm as hybrid_ssm
import trillm.model_executor.llama4_config as llama4_config
from trillm.config import DEVICES, LOAD_FORMATS, EngineArgs, ModelConfig
from trillm.model_executor import classification, gguf_loader, gpt_oss_config, multimodal_config
from trillm.model_executor.dtype_choice import (  # noqa: F401 - importers' names
    UnsupportedDtypeError,
    checkpoint_dtype,
    resolve_dtype,
)
from trillm.model_executor.encoder_config import position_offset
from trillm.model_executor.layer_types import FULL, SUPPORTED_ROPE_TYPES, partial_rotary_factor
from trillm.model_executor.model_files import read_generation_config, read_json, resolve_model_path
from trillm.model_executor.quantization import CHECKPOINT_METHODS, resolve_quantization
from trillm.model_executor.registry import (
    UnsupportedArchitectureError,
    model_entry,
    supported_architectures,
)

# The Llama family's loader (models/llama.py) places AWQ / GPTQ layers, stacked ones included.
GROUP_QUANT_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


# ---------------------------------------------------------------- the device


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``."""
    if device not in DEVICES:
        raise ValueError(f"Unknown device {device!r}; choose {', '.join(DEVICES)}.")
    if device == "cpu":
        return device
    available = cuda_available()
    if device == "cuda" and not available:
        raise ValueError("device='cuda' was requested but no CUDA GPU is available.")
    return "cuda" if available else "cpu"


def cuda_available() -> bool:
    """torch's answer, without importing torch (seconds, in an API server that never runs a
    tensor) where its build says no GPU can be seen: a CPU-only wheel (``+cpu``)."""
    try:
        if importlib.metadata.version("torch").endswith("+cpu"):
            return False
    except importlib.metadata.PackageNotFoundError:
        pass
    import torch

    return torch.cuda.is_available()


# ---------------------------------------------------------------- config.json -> ModelConfig


DEFAULT_SERVED_NAME = "trillm-default"  # what /v1/models lists for the embedded model


def load_model_config(args: EngineArgs) -> ModelConfig:
    """Resolve ``args.model`` (a folder or a GGUF file); read all the runner needs from it."""
    device = resolve_device(args.device)
    gguf_file = gguf_loader.find_gguf(args.model)
    check_load_format(args, gguf_file, device)
    quantization = None
    if gguf_file is not None:
        path, file = gguf_file, gguf_loader.GGUFFile(gguf_file)
        hf = apply_hf_overrides(file.hf_config(), args.hf_overrides)
        quantized = any(t in gguf_loader.QUANTIZED_TYPES for t in file.tensor_types.values())
        quantization = "gguf" if quantized and not args.dequantize_gguf else None
        generation_config = (
            {}
            if args.generation_config in ("auto", "vllm")
            else (read_generation_config(path, args.generation_config))
        )
    else:
        path = resolve_model_path(args.model, args.revision)
        hf = apply_hf_overrides(read_json(path / "config.json"), args.hf_overrides)
        generation_config = read_generation_config(path, args.generation_config)
        quantization = resolve_quantization(args.quantization, hf, device)
    architecture = _architecture(hf)
    hf, mm_config = multimodal_config.split_config(hf, architecture)  # text_config's fields
    hf = gpt_oss_config.prepare(hf, architecture)  # its defaults; MXFP4 for gpt-oss only
    hf = deepseek_config.prepare(hf, architecture)  # its defaults, MLA and routing checked
    hf = llama4_config.prepare(hf, architecture)  # its defaults and per-layer lists
    hf = hybrid_ssm.prepare(hf, architecture)  # Bamba, GraniteMoeHybrid: Mamba-2 fields checked
    if quantization in CHECKPOINT_METHODS and architecture not in GROUP_QUANT_ARCHITECTURES:
        raise ValueError(
            f"{quantization.upper()} checkpoints of {architecture} are not "
            f"supported; trillm runs them for {', '.join(GROUP_QUANT_ARCHITECTURES)}."
        )
    max_position_embeddings = int(hf.get("max_position_embeddings", 2048))
    num_heads = int(hf["num_attention_heads"])
    rope_theta, rope_scaling = parse_rope(hf)
    cfg = ModelConfig(
        model=str(path),
        tokenizer=args.tokenizer or str(path),
        served_model_name=args.served_model_name or args.model or DEFAULT_SERVED_NAME,
        architecture=architecture,
        dtype=resolve_dtype(args.dtype, checkpoint_dtype(hf), device, hf.get("model_type", "")),
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_hidden_layers=int(hf["num_hidden_layers"]),
        num_attention_heads=num_heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // num_heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_position_embeddings,
        max_model_len=resolve_max_model_len(hf, architecture, args.max_model_len),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False))
        and not classification.is_sequence_classifier(hf),  # its head is the score, not tied
        attention_bias=architecture == "Qwen2ForCausalLM" or bool(hf.get("attention_bias")),
        qk_norm=architecture == "Qwen3ForCausalLM",
        hidden_act=_hidden_act(hf, architecture),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_token_ids(hf, generation_config),
        generation_config=generation_config,
        hf_config=hf,
        quantization=quantization,
        mm_config=mm_config,
        load_format=args.load_format,
    )
    if quantization in CHECKPOINT_METHODS:  # packed words and groups split per rank, or refused
        from trillm.model_executor.quant_sharding import check_group_quant_split  # torch

        check_group_quant_split(cfg, args.tensor_parallel_size)
    return cfg


def apply_hf_overrides(hf: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """``hf_overrides`` laid over config.json as vLLM does: a key replaces the file's, except
    that an object given for a key whose value is an object (a sub-config) merges into it."""
    if not overrides:
        return hf
    if not isinstance(overrides, dict):
        raise ValueError(f"hf_overrides must be a JSON object, got {overrides!r}.")
    merged = dict(hf)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = apply_hf_overrides(merged[key], value)
        else:
            merged[key] = value
    return merged


def check_load_format(args: EngineArgs, gguf_file: Path | None, device: str) -> None:
    """vLLM's ``load_format`` / ``quantization`` for a GGUF model: honoured or refused."""
    if args.load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format {args.load_format!r} is not supported; choose one of "
            f"{', '.join(LOAD_FORMATS)}."
        )
    if args.load_format == "dummy" and gguf_file is not None:
        raise ValueError(
            "load_format='dummy' builds random weights from a config.json; "
            f"{str(gguf_file)!r} is a GGUF file (its weights are its config)."
        )
    if gguf_file is None:
        for given, what in (
            (args.load_format == "gguf", "load_format='gguf'"),
            (args.quantization == "gguf", "quantization='gguf'"),
            (args.dequantize_gguf, "dequantize_gguf"),
        ):
            if given:
                raise ValueError(
                    f"{what} needs a .gguf model file (or a folder holding one), "
                    f"got {args.model!r}."
                )
        return
    if args.quantization not in (None, "gguf"):
        raise ValueError(
            f"quantization {args.quantization!r} does not apply to a GGUF model: its tensors "
            "come quantized (quantization='gguf' keeps them so, the default)."
        )
    if args.load_format == "safetensors":
        raise ValueError(f"load_format='safetensors' but {str(gguf_file)!r} is a GGUF file.")
    if args.quantization == "gguf" and args.dequantize_gguf:
        raise ValueError(
            "quantization='gguf' keeps the GGUF weights quantized; "
            "dequantize_gguf asks the opposite: choose one."
        )
    if device != "cpu" and not args.dequantize_gguf:
        raise ValueError(
            "GGUF quantized weights are kept quantized on CPU only; on "
            f"{device}, pass dequantize_gguf (--dequantize-gguf)."
        )


def _architecture(hf: dict[str, Any]) -> str:
    architectures = hf.get("architectures") or []
    if not architectures:
        raise UnsupportedArchitectureError(
            "config.json names no architecture; supported architectures: "
            f"{', '.join(supported_architectures())}."
        )
    architecture = architectures[0]
    if architecture.endswith(classification.SUFFIX):  # the decoder, then a score head
        architecture = classification.causal_architecture(architecture)
    model_entry(architecture)  # an UnsupportedArchitectureError naming it (and why, if known)
    return architecture


def _hidden_act(hf: dict[str, Any], architecture: str) -> str:
    """The MLP activation (Gemma 2/3 name it ``hidden_activation``), refused unless the model
    class computes it; also refuses a partial rotary embedding the class does not apply."""
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    entry = model_entry(architecture)
    supported = entry.activations
    if act not in supported:
        raise ValueError(
            f"Activation {act!r} is not supported for {architecture}; supported: "
            f"{', '.join(supported)}."
        )
    if partial_rotary_factor(hf) != 1.0 and not entry.partial_rotary:
        raise ValueError(
            f"partial_rotary_factor {partial_rotary_factor(hf)} is not supported for "
            f"{architecture} (RoPE over the whole head only)."
        )
    return act


# transformers' Phi3Config default for ``original_max_position_embeddings``.
PHI3_ORIGINAL_MAX_POSITIONS = 4096


def parse_rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from transformers-5 ``rope_parameters`` or -4 keys.

    ``rope_scaling`` is ``None`` for plain RoPE, else ``{"rope_type": ..., fields...}`` with
    ``original_max_position_embeddings`` filled in for llama3/yarn/longrope as transformers does.

    longrope is Phi-3's (``model_type`` "phi3", transformers' ``Phi3Config``; refused for
    others, whose ``generate`` keeps a cache across the switch of tables, see layers/rotary.py):
    "su" and "yarn" are its older names, and ``original_max_position_embeddings`` is the
    top-level key (4096 when absent), whatever the rope dict says, as transformers reads it.
    """
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if isinstance(params.get(FULL), dict):  # per layer type (Gemma 3): the global layers'
        return parse_rope({**hf, "rope_parameters": params[FULL]})
    params.pop("partial_rotary_factor", None)  # see layer_types.partial_rotary_factor
    # GPT-NeoX's transformers-4 configs name the base ``rotary_emb_base``
    default_theta = hf.get("rope_theta", hf.get("rotary_emb_base", 10000.0))
    rope_theta = float(params.pop("rope_theta", default_theta))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    phi3 = hf.get("model_type") == "phi3"
    if phi3 and rope_type in ("su", "yarn"):
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"Unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}."
        )
    if rope_type == "default":
        return rope_theta, None
    if rope_type in ("llama3", "yarn"):
        original = hf.get("original_max_position_embeddings")
        if original is not None:
            params["original_max_position_embeddings"] = original
        params.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    if rope_type == "longrope":
        if not phi3:
            raise ValueError(
                "longrope rope scaling is supported for Phi-3 models (model_type 'phi3') only, "
                f"got model_type {hf.get('model_type')!r}."
            )
        original = hf.get("original_max_position_embeddings", PHI3_ORIGINAL_MAX_POSITIONS)
        params["original_max_position_embeddings"] = int(original)
    return rope_theta, {"rope_type": rope_type, **params}


def resolve_max_model_len(hf: dict[str, Any], architecture: str, requested: int | None) -> int:
    """Default: max_position_embeddings (a sliding window does not cap it: the attention
    backends honour the window)."""
    limit = int(hf.get("max_position_embeddings", 2048)) - position_offset(hf, architecture)
    why = "max_position_embeddings"
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len={requested} is larger than the model's {why} ({limit}).")
    if requested < 1:
        raise ValueError(f"max_model_len must be at least 1, got {requested}.")
    return requested


def eos_token_ids(hf: dict[str, Any], generation_config: dict[str, Any]) -> list[int]:
    """Union of config.json's and generation_config.json's EOS ids, config's first."""
    ids: list[int] = []
    for source in (hf.get("eos_token_id"), generation_config.get("eos_token_id")):
        for token in source if isinstance(source, list) else [source]:
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    return ids
