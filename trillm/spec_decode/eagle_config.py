"""``{"method": "eagle" | "eagle3", "model": HEAD}``, the engine side: the head's config.json
read into a ``ModelConfig`` (in the target's dtype and length), every field honoured or refused
by name before anything loads.

An EAGLE head (v1/v2, e.g. ``yuhuili/EAGLE-LLaMA3-Instruct-8B``) is Llama decoder layers whose
first one has no input norm and takes ``fc(cat(embed(token), target_hidden))``; an EAGLE-3
head (``LlamaForCausalLMEagle3``) takes the target's residual stream before three of its
layers, ``fc``-projected, and its first layer attends over ``cat(norm(embed), norm(hidden))``
(width 2H); it may have its own smaller vocabulary (``draft_vocab_size``, ``d2t``). The worker
side is ``eagle_head.py`` (the module) and ``eagle_proposer.py`` (drafting).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trillm.config import EngineArgs, ModelConfig
from trillm.model_executor.config_fields import COMMON_FIELDS, READ
from trillm.model_executor.model_config import parse_rope
from trillm.model_executor.model_files import resolve_model_path
from trillm.spec_decode.config import DraftModelError, SpeculativeConfig

ARCHITECTURES = {
    "eagle": ("LlamaForCausalLM", "EagleLlamaForCausalLM", "LlamaForCausalLMEagle"),
    "eagle3": ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"),
}
# Targets whose layers carry Llama's folded residual (the stream EAGLE-3 reads before a layer).
EAGLE3_TARGETS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# The head's config.json fields and what trillm does with each; any other is refused.
FIELDS: dict[str, str] = {
    **COMMON_FIELDS,
    "model_type": "must be llama",
    "vocab_size": "must be the target's",
    "hidden_size": READ,
    "intermediate_size": READ,
    "num_hidden_layers": READ,
    "num_attention_heads": READ,
    "num_key_value_heads": READ,
    "head_dim": READ,
    "hidden_act": "must be silu",
    "rms_norm_eps": READ,
    "rope_theta": READ,
    "rope_scaling": READ,
    "rope_parameters": READ,
    "max_position_embeddings": READ,
    "attention_bias": READ,
    "mlp_bias": READ,
    "tie_word_embeddings": "must be false (a head's lm_head is its own or the target's)",
    "torch_dtype": "the target's dtype is used, as vLLM does",
    "dtype": "the target's dtype is used, as vLLM does",
    "bos_token_id": "the target's tokens are used",
    "eos_token_id": "the target's tokens are used",
    "pretraining_tp": "must be 1",
    "bias": "EAGLE: fc's bias, read from the weights when present",
    "add_para_norm": "EAGLE (HASS): norms on the embeddings and the hidden states",
    "draft_vocab_size": "EAGLE-3: the head's own vocabulary (d2t maps it to the target's)",
    "target_hidden_size": "EAGLE-3: the target's width, fc's input is three of it",
    "norm_before_residual": "EAGLE-3: the residual taken after hidden_norm",
    "eagle_config": "EAGLE-3: eagle_aux_hidden_state_layer_ids and use_aux_hidden_state",
    "logit_scale": "positive: drafts are the argmax, which a positive scale keeps",
}
_EAGLE3_KEYS = {"eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state"}


def _refuse(spec: SpeculativeConfig, what: str) -> DraftModelError:
    return DraftModelError(f"speculative_config: {spec.method} head {spec.model!r}: {what}")


def build_eagle_head_config(
    args: EngineArgs, spec: SpeculativeConfig, target: ModelConfig
) -> ModelConfig:
    """The head's ModelConfig (its config.json in ``hf_config``, with ``aux_layers`` for
    EAGLE-3); DraftModelError naming what cannot be served."""
    if args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1:
        raise _refuse(
            spec, "EAGLE heads run with tensor_parallel_size and pipeline_parallel_size 1 only."
        )
    try:
        path = resolve_model_path(spec.model)
        hf = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise _refuse(spec, str(exc)) from None
    _check_fields(spec, hf, target)
    num_heads = int(hf["num_attention_heads"])
    rope_theta, rope_scaling = parse_rope(hf)
    # What the worker builds from: the method and (EAGLE-3) the target layers read.
    hf = {**hf, "eagle_method": spec.method, "aux_layers": _aux_layers(spec, hf, target)}
    return ModelConfig(
        model=str(path),
        tokenizer=target.tokenizer,
        served_model_name=target.served_model_name,
        # Llama layers (what engine-wide checks look up); eagle_head.py wires them.
        architecture="LlamaForCausalLM",
        dtype=target.dtype,
        vocab_size=target.vocab_size,
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_hidden_layers=int(hf["num_hidden_layers"]),
        num_attention_heads=num_heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // num_heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", target.max_model_len)),
        max_model_len=target.max_model_len,
        tie_word_embeddings=False,
        attention_bias=bool(hf.get("attention_bias", False)),
        qk_norm=False,
        hidden_act="silu",
        bos_token_id=target.bos_token_id,
        eos_token_ids=target.eos_token_ids,
        hf_config=hf,
        numerics=target.numerics,
    )


def _check_fields(spec: SpeculativeConfig, hf: dict[str, Any], target: ModelConfig) -> None:
    unknown = sorted(set(hf) - set(FIELDS))
    if unknown:
        raise _refuse(spec, f"config field(s) {', '.join(unknown)} are not supported.")
    arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch not in ARCHITECTURES[spec.method]:
        raise _refuse(
            spec,
            f"architecture {arch} is not an {spec.method} head (expected one of "
            f"{', '.join(ARCHITECTURES[spec.method])}).",
        )
    checks = [
        (hf.get("model_type", "llama") == "llama", "model_type must be llama"),
        (
            int(hf.get("vocab_size", -1)) == target.vocab_size,
            f"vocab_size {hf.get('vocab_size')} is not the target's {target.vocab_size}",
        ),
        (hf.get("hidden_act", "silu") == "silu", "hidden_act must be silu"),
        (not hf.get("tie_word_embeddings", False), "tie_word_embeddings must be false"),
        (int(hf.get("pretraining_tp", 1)) == 1, "pretraining_tp must be 1"),
        (float(hf.get("logit_scale", 1.0)) > 0, "logit_scale must be positive"),
        (
            spec.method == "eagle3"
            or not (
                set(hf)
                & {"draft_vocab_size", "target_hidden_size", "norm_before_residual", "eagle_config"}
            ),
            "draft_vocab_size, target_hidden_size, norm_before_residual and eagle_config are "
            "EAGLE-3 fields (use method eagle3)",
        ),
        (spec.method == "eagle" or not hf.get("add_para_norm"), "add_para_norm is EAGLE's"),
    ]
    for ok, what in checks:
        if not ok:
            raise _refuse(spec, what + ".")
    target_hidden = int(hf.get("target_hidden_size", hf["hidden_size"]))
    if target_hidden != target.hidden_size:
        raise _refuse(
            spec,
            f"it was trained for a target of width {target_hidden}, "
            f"the target's is {target.hidden_size}.",
        )
    if spec.method == "eagle3" and target.architecture not in EAGLE3_TARGETS:
        raise _refuse(
            spec,
            f"EAGLE-3 reads the residual stream of {', '.join(EAGLE3_TARGETS)} "
            f"targets, not {target.architecture}.",
        )


def _aux_layers(spec: SpeculativeConfig, hf: dict[str, Any], target: ModelConfig) -> list[int]:
    """EAGLE-3: the target layers before which the residual stream is read (vLLM's default
    (2, L // 2, L - 3), or eagle_config's ids); EAGLE: none (the last hidden state)."""
    if spec.method != "eagle3":
        return []
    eagle = hf.get("eagle_config") or {}
    unknown = sorted(set(eagle) - _EAGLE3_KEYS)
    if unknown:
        raise _refuse(spec, f"eagle_config key(s) {', '.join(unknown)} are not supported.")
    if not eagle.get("use_aux_hidden_state", True):
        raise _refuse(spec, "eagle_config.use_aux_hidden_state false is not supported.")
    n = target.num_hidden_layers
    layers = eagle.get("eagle_aux_hidden_state_layer_ids") or [2, n // 2, n - 3]
    if len(layers) != 3 or not all(isinstance(i, int) and 0 <= i < n for i in layers):
        raise _refuse(
            spec,
            f"the auxiliary layers {layers} are not three of the target's "
            f"{n} layers (0 .. {n - 1}).",
        )
    return [int(i) for i in layers]
