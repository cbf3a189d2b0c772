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
three int32 per rank) and each decides alone, from the same numbers, whether its step failed:

- a rank whose forward failed, and every rank of its engine core (the tensor-parallel peers:
  their outputs need its share);
- in a core whose tokens went, in this forward, to a rank whose experts failed (in the layers
  from the first to the last they failed in: their outputs are missing), those tokens' requests
  (``StepVerdict.tokens``: attention mixes only a request's own tokens, so the others' are
  exact). Every rank of a core routes its tokens alike (the router is replicated), so they
  decide alike.

Other cores' steps, and their other requests, are unaffected: the failing rank's experts
computed their pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from trillm.distributed.parallel_state import expert_rank_label, get_ep_group, get_tp_group
from trillm.messages import ModelRunnerOutput

OK, FAILED = 0, 1  # a rank's status in the agreement


@dataclass
class ForwardFaults:
    """This rank's current forward under -dp N -ep: its MoE layers so far, the first failure
    inside one, the layers whose experts failed here, and where each layer routed this
    core's tokens."""

    layer: int = 0
    error: str | None = None
    experts_lost: tuple[int, int] | None = None  # the first and last layer they failed in
    # Per MoE layer so far, this core's tokens' experts (ids [T, k], the layer's own tensor,
    # kept until the forward's end) and the experts each rank holds.
    routes: list[tuple[torch.Tensor, int]] = field(default_factory=list)

    def note_routed(self, ids: torch.Tensor, per_rank: int) -> None:
        """The current layer routes this core's tokens to these experts."""
        self.routes.append((ids, per_rank))

    def note_error(self, text: str, experts_lost: bool) -> None:
        if self.error is None:
            self.error = text
        if experts_lost:
            first = self.layer if self.experts_lost is None else self.experts_lost[0]
            self.experts_lost = (first, self.layer)


faults = ForwardFaults()  # this process's: one rank per worker process


def start_forward() -> None:
    """A forward (a step or a dummy one) begins: what the last one noted is forgotten."""
    global faults
    faults = ForwardFaults()


@dataclass
class StepVerdict:
    """A rank's step after the agreement: failed whole (``reason``), or only the requests of
    the tokens ``tokens`` marks (``why``), or neither."""

    reason: str | None = None
    tokens: torch.Tensor | None = None  # [T] bool, on the CPU
    why: str = ""


def agree_step(failed: bool, device: torch.device | str) -> StepVerdict:
    """The end of a forward on every rank of every core (``failed``: this rank's forward
    raised outside a MoE layer); -> this rank's step's verdict."""
    seen = faults
    start_forward()
    ep, tp = get_ep_group(), get_tp_group()
    # Per rank: its status, and 1 + the first and last layer its experts failed in (0: none).
    codes = torch.zeros(ep.world_size, 3, dtype=torch.int32)
    codes[ep.rank, 0] = FAILED if failed or seen.error is not None else OK
    if seen.experts_lost is not None:
        codes[ep.rank, 1:] = torch.tensor(seen.experts_lost) + 1
    got = ep.all_reduce(codes.to(device)).tolist()
    if seen.error is not None:
        return StepVerdict(f"the forward failed in a MoE layer on this rank: {seen.error}")
    if failed:
        return StepVerdict("the forward failed on this rank")
    core, hit, whys = ep.rank // tp.world_size, None, []
    for rank, (status, first, last) in enumerate(got):
        label = expert_rank_label(rank // tp.world_size, rank % tp.world_size, tp.world_size)
        if status != OK and rank // tp.world_size == core:
            reason = f"the forward failed on {label}, a tensor-parallel rank of this engine core"
            return StepVerdict(reason)
        if not first:
            continue
        for ids, per_rank in seen.routes[first - 1 : last]:  # the layers they failed in
            routed = (ids // per_rank == rank).any(dim=1).cpu()  # [T]
            hit = routed if hit is None else hit | routed
        layers = f"{first}" if first == last else f"{first} to {last}"
        whys.append(f"the experts of {label} failed in MoE layer {layers} of this forward")
    if hit is None or not bool(hit.any()):
        return StepVerdict()
    why = "; ".join(whys) + ", and this request's tokens were routed to them"
    return StepVerdict(tokens=hit, why=why)


def requests_of(
    verdict: StepVerdict, req_ids: Sequence[str], query_start_loc: np.ndarray
) -> dict[str, str] | None:
    """req_id -> why, for the requests of the tokens the verdict marks, given the step's
    requests in batch order and where each one's tokens start in its flat batch ([R + 1]);
    None where the step's tokens cannot be told apart (then the whole step fails)."""
    if verdict.tokens is None or len(query_start_loc) != len(req_ids) + 1:
        return None
    if int(query_start_loc[-1]) != len(verdict.tokens):
        return None
    rows = np.nonzero(verdict.tokens.numpy())[0]
    owners = np.searchsorted(query_start_loc, rows, side="right") - 1
    return {req_ids[i]: verdict.why for i in sorted(set(owners.tolist()))}


def without_requests(out: ModelRunnerOutput, lost: dict[str, str]) -> ModelRunnerOutput:
    """The step's output with ``lost``'s requests failed (no tokens: the engine ends them
    alone, as requests the worker could not take)."""
    out.sampled_token_ids = [
        [] if req_id in lost else tokens
        for req_id, tokens in zip(out.req_ids, out.sampled_token_ids)
    ]
    for per_request in (out.logprobs, out.prompt_logprobs, out.pooler_output):
        for req_id in lost:
            per_request.pop(req_id, None)
    for req_id in lost:
        out.draft_token_ids.pop(req_id, None)
    out.failed = {**out.failed, **lost}
    return out
