"""A step's KV loads under tensor or pipeline parallelism: every rank loads its own share of
each request's KV (its heads, its stage's layers), and a load that failed on one rank counts
as failed on every rank before any of them runs the step's forward.

Without it a rank whose share was missing would leave the request out of its forward while
the others ran it on their loaded share: the ranks' batches would differ (their collectives
would not match) and the request's tokens would come from a mix of loaded and computed KV.
With it every rank leaves the request out, and the scheduler computes its tokens instead
(``kv_load_failure_policy`` "recompute"). One all-reduce over every rank, in the steps that
load something (each rank reads the same step, so each knows whether to take part).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trillm.errors import CollectiveTimeoutError
from trillm.messages import KVConnectorStep

ELSEWHERE = "KV connector load: failed on another rank"


def agree_on_failed_loads(
    step: KVConnectorStep | None, failed: dict[str, str], rank: int, device: torch.device
) -> dict[str, str]:
    """``failed`` (this rank's failed loads: req_id -> why) -> those of every rank."""
    if step is None or not step.loads or not dist.is_initialized() or dist.get_world_size() == 1:
        return failed
    flags = torch.tensor(
        [item.req_id in failed for item in step.loads], dtype=torch.int32, device=device
    )
    try:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # NOTE: the world's: every stage's ranks
    except RuntimeError as exc:  # gloo / NCCL report a timeout or a lost peer this way
        raise CollectiveTimeoutError(
            f"Rank {rank}: the KV loads' agreement failed (a peer rank stopped answering or "
            f"died): {exc}",
            rank=rank,
            op="all_reduce",
        ) from exc
    return {
        item.req_id: failed.get(item.req_id, ELSEWHERE)
        for item, bad in zip(step.loads, flags.tolist(), strict=True)
        if bad
    }
