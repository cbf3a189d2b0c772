"""A forward's failure on one rank under expert parallelism over several engine cores
(``-dp N --enable-expert-parallel``), and the ranks' agreement at the forward's end on whose
step failed.

Every MoE layer of a forward is a sequence of all-to-alls over every core's ranks
(``expert_parallel.dispatch_combine``): a rank whose code fails inside one must still complete
that layer's exchanges, with the sizes the ranks agreed on, or the others would wait in them
until the collective timeout ends the engine. So the failing rank remembers the failure
(``ForwardFaults.note_error``), completes the layer (zero rows for its own tokens; its experts
still run on the rows the others sent, unless it was their computation that failed: then the
others get zeros back) and goes on with the forward on zeros, so the tensor-parallel
collectives of its core meet too. At the forward's end every rank, of a real step or of a
dummy forward, takes part in one small all-reduce over the experts' group (``agree_step``:
one int32 per rank) and each decides alone, from the same numbers, whether its step failed:

- a rank whose forward failed, and every rank of its engine core (the tensor-parallel peers:
  their outputs need its share);
- every rank of a core whose tokens went, in this forward, to a rank whose experts failed, in
  the layer they failed or a later one (their outputs are missing). Every rank of a core
  routes its tokens alike (the router is replicated), so they decide alike.

Other cores' steps are unaffected: the failing rank's experts computed their pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trillm.distributed.parallel_state import expert_rank_label, get_ep_group, get_tp_group

OK, FAILED = 0, 1  # a rank's code in the agreement; 2 + L: its experts failed in MoE layer L


@dataclass
class ForwardFaults:
    """This rank's current forward under -dp N -ep: its MoE layers so far, the first failure
    inside one, the first layer whose experts failed here, and the last layer that sent this
    core's pairs to each expert rank."""

    layer: int = 0
    error: str | None = None
    experts_lost: int | None = None
    last_routed: dict[int, int] = field(default_factory=dict)  # expert rank -> layer

    def note_routed(self, pairs_per_rank: list[int]) -> None:
        """The current layer sends this core's tokens' pairs to these ranks' experts."""
        for rank, pairs in enumerate(pairs_per_rank):
            if pairs:
                self.last_routed[rank] = self.layer

    def note_error(self, text: str, experts_lost: bool) -> None:
        if self.error is None:
            self.error = text
        if experts_lost and self.experts_lost is None:
            self.experts_lost = self.layer


faults = ForwardFaults()  # this process's: one rank per worker process


def start_forward() -> None:
    """A forward (a step or a dummy one) begins: what the last one noted is forgotten."""
    global faults
    faults = ForwardFaults()


def agree_step(failed: bool, device: torch.device | str) -> str | None:
    """The end of a forward on every rank of every core (``failed``: this rank's forward
    raised outside a MoE layer); -> why this rank's step failed, None if it did not."""
    seen = faults
    start_forward()
    ep, tp = get_ep_group(), get_tp_group()
    mine = FAILED if failed or seen.error is not None else OK
    if seen.experts_lost is not None:
        mine = 2 + seen.experts_lost
    codes = torch.zeros(ep.world_size, dtype=torch.int32, device=device)
    codes[ep.rank] = mine
    got = ep.all_reduce(codes).tolist()
    if seen.error is not None:
        return f"the forward failed in a MoE layer on this rank: {seen.error}"
    if failed:
        return "the forward failed on this rank"
    core = ep.rank // tp.world_size
    for rank, code in enumerate(got):
        label = expert_rank_label(rank // tp.world_size, rank % tp.world_size, tp.world_size)
        if code != OK and rank // tp.world_size == core:
            return f"the forward failed on {label}, a tensor-parallel rank of this engine core"
        if code >= 2 and seen.last_routed.get(rank, -1) >= code - 2:
            return (
                f"the experts of {label} failed in MoE layer {code - 1} of this forward, "
                "and tokens of this engine core were routed to them"
            )
    return None
