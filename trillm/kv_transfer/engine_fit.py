"""``kv_transfer_config`` resolved for an engine: the features a stored prompt KV does not
carry yet are refused by name at load."""

from __future__ import annotations

import logging
from typing import Any

from trillm.config import EngineArgs, ModelConfig
from trillm.kv_transfer.config import KVTransferConfig, parse_kv_transfer_config

logger = logging.getLogger(__name__)


def resolve_kv_transfer(
    args: EngineArgs,
    model: ModelConfig,
    pooler: Any,
    speculative: Any,
    hybrid: bool,
    longrope: bool,
) -> KVTransferConfig | None:
    config = parse_kv_transfer_config(args.kv_transfer_config)
    if config is None:
        return None
    unsupported = unsupported_with_connector(args, model, pooler, speculative, hybrid, longrope)
    if config.p2p is not None:
        unsupported = {**_p2p_ranks(args, config), **unsupported}
    for name, used in unsupported.items():
        if used:
            raise ValueError(
                f"kv_transfer_config ({config.kv_connector}) with {name}: not implemented."
            )
    logger.info("KV connector %s (%s), %s", config.kv_connector, config.kv_role, _where(config))
    return config


def _where(config: KVTransferConfig) -> str:
    """Where the connector's KV goes or comes from, for the startup log."""
    p2p = config.p2p
    if p2p is None:
        return f"folder {config.shared_storage_path}"
    if config.is_producer:
        return f"serving on {p2p.kv_ip}:{p2p.kv_port}"
    return "fetching from " + ", ".join(p2p.prefill_kv_addrs)


def _p2p_ranks(args: EngineArgs, kv: KVTransferConfig) -> dict[str, bool]:
    """The P2P connector's ranks: rank r of each instance on ``kv_port + r`` of one address
    (vLLM's pairing), so every rank on the node of ``kv_ip``; ValueError when the last rank's
    port is past 65535."""
    assert kv.p2p is not None
    world = args.tensor_parallel_size * args.pipeline_parallel_size
    if kv.p2p.kv_port + world - 1 > 65535:
        raise ValueError(
            f"kv_transfer_config.kv_port {kv.p2p.kv_port}: with {world} ranks the "
            f"{kv.kv_connector} listens on kv_port to kv_port + {world - 1}, past 65535."
        )
    return {"nnodes > 1 (every rank serves its share on kv_ip)": args.nnodes > 1}


def unsupported_with_connector(
    args: EngineArgs,
    model: ModelConfig,
    pooler: Any,
    speculative: Any,
    hybrid: bool,
    longrope: bool,
) -> dict[str, bool]:
    """What a connector's stored blocks do not carry yet -> whether this engine uses it
    (the KV offload tier refuses the same, ``offload_config.py``). Tensor and pipeline
    parallelism are not among them: each rank saves and loads its own share of the KV (its
    heads, its stage's layers), keyed by its rank (the P2P connector: sent on ``kv_port +
    rank``); one engine core schedules for them all."""
    return {
        # several engine cores, each with its own scheduler side and ranks: not keyed apart
        "data_parallel_size > 1": args.data_parallel_size > 1,
        # state outside the paged KV cache, or KV that is not a function of the tokens alone
        "a hybrid (Mamba) model's recurrent state": hybrid,
        "a longrope model (its K/V depend on the request's length)": longrope,
        "a multimodal model": model.mm_config is not None,
        "a pooling model": pooler is not None,
        "speculative decoding (the draft's KV cache)": speculative is not None,
    }
