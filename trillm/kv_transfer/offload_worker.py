"""The KV offload tier's worker side (``base.KVConnectorWorker``): the tier's blocks in host
memory, one tensor per KV layer shaped like that layer's cache, ``[planes, tier blocks,
block_size, *entry]``; a step's loads copy tier blocks into the KV cache before the forward,
its saves copy KV-cache blocks out after it (``offload.py`` says which).

The tensors are made at the first step that stores, with ``torch.empty``: the host commits
the pages as blocks are written, so the tier's memory grows to ``--kv-offloading-size`` at
most, as it fills.
"""

from __future__ import annotations

import logging

import torch

from trillm.kv_transfer.base import BlockWorker
from trillm.kv_transfer.offload_config import KVOffloadConfig
from trillm.messages import KVTransferItem

logger = logging.getLogger(__name__)


class OffloadWorker(BlockWorker):
    load_errors = (RuntimeError, IndexError)
    what = "KV offload load"
    reason = "KV offload load"

    def __init__(self, offload: KVOffloadConfig, rank: int = 0) -> None:
        self.offload = offload
        self.tier: list[torch.Tensor] = []  # per KV layer: [planes, tier blocks, bs, *entry]
        # this rank's share of a tier block (tensor x pipeline: its heads of its stage's layers)
        shares = offload.rank_block_bytes
        self.block_bytes = shares[rank] if shares else offload.block_bytes

    def _tier_for(self, kv_caches: list[torch.Tensor]) -> list[torch.Tensor]:
        if not self.tier:
            block_bytes = sum(c[:, 0].numel() * c.element_size() for c in kv_caches)
            if block_bytes != self.block_bytes:  # NOTE: the scheduler sized the tier
                raise RuntimeError(
                    f"KV offload tier sized for {self.block_bytes}-byte blocks, the "
                    f"KV cache's are {block_bytes} bytes."
                )
            n = self.offload.num_blocks
            self.tier = [
                torch.empty((c.shape[0], n, *c.shape[2:]), dtype=c.dtype, device="cpu")
                for c in kv_caches
            ]
            logger.info("KV offload tier: %d blocks of %d bytes", n, block_bytes)
        return self.tier

    def _load(self, item: KVTransferItem, kv_caches: list[torch.Tensor]) -> None:
        ids = torch.tensor(item.block_ids[item.first_block :], device=kv_caches[0].device)
        source = torch.tensor(item.offload_blocks)
        for layer, tier in zip(kv_caches, self._tier_for(kv_caches), strict=True):
            layer[:, ids] = tier[:, source].to(layer.device)

    def _save(self, item: KVTransferItem, kv_caches: list[torch.Tensor]) -> None:
        ids = torch.tensor(item.block_ids, device=kv_caches[0].device)
        target = torch.tensor(item.offload_blocks)
        for layer, tier in zip(kv_caches, self._tier_for(kv_caches), strict=True):
            tier[:, target] = layer[:, ids].cpu()
