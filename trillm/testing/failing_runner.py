"""``ModelRunner`` whose forward fails for one prompt: tests of a step that fails inside a
worker under ``-dp N --enable-expert-parallel``, where the failing core's ranks must still
take part in the MoE exchanges the other cores' ranks wait in (worker_main._execute).

Runner arguments: ``fail_prompt`` (token ids: a step that schedules a new request with
exactly this prompt fails) and ``after_layers`` (0: before the forward; k: once the k-th
expert-parallel MoE layer has run, mid-forward), or ``after_exchanges`` (n: in the code after
the forward's n-th expert all-to-all, which returns its rows one column wider; 4 x k: the
k-th MoE layer's weighting of its experts' outputs, its exchanges done), or
``before_exchange`` (n: the code between the forward's (n - 1)-th and n-th expert all-to-all
fails, the n-th not sent), or ``fail_experts`` (k: the k-th MoE layer's expert computation
on the rows routed to this rank, the other cores' tokens' too); ``fail_rank``: only this rank
of the core fails (None: every one).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn

from trillm.distributed import expert_parallel
from trillm.distributed.parallel_state import TensorParallelGroup
from trillm.messages import SchedulerOutput
from trillm.model_executor.layers.fused_moe import FusedMoE
from trillm.worker.model_runner import ModelRunner


class InjectedFailure(RuntimeError):
    pass


class FailingRunner(ModelRunner):
    def __init__(
        self,
        config: Any,
        rank: int = 0,
        *,
        fail_prompt: list[int] | None = None,
        after_layers: int = 0,
        after_exchanges: int = 0,
        before_exchange: int = 0,
        fail_experts: int = 0,
        fail_rank: int | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(config, rank, **kw)
        self.fail_prompt = list(fail_prompt or [])
        self.after_layers = after_layers
        self.after_exchanges = after_exchanges
        self.before_exchange = before_exchange
        self.fail_experts = fail_experts
        self.fails_here = fail_rank is None or fail_rank == rank

    def execute_model(self, sched: SchedulerOutput) -> Any:
        if not self.fails_here or not any(
            r.prompt_token_ids == self.fail_prompt for r in sched.scheduled_new_reqs
        ):
            return super().execute_model(sched)
        if self.after_exchanges or self.before_exchange:
            return self._fail_after_exchanges(sched)
        if self.fail_experts:
            return self._fail_experts(sched)
        if self.after_layers == 0:
            raise InjectedFailure("told to fail before the forward")
        model = cast(nn.Module, self.model)
        layers = [m for m in model.modules() if isinstance(m, FusedMoE)]

        def fail(*_: Any) -> None:
            raise InjectedFailure(f"told to fail after {self.after_layers} MoE layer(s)")

        hook = layers[self.after_layers - 1].register_forward_hook(fail)
        try:
            return super().execute_model(sched)
        finally:
            hook.remove()

    def _fail_after_exchanges(self, sched: SchedulerOutput) -> Any:
        exchange, done = expert_parallel._exchange, [0]

        def counted(
            group: TensorParallelGroup, rank: int, rows: Tensor, send: list[int], recv: list[int]
        ) -> Tensor:
            if done[0] + 1 == self.before_exchange:
                done[0] += 1
                raise InjectedFailure(f"told to fail before expert exchange {done[0]}")
            out = exchange(group, rank, rows, send, recv)
            done[0] += 1
            if done[0] == self.after_exchanges:  # one column more: the code after it fails
                return torch.cat([out, out[:, :1]], dim=1)
            return out

        expert_parallel._exchange = counted  # dispatch_combine looks it up at each call
        try:
            return super().execute_model(sched)
        finally:
            expert_parallel._exchange = exchange

    def _fail_experts(self, sched: SchedulerOutput) -> Any:
        model = cast(nn.Module, self.model)
        layer = [m for m in model.modules() if isinstance(m, FusedMoE)][self.fail_experts - 1]

        def fail(*_: Any) -> Tensor:
            raise InjectedFailure(f"told to fail in MoE layer {self.fail_experts}'s experts")

        layer._run_held = fail  # type: ignore[method-assign,assignment]  # dispatch_combine's run_local
        try:
            return super().execute_model(sched)
        finally:
            del layer._run_held
