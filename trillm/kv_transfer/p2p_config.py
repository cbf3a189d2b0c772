"""``--kv-transfer-config`` for vLLM's ``P2pNcclConnector``: the keys it reads, honoured or
refused by name. Here its transport is TCP (no NCCL): the decode instance pulls a prompt's KV
from the prefill instance (vLLM's ``send_type`` "GET"), or the prefill instance pushes it to
the decode instance ("PUT": in the step, "PUT_ASYNC": from a background thread)."""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass
from typing import Any

P2P_NCCL = "P2pNcclConnector"
SEND_TYPES = ("PUT", "GET", "PUT_ASYNC")
PREFILL_KV_ADDRS = "prefill_kv_addrs"  # trillm's key: a consumer's allowed prefill addresses
DECODE_KV_ADDRS = "decode_kv_addrs"  # trillm's key: a pushing producer's allowed decode addresses
MEM_POOL_SIZE_GB = 32.0  # vLLM's default: the receiver's host pool
_NAME = "kv_transfer_config"
_EXTRA = f"{_NAME}.kv_connector_extra_config"
# vLLM's extra keys this transport cannot honour -> why
_REFUSED_EXTRA = {
    "nccl_num_channels": "an NCCL setting; this connector's transport is TCP",
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
    # a kv_consumer's: each prefill instance it may fetch KV from, "ip:port" (kv_address's
    # normal form; strings: the config crosses to the workers as msgpack)
    prefill_kv_addrs: tuple[str, ...] = ()
    send_type: str = "GET"  # one of SEND_TYPES
    # a pushing kv_producer's: each decode instance it may push KV to, "ip:port"
    decode_kv_addrs: tuple[str, ...] = ()
    mem_pool_size_gb: float = MEM_POOL_SIZE_GB

    @property
    def pushes(self) -> bool:
        return self.send_type != "GET"

    @property
    def receive_bytes(self) -> int:
        """A kv_consumer's bound on the KV received and not loaded yet: vLLM's buffer
        (``kv_buffer_size``) and its pool (``mem_pool_size_gb``), both host memory here."""
        return self.kv_buffer_size + int(self.mem_pool_size_gb * 2**30)


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
    taken = {"send_type", PREFILL_KV_ADDRS, DECODE_KV_ADDRS, "mem_pool_size_gb"}
    unknown = set(extra) - taken - set(_REFUSED_EXTRA)
    if unknown:
        raise ValueError(f"{_EXTRA}: {P2P_NCCL} does not take {', '.join(sorted(unknown))}.")
    send_type = extra.get("send_type", "PUT_ASYNC")
    if send_type not in SEND_TYPES:
        raise ValueError(f"{_EXTRA}.send_type must be one of {SEND_TYPES}, got {send_type!r}.")
    device = value.get("kv_buffer_device", "cpu")
    if device != "cpu":
        raise ValueError(
            f"{_NAME}.kv_buffer_device {device!r}: {P2P_NCCL} here buffers KV in host memory; "
            "set 'cpu'."
        )
    for key in ("kv_connector_module_path", "enable_permute_local_kv"):
        if value.get(key) not in (None, False):
            raise ValueError(f"{_NAME}.{key}: not read by {P2P_NCCL}; leave it out.")
    addrs = _prefill_kv_addrs(extra.get(PREFILL_KV_ADDRS), role)
    decode = _decode_kv_addrs(extra.get(DECODE_KV_ADDRS), role, send_type)
    pool = _pool_size(extra.get("mem_pool_size_gb"), role)
    return P2pConfig(_ip(value), _port(value), _buffer_size(value), addrs, send_type, decode, pool)


def _decode_kv_addrs(value: Any, role: str, send_type: str) -> tuple[str, ...]:
    """trillm's own key: the request id names the decode instance a producer pushes to, and a
    client can set it, so a pushing producer sends only to the addresses its operator lists."""
    name = f"{_EXTRA}.{DECODE_KV_ADDRS}"
    if role == "kv_consumer" or send_type == "GET":
        if value is not None:
            raise ValueError(
                f"{name}: only a kv_producer with send_type 'PUT' or 'PUT_ASYNC' pushes KV; "
                "leave it out here."
            )
        return ()
    if value is None:
        raise ValueError(
            f"{name} is required on a kv_producer with send_type {send_type!r}: list the decode "
            'instances\' kv_ip:kv_port it may push KV to (["10.0.1.3:22001"]). The request id '
            "names the address and a client can set it, so without a list any client could "
            "make this instance send prompts' KV to any host."
        )
    return _addr_list(name, value)


def _pool_size(value: Any, role: str) -> float:
    name = f"{_EXTRA}.mem_pool_size_gb"
    if value is None:
        return MEM_POOL_SIZE_GB
    if role == "kv_producer":
        raise ValueError(f"{name}: the pool of received KV is a kv_consumer's; set it there.")
    try:
        number = float(value) if isinstance(value, (str, int, float)) else math.nan
    except ValueError:
        number = math.nan
    if isinstance(value, bool) or not math.isfinite(number) or number < 0:
        raise ValueError(f"{name} must be a number of GiB >= 0, got {value!r}.")
    return number


def _prefill_kv_addrs(value: Any, role: str) -> tuple[str, ...]:
    """trillm's own key (vLLM's connector has none): the request id, which a client can set,
    names the address the decode instance fetches from, so a consumer fetches only from the
    addresses its operator lists, never from one a client names."""
    name = f"{_EXTRA}.{PREFILL_KV_ADDRS}"
    if role == "kv_producer":
        if value is not None:
            raise ValueError(f"{name}: a kv_producer fetches no KV; set it on the kv_consumer.")
        return ()
    if value is None:
        raise ValueError(
            f"{name} is required on a kv_consumer with {P2P_NCCL}: list the prefill "
            'instances\' kv_ip:kv_port it may fetch KV from (["10.0.1.2:21001"]). The request '
            "id names the address and a client can set it, so without a list any client could "
            "make this instance connect to any host."
        )
    return _addr_list(name, value)


def _addr_list(name: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{name} must be a non-empty list of 'ip:port', got {value!r}.")
    addrs = [kv_address(item) for item in value]
    if None in addrs:
        raise ValueError(f"{name}: each entry must be 'ip:port' (an IP address), got {value!r}.")
    return tuple(sorted({f"{a[0]}:{a[1]}" for a in addrs if a is not None}))


def kv_address(text: Any) -> tuple[str, int] | None:
    """``ip:port`` (``[v6]:port`` too) -> (the IP in its normal form, port); None when it is
    not one (a host name is not: resolving a client's name is a door of its own)."""
    if not isinstance(text, str) or ":" not in text:
        return None
    host, port = text.rsplit(":", 1)
    try:
        ip = ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        return None
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return None
    return str(ip), int(port)


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
