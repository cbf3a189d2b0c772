"""``{"method": "mtp" | "deepseek_mtp"}``, the engine side: the multi-token-prediction layer a
DeepSeek-V3 checkpoint ships after its decoder layers (``num_nextn_predict_layers``), checked
before anything loads and described as a one-layer ``ModelConfig`` for the worker's drafter
(``mtp_head.py``, ``mtp_proposer.py``).

As vLLM: ``model`` may be left out (the target's own folder); ``num_speculative_tokens`` may
exceed the number of MTP layers (the layer drafts again from its own output).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from trillm.config import EngineArgs, ModelConfig
from trillm.spec_decode.config import DraftModelError, SpeculativeConfig

# Targets whose MTP layers trillm runs (their decoder layer is the target's own kind).
TARGETS = ("DeepseekV3ForCausalLM",)
# Per MTP layer, besides the decoder layer's own weights (``model.layers.{L}.``-prefixed).
OWN_PARTS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def _refuse(what: str) -> DraftModelError:
    return DraftModelError(f"speculative_config: mtp: {what}")


def mtp_first_layer(target: ModelConfig) -> int:
    """The checkpoint's index of the (first) MTP layer: after the decoder's layers."""
    return target.num_hidden_layers


def build_mtp_config(args: EngineArgs, spec: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
    """The drafter's ModelConfig: the target's, one layer (its MTP layer); DraftModelError
    naming what cannot be served."""
    if args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1:
        raise _refuse("MTP layers run with tensor_parallel_size and pipeline_parallel_size 1 only.")
    if target.architecture not in TARGETS:
        raise _refuse(
            f"{target.architecture} has no MTP layers trillm can run (it runs those of "
            f"{', '.join(TARGETS)})."
        )
    if spec.model is not None and Path(spec.model).resolve() != Path(target.model).resolve():
        raise _refuse(
            f'"model" {spec.model!r} is not the target\'s folder: the MTP layers are read from '
            'the target\'s own checkpoint (leave "model" out).'
        )
    count = int(target.hf_config.get("num_nextn_predict_layers") or 0)
    if count == 0:
        raise _refuse("the model has no MTP layers (num_nextn_predict_layers 0).")
    if count != 1:
        raise _refuse(
            f"the model has num_nextn_predict_layers {count}; trillm runs checkpoints with "
            "exactly one MTP layer (DeepSeek-V3 / R1's)."
        )
    _check_weights(target)
    hf = {**target.hf_config, "mtp_layer": mtp_first_layer(target)}
    return dataclasses.replace(target, num_hidden_layers=1, hf_config=hf)


def _check_weights(target: ModelConfig) -> None:
    """The checkpoint holds the MTP layer's own weights (transformers writes none)."""
    from safetensors import safe_open

    from trillm.model_executor.loader import safetensors_files

    prefix = f"model.layers.{mtp_first_layer(target)}."
    names: set[str] = set()
    for file in safetensors_files(target.model):
        with safe_open(str(file), framework="pt") as f:
            names.update(n for n in f.keys() if n.startswith(prefix))  # noqa: SIM118
    missing = [prefix + part for part in OWN_PARTS if prefix + part not in names]
    if missing:
        raise _refuse(
            f"the checkpoint has no weights for its MTP layer (e.g. {missing[0]}): it ships "
            "none (a model saved by transformers drops them)."
        )
