"""Expert parallelism (``--enable-expert-parallel``, vLLM's flag): a mixture-of-experts layer's
experts placed over the ranks of the tensor-parallel group instead of each expert's weights
being split over them.

Placement (vLLM's linear expert map): rank r of N holds experts [r * E / N, (r + 1) * E / N)
whole, so E must be a multiple of N; attention, the router, dense MLPs and shared experts stay
tensor-parallel. A layer's forward (``dispatch_combine``), with the step's T tokens on every
rank (the router is replicated, so every rank routes them alike):

1. each rank takes one slice of the tokens (``token_slice``: ceil(T / N) rows, the last ones
   shorter or empty) and sends every (token, expert) pair of its slice, the token's hidden row
   and the expert's index on its owner, to the rank that holds the expert (all-to-all);
2. each rank runs its experts on the rows it received (unweighted);
3. the outputs go back to the ranks that sent them (all-to-all), which weight them by the
   routing weights and sum each token's ``top_k`` in fp32;
4. each rank returns its slice's rows and zeros elsewhere: the layer's all-reduce (the one that
   sums the tensor-parallel partial outputs without expert parallelism) assembles the tokens,
   exactly (x + 0 is x).

Over several engine cores (vLLM's ``-dp`` with ``-ep``) the experts are placed over every
core's ranks (``parallel_state.get_ep_group``: core d's rank r is rank d x tp + r) and each
core's ranks hold their own tokens: step 1 slices them over the core's ranks only
(``ExpertPlacement.core``), and a core with no tokens still takes part in every exchange with
an empty step (``fused_moe.exchange_without_tokens``: every MoE layer's exchanges; no
attention, no KV write, no sampling), running its experts for the others; the engine keeps
the cores' forwards in lock-step (trillm/engine/dp_lockstep.py).

Bytes each rank sends to the others (``ExpertTraffic``: the line a rank prints on shutdown,
benchmarks/parallel/expert_parallel.py) and the (token, expert) pairs routed to each rank's
experts (``ExpertLoad``, counted by every rank from the replicated routing; the output rank's
go out with each step's output to ``/metrics``) are kept per process.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import cast

import torch

from trillm.distributed import expert_step_faults
from trillm.distributed.parallel_state import TensorParallelGroup, get_ep_group, get_tp_group
from trillm.errors import CollectiveTimeoutError


@dataclass
class ExpertTraffic:
    """Bytes this rank sent to other ranks in the experts' all-to-alls, and how many ran,
    since the last ``take``."""

    bytes_sent: int = 0
    num_exchanges: int = 0
    # MoE layers whose exchanges completed, since the start (``take`` keeps it): a forward
    # that fails on this rank finishes the rest without tokens under -dp N -ep
    # (worker_main._execute), the other cores' ranks waiting in them. Counted once a layer's
    # last exchange returns, before its local weighting: a failure there must not make the
    # rank run that layer's exchanges again (they would pair with the next layer's).
    layers_done: int = 0

    def add(self, rows: torch.Tensor, send: list[int], rank: int) -> None:
        row_bytes = rows[0].numel() * rows.element_size() if len(rows) else 0  # rows: [P, ...]
        self.bytes_sent += row_bytes * (sum(send) - send[rank])  # its own rows stay
        self.num_exchanges += 1

    def take(self) -> tuple[int, int]:
        taken = self.bytes_sent, self.num_exchanges
        self.bytes_sent = self.num_exchanges = 0
        return taken


traffic = ExpertTraffic()  # this process's: one rank per worker process


@dataclass
class ExpertLoad:
    """The (token, expert) pairs routed to each rank's experts, summed over the MoE layers,
    since the last ``take`` (the output rank sends them with each step's output: /metrics)."""

    routed: torch.Tensor | None = None  # [N] int64

    def add(self, ids: torch.Tensor, per_rank: int, size: int) -> None:
        step = torch.bincount(ids.reshape(-1) // per_rank, minlength=size).cpu()  # [N]
        self.routed = step if self.routed is None else self.routed + step

    def take(self) -> list[int]:
        """Per rank, since the last call; [] without expert parallelism."""
        taken = [] if self.routed is None else self.routed.tolist()
        self.routed = None
        return taken


load = ExpertLoad()  # this process's, like ``traffic``


@dataclass
class ExpertPlacement:
    """Which experts this rank holds: every one (``size`` 1), or one block of
    ``num_experts / size`` under expert parallelism."""

    num_experts: int
    rank: int = 0
    size: int = 1
    # Placed over several engine cores (-dp N -ep): the (index, count) of this rank among its
    # own core's ranks, which alone hold its tokens and split their dispatch
    # (``token_slice``); None: every rank holds the same tokens (one core).
    core: tuple[int, int] | None = None

    @classmethod
    def current(cls, num_experts: int) -> ExpertPlacement:
        """This rank's placement in the group the model is being built in."""
        tp, ep = get_tp_group(), get_ep_group()
        if not tp.expert_parallel or ep.world_size == 1:
            return cls(num_experts)
        core = None if ep is tp else (tp.rank, tp.world_size)
        return cls(num_experts, ep.rank, ep.world_size, core)

    @property
    def per_rank(self) -> int:
        return self.num_experts // self.size

    @property
    def start(self) -> int:
        return self.rank * self.per_rank

    def holds(self, expert: int) -> bool:
        return self.start <= expert < self.start + self.per_rank

    @property
    def token_share(self) -> tuple[int, int]:
        """(index, count) of the ranks that split this rank's tokens' dispatch."""
        return (self.rank, self.size) if self.core is None else self.core


def token_slice(num_tokens: int, size: int, rank: int) -> tuple[int, int]:
    """[start, end) of the tokens rank ``rank`` of ``size`` dispatches."""
    chunk = -(-num_tokens // size)
    return min(rank * chunk, num_tokens), min((rank + 1) * chunk, num_tokens)


# (rows [P, H], ones [P, 1] fp32, local expert ids [P, 1]) -> each row's expert output [P, H]
RunLocal = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _exchange(
    group: TensorParallelGroup, rank: int, rows: torch.Tensor, send: list[int], recv: list[int]
) -> torch.Tensor:
    """One all-to-all of ``rows`` (``send[j]`` rows to rank j, ``recv[j]`` from it), counted."""
    traffic.add(rows, send, rank)
    return group.all_to_all(rows, send, recv)


@dataclass
class _Progress:
    """How far one layer's exchanges got (``dispatch_combine``), for ``_finish_layer``."""

    exchanges: int = 0
    send: list[int] | None = None  # pairs this rank sends to each rank
    recv: list[int] | None = None  # pairs each rank sends to this one
    got_rows: torch.Tensor | None = None
    got_ids: torch.Tensor | None = None
    in_experts: bool = False  # inside ``run_local``


def dispatch_combine(
    placement: ExpertPlacement,
    x: torch.Tensor,  # [T, H], the same on every rank
    weights: torch.Tensor,  # [T, k] fp32
    ids: torch.Tensor,  # [T, k] int64, global expert ids
    run_local: RunLocal,
) -> torch.Tensor:  # [T, H]: this rank's token slice, zeros elsewhere
    """Steps 1-4 of the module docstring. ``x`` may have no rows (T = 0): the rank still
    takes part in the all-to-alls and runs its experts on the rows other ranks send it, as an
    idle engine core must while others step when the experts span several cores. There, a
    failure inside the layer is noted and the layer's exchanges completed (zeros returned:
    ``expert_step_faults``), not raised: the other cores' ranks wait in them."""
    load.add(ids, placement.per_rank, placement.size)  # ids: the same on every rank
    progress = _Progress()
    if placement.core is None:
        return _dispatch_combine(placement, x, weights, ids, run_local, progress)
    step_faults = expert_step_faults.faults
    step_faults.note_routed(ids, placement.per_rank)
    try:
        return _dispatch_combine(placement, x, weights, ids, run_local, progress)
    except CollectiveTimeoutError:
        raise  # the group is broken: nothing to complete
    except Exception:
        text = traceback.format_exc()
        lost = _finish_layer(placement, x, run_local, progress)
        step_faults.note_error(text, lost)
        return torch.zeros_like(x)
    finally:
        step_faults.layer += 1


def _dispatch_combine(
    placement: ExpertPlacement,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    run_local: RunLocal,
    p: _Progress,
) -> torch.Tensor:
    start, end = token_slice(x.shape[0], placement.token_share[1], placement.token_share[0])
    flat = ids[start:end].reshape(-1)  # [t * k], token-major
    owner = flat // placement.per_rank  # [t * k]
    order = torch.argsort(owner, stable=True)  # the pairs grouped by owner rank
    send = torch.bincount(owner, minlength=placement.size)  # [N] pairs to each rank
    exchange = partial(_exchange, get_ep_group(), placement.rank)
    p.send = send_n = send.tolist()
    recv = exchange(send[:, None], [1] * placement.size, [1] * placement.size)  # [N, 1]
    p.exchanges, p.recv = 1, recv[:, 0].tolist()
    recv_n = p.recv
    rows = x[start:end].repeat_interleave(ids.shape[1], dim=0)[order]  # [t * k, H]
    local_ids = (flat - owner * placement.per_rank)[order, None]  # [t * k, 1]
    got_rows = p.got_rows = exchange(rows, send_n, recv_n)  # [P, H]
    p.exchanges = 2
    got_ids = p.got_ids = exchange(local_ids, send_n, recv_n)  # [P, 1]
    p.exchanges = 3
    ones = torch.ones(len(got_ids), 1, dtype=torch.float32, device=x.device)
    p.in_experts = True
    outs = run_local(got_rows, ones, got_ids) if len(got_ids) else got_rows  # [P, H]
    p.in_experts = False
    back = exchange(outs, recv_n, send_n)  # [t * k, H], in ``order``
    p.exchanges = 4
    traffic.layers_done += 1  # its exchanges done: a failure below must not run them again
    pairs = torch.empty_like(back)
    pairs[order] = back
    mine = pairs.view(end - start, ids.shape[1], x.shape[1]).float() * weights[start:end, :, None]
    out = torch.zeros_like(x)
    out[start:end] = mine.sum(dim=1).to(x.dtype)
    return out


def _finish_layer(
    placement: ExpertPlacement, x: torch.Tensor, run_local: RunLocal, p: _Progress
) -> bool:
    """The exchanges of a layer that failed on this rank after ``p.exchanges`` of its four,
    with the sizes already agreed (none sent if the counts were not): zero rows for this
    rank's own tokens, its experts' outputs for the others' rows (zeros if it was their
    computation that failed, or fails again). -> whether the others' pairs lost their
    outputs here."""
    if p.exchanges >= 4:
        return False
    exchange = partial(_exchange, get_ep_group(), placement.rank)
    size, hidden, device = placement.size, x.shape[1], x.device
    if p.exchanges == 0:
        p.send = [0] * size
        counts = torch.zeros(size, 1, dtype=torch.int64, device=device)
        p.recv = exchange(counts, [1] * size, [1] * size)[:, 0].tolist()
    send, recv = cast(list[int], p.send), cast(list[int], p.recv)
    if p.exchanges < 2:
        p.got_rows = exchange(x.new_zeros(sum(send), hidden), send, recv)
    if p.exchanges < 3:
        zero_ids = torch.zeros(sum(send), 1, dtype=torch.int64, device=device)
        p.got_ids = exchange(zero_ids, send, recv)
    lost, outs = p.in_experts, None
    rows, got_ids = cast(torch.Tensor, p.got_rows), cast(torch.Tensor, p.got_ids)
    if not lost and len(got_ids):
        ones = torch.ones(len(got_ids), 1, dtype=torch.float32, device=device)
        try:
            outs = run_local(rows, ones, got_ids)
        except Exception:
            lost = True
    if outs is None or tuple(outs.shape) != (sum(recv), hidden):
        outs = x.new_zeros(sum(recv), hidden)
    exchange(outs, recv, send)
    traffic.layers_done += 1
    return lost and sum(recv) > 0
