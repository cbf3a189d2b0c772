"""A request's prompt KV blocks out of and into the paged KV cache, as ``storage.py``'s bytes:
what the shared-storage connector writes to a file and the network connector sends."""

from __future__ import annotations

import torch

from trillm.kv_transfer.storage import Header, payload_digest
from trillm.messages import KVTransferItem


def gather(
    item: KVTransferItem, kv_caches: list[torch.Tensor], identity: str
) -> tuple[Header, bytes]:
    """``item``'s blocks of every layer -> a header and its payload."""
    ids = torch.tensor(item.block_ids, device=kv_caches[0].device)
    rows = torch.stack([layer[:, ids] for layer in kv_caches])  # [L, planes, nb, bs, *entry]
    payload = rows.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return header_of(item, kv_caches, identity, payload), payload


def header_of(
    item: KVTransferItem, kv_caches: list[torch.Tensor], identity: str, payload: bytes
) -> Header:
    cache = kv_caches[0]
    return Header(
        identity=identity,
        num_tokens=item.num_tokens,
        num_layers=len(kv_caches),
        planes=cache.shape[0],
        entry=list(cache.shape[3:]),
        dtype=str(cache.dtype),
        payload_bytes=len(payload),
        digest=payload_digest(payload),
    )


def payload_bytes(item: KVTransferItem, kv_caches: list[torch.Tensor]) -> int:
    """The payload's size for ``item``'s blocks in this cache (a receiver's bound)."""
    cache = kv_caches[0]
    per_block = cache[:, 0].numel() * cache.element_size()
    return len(kv_caches) * per_block * len(item.block_ids)


def scatter(
    item: KVTransferItem, kv_caches: list[torch.Tensor], header: Header, payload: memoryview
) -> None:
    """``payload`` (checked against its header's digest by the caller) into ``item``'s blocks
    from ``first_block`` on: the blocks before are the request's prefix-cache hits.
    ValueError when it was written for another cache layout."""
    cache = kv_caches[0]
    shape = (len(kv_caches), cache.shape[0], len(item.block_ids), *cache.shape[2:])
    layout = (len(kv_caches), cache.shape[0], list(cache.shape[3:]), str(cache.dtype))
    if (header.num_layers, header.planes, header.entry, header.dtype) != layout:
        raise ValueError("the KV blocks hold another cache layout than this model's")
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    rows = data.view(cache.dtype).reshape(shape).to(cache.device)
    ids = torch.tensor(item.block_ids[item.first_block :], device=cache.device)
    for layer, layer_rows in zip(kv_caches, rows):
        layer[:, ids] = layer_rows[:, item.first_block :]
