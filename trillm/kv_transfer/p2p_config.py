"""``--kv-transfer-config`` for vLLM's ``P2pNcclConnector``: the keys it reads, honoured or
refused by name. Here its transport is TCP between the instances' workers (no NCCL): the
decode instance pulls a prompt's KV from the prefill instance (vLLM's ``send_type`` "GET")."""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass
from typing import Any

P2P_NCCL = "P2pNcclConnector"
SEND_TYPES = ("PUT", "GET", "PUT_ASYNC")
_NAME = "kv_transfer_config"
_EXTRA = f"{_NAME}.kv_connector_extra_config"
# vLLM's extra keys this transport cannot honour -> why
_REFUSED_EXTRA = {
    "nccl_num_channels": "an NCCL setting; this connector's transport is TCP",
    "mem_pool_size_gb": "the receiver's pool of pushed KV (send_type PUT / PUT_ASYNC), "
    "which this connector does not implement",
    "proxy_ip": "instances registering with a proxy is not implemented; give the proxy "
    "the prefill instance's kv_ip:kv_port (disagg_proxy --prefill-kv-addr)",
    "proxy_port": "instances registering with a proxy is not implemented",
    "http_port": "instances registering with a proxy is not implemented",
}


@dataclass(frozen=True)
class P2pConfig:
    kv_ip: str  # the address the prefill instance's KV server listens on (that address only)
    kv_port: int
    kv_buffer_size: int  # bytes: the prefill instance's store of KV not yet taken


def parse_p2p(value: dict[str, Any], role: str, extra: dict[str, Any]) -> P2pConfig:
    """ValueError naming the key or value this connector cannot take."""
    if role == "kv_both":
        raise ValueError(
            f"{_NAME}.kv_role 'kv_both' with {P2P_NCCL}: an instance is a prefill "
            "(kv_producer) or a decode (kv_consumer) instance."
        )
    for key, why in _REFUSED_EXTRA.items():
        if key in extra:
            raise ValueError(f"{_EXTRA}.{key}: {why}.")
    unknown = set(extra) - {"send_type", *_REFUSED_EXTRA}
    if unknown:
        raise ValueError(f"{_EXTRA}: {P2P_NCCL} does not take {', '.join(sorted(unknown))}.")
    send_type = extra.get("send_type", "PUT_ASYNC")
    if send_type not in SEND_TYPES:
        raise ValueError(f"{_EXTRA}.send_type must be one of {SEND_TYPES}, got {send_type!r}.")
    if send_type != "GET":
        raise ValueError(
            f"{_EXTRA}.send_type {send_type!r} (the prefill instance pushing KV to the decode "
            "instance) is not implemented; set 'GET': the decode instance pulls it."
        )
    device = value.get("kv_buffer_device", "cpu")
    if device != "cpu":
        raise ValueError(
            f"{_NAME}.kv_buffer_device {device!r}: {P2P_NCCL} here buffers KV in host memory; "
            "set 'cpu'."
        )
    for key in ("kv_connector_module_path", "enable_permute_local_kv"):
        if value.get(key) not in (None, False):
            raise ValueError(f"{_NAME}.{key}: not read by {P2P_NCCL}; leave it out.")
    return P2pConfig(_ip(value), _port(value), _buffer_size(value))


def _ip(value: dict[str, Any]) -> str:
    ip = value.get("kv_ip", "127.0.0.1")
    try:
        ipaddress.ip_address(ip)
    except ValueError:
        raise ValueError(f"{_NAME}.kv_ip must be an IP address, got {ip!r}.") from None
    return str(ip)


def _port(value: dict[str, Any]) -> int:
    port = _number(value, "kv_port", 14579)
    if port != int(port) or not 1 <= port <= 65535:
        raise ValueError(f"{_NAME}.kv_port must be a port number 1-65535, got {port!r}.")
    return int(port)


def _buffer_size(value: dict[str, Any]) -> int:
    size = _number(value, "kv_buffer_size", 1e9)
    if size < 1:
        raise ValueError(f"{_NAME}.kv_buffer_size must be >= 1 byte, got {size!r}.")
    return int(size)


def _number(value: dict[str, Any], key: str, default: float) -> float:
    """vLLM's examples give kv_port and kv_buffer_size as strings ("21001", "8e9")."""
    item = value.get(key, default)
    number: Any = item
    if isinstance(item, str):
        try:
            number = float(item)
        except ValueError:
            number = None
    if (
        isinstance(number, bool)
        or not isinstance(number, (int, float))
        or not math.isfinite(number)
    ):
        raise ValueError(f"{_NAME}.{key} must be a number, got {item!r}.")
    return float(number)
