"""``--kv-transfer-config JSON`` (vLLM's ``KVTransferConfig``): every key vLLM defines, honoured
or refused by name. Two connectors are implemented, vLLM's ``SharedStorageConnector`` and its
``P2pNcclConnector`` (over TCP, ``p2p_config.py``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from trillm.kv_transfer.p2p_config import P2P_NCCL, P2pConfig, parse_p2p

SHARED_STORAGE = "SharedStorageConnector"
ROLES = ("kv_both", "kv_producer", "kv_consumer")
# vLLM's other connectors: refused by name, each moves KV in a way not implemented here.
OTHER_CONNECTORS = (
    "LMCacheConnectorV1",
    "NixlConnector",
    "MultiConnector",
    "OffloadingConnector",
    "LMCacheMPConnector",
    "MooncakeConnector",
    "DecodeBenchConnector",
)
# vLLM's keys that only its network connectors read, at their defaults (which ask nothing).
_NETWORK_DEFAULTS: dict[str, Any] = {
    "kv_buffer_device": "cuda",
    "kv_buffer_size": 1e9,
    "kv_rank": None,
    "kv_parallel_size": 1,
    "kv_ip": "127.0.0.1",
    "kv_port": 14579,
    "kv_connector_module_path": None,
    "enable_permute_local_kv": False,
}


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str  # SHARED_STORAGE
    kv_role: str  # one of ROLES: producers save prompts' KV, consumers load it
    shared_storage_path: str  # the folder both instances read and write
    engine_id: str | None = None  # vLLM's label of the instance (logged only)
    # LMCache's cap on its disk tier, GiB: the producer's bound on the folder's bytes (None:
    # disk_budget.DEFAULT_DISK_SHARE of the free disk at start)
    max_local_disk_size: float | None = None
    p2p: P2pConfig | None = None  # P2pNcclConnector's transport (shared_storage_path unused)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_both", "kv_producer")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_both", "kv_consumer")


def parse_kv_transfer_config(value: Any) -> KVTransferConfig | None:
    """A dict (or None) -> the config; ValueError naming the key or value it cannot take."""
    if value is None or isinstance(value, KVTransferConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"kv_transfer_config must be a JSON object, got {value!r}.")
    connector = value.get("kv_connector")
    _check_keys(value, connector == P2P_NCCL)
    if connector in OTHER_CONNECTORS:
        raise ValueError(
            f"kv_transfer_config.kv_connector {connector!r} is not implemented; trillm has "
            f"{SHARED_STORAGE!r} and {P2P_NCCL!r}."
        )
    if connector not in (SHARED_STORAGE, P2P_NCCL):
        raise ValueError(
            f"kv_transfer_config.kv_connector must be {SHARED_STORAGE!r} or {P2P_NCCL!r}, "
            f"got {connector!r}."
        )
    role = value.get("kv_role")
    if role not in ROLES:
        raise ValueError(f"kv_transfer_config.kv_role must be one of {ROLES}, got {role!r}.")
    engine_id = value.get("engine_id")
    if engine_id is not None and not isinstance(engine_id, str):
        raise ValueError(f"kv_transfer_config.engine_id must be a string, got {engine_id!r}.")
    if connector == P2P_NCCL:
        extra = value.get("kv_connector_extra_config") or {}
        if not isinstance(extra, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be a JSON object.")
        return KVTransferConfig(connector, role, "", engine_id, p2p=parse_p2p(value, role, extra))
    extra = _extra_config(value)
    return KVTransferConfig(
        connector, role, _storage_path(extra), engine_id, _disk_cap(extra, role)
    )


def _check_keys(value: dict[str, Any], network: bool) -> None:
    """``network``: the P2P connector reads vLLM's network keys itself (``parse_p2p``)."""
    for key, item in value.items():
        if key in ("kv_connector", "kv_role", "kv_connector_extra_config", "engine_id"):
            continue
        if key == "kv_load_failure_policy":
            if item not in (None, "recompute"):
                raise ValueError(
                    "kv_transfer_config.kv_load_failure_policy: only 'recompute' is "
                    f"implemented (a file that is missing or damaged is recomputed), got {item!r}."
                )
            continue
        if key not in _NETWORK_DEFAULTS:
            raise ValueError(f"kv_transfer_config: unknown key {key!r}.")
        if not network and item != _NETWORK_DEFAULTS[key]:
            raise ValueError(
                f"kv_transfer_config.{key}: read by vLLM's network connectors only, not by "
                f"{SHARED_STORAGE}; leave it out."
            )


_EXTRA_KEYS = ("shared_storage_path", "max_local_disk_size")


def _extra_config(value: dict[str, Any]) -> dict[str, Any]:
    extra = value.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError("kv_transfer_config.kv_connector_extra_config must be a JSON object.")
    unknown = set(extra) - set(_EXTRA_KEYS)
    if unknown:
        raise ValueError(
            f"kv_transfer_config.kv_connector_extra_config: {SHARED_STORAGE} takes "
            f"{' and '.join(_EXTRA_KEYS)} only, not {', '.join(sorted(unknown))}."
        )
    return extra


def _storage_path(extra: dict[str, Any]) -> str:
    path = extra.get("shared_storage_path", "/tmp")  # vLLM's default
    if not isinstance(path, str) or not path:
        raise ValueError(
            "kv_transfer_config.kv_connector_extra_config.shared_storage_path must be a "
            f"folder path, got {path!r}."
        )
    return path


def _disk_cap(extra: dict[str, Any], role: str) -> float | None:
    """``max_local_disk_size`` (GiB, > 0): only a producer writes files, so only a producer
    takes it."""
    cap = extra.get("max_local_disk_size")
    if cap is None:
        return None
    name = "kv_transfer_config.kv_connector_extra_config.max_local_disk_size"
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap):
        raise ValueError(f"{name} must be a number of GiB, got {cap!r}.")
    if cap <= 0:
        raise ValueError(f"{name} must be > 0 GiB, got {cap!r}.")
    if role == "kv_consumer":
        raise ValueError(f"{name}: a kv_consumer writes no file; set it on the producer.")
    return float(cap)
