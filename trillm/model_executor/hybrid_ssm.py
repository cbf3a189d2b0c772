"""What a hybrid state-space model (Mamba layers beside attention: Bamba, GraniteMoeHybrid,
Nemotron-H) can run with, checked when the engine is configured, torch-free; and its
config.json read by its family's reader (``prepare``).

Its Mamba layers keep one state per request in the request's batch slot
(``trillm/attention/ssm_state.py``), built token by token from position 0. So prefix caching
is off for these models (a cached prefix's KV blocks come without the state after them), and
what would run the layers without that state is refused by name. Tensor parallelism splits
them by heads (``trillm/distributed/hybrid_sharding.py``); each pipeline stage keeps its own
layers' states.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from trillm.config import EngineArgs, ModelConfig
from trillm.model_executor import bamba_config, granitemoehybrid_config, nemotron_h_config
from trillm.model_executor.registry import model_entry

logger = logging.getLogger(__name__)

# Each family's config.json reader: its defaults filled in, its fields checked.
_PREPARE: dict[str, Callable[[dict[str, Any], str], dict[str, Any]]] = {
    bamba_config.ARCHITECTURE: bamba_config.prepare,
    granitemoehybrid_config.ARCHITECTURE: granitemoehybrid_config.prepare,
    nemotron_h_config.ARCHITECTURE: nemotron_h_config.prepare,
}


def prepare(hf: dict[str, Any], architecture: str) -> dict[str, Any]:
    """config.json of a hybrid model as its family reads it (other models: unchanged)."""
    family = _PREPARE.get(architecture)
    return hf if family is None else family(hf, architecture)


def is_hybrid(model_config: ModelConfig) -> bool:
    return model_entry(model_config.architecture).ssm_state


def check_engine_args(
    args: EngineArgs, model_config: ModelConfig, draft: ModelConfig | None
) -> bool:
    """Refuses what a hybrid target or draft model cannot run with; -> whether the target is
    one (its prefix caching is then off)."""
    if draft is not None and is_hybrid(draft):
        raise ValueError(
            f"speculative_config: the draft model {draft.architecture} keeps a per-request "
            "Mamba state, which draft models do not support."
        )
    if not is_hybrid(model_config):
        return False
    arch = model_config.architecture
    for name, value, unsupported in (
        ("speculative_config", args.speculative_config, args.speculative_config is not None),
        ("enable_lora", args.enable_lora, args.enable_lora),
        ("numerics", args.numerics, args.numerics == "transformers"),
        ("quantization", model_config.quantization, model_config.quantization is not None),
    ):
        if unsupported:
            raise ValueError(
                f"{arch} (hybrid Mamba / attention): {name}={value!r} is not supported."
            )
    if args.enable_prefix_caching:
        # NOTE: the KV blocks of a cached prefix come without the Mamba state after it.
        logger.info("%s: prefix caching is off (its Mamba layers keep a per-request state).", arch)
    return True
