"""The model runner of a pooling model (embeddings, classification): stage 7 as for generation,
then, instead of stage 8, the prompt's hidden states pooled into one vector
(``model_executor/pooling``); a classifier's vector is its class probabilities (the score head
on the last row, ``model_executor/classification``).

A prompt may arrive in several chunks: each step adds its rows to the request's running sum
and remembers the first and last row; the step that completes the prompt finishes the vector
and returns it (``ModelRunnerOutput.pooler_output``, float32 bytes) with one placeholder token,
which ends the request (the engine gives pooling requests ``max_tokens=1``). No logits and no
sampling: the LM head never runs. With pipeline stages only the last stage pools (the earlier
ones run their layers and hand the hidden states on); the executor returns its output. With
tensor parallelism every rank of the last stage holds the whole hidden states (the row-parallel
o / down projections are all-reduced) and the whole score head, so each pools the same vector
(up to the all-reduce's summation order); the executor returns its first rank's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from trillm.config import TrillmConfig
from trillm.messages import ModelRunnerOutput, SchedulerOutput
from trillm.model_executor.classification import class_probs
from trillm.model_executor.layers.fused_moe import exchange_without_tokens
from trillm.model_executor.pooling import finish_pooling
from trillm.worker.model_runner import ModelRunner


@dataclass
class _Accumulated:
    """One prompt's pooled state so far."""

    summed: torch.Tensor  # [H] float32
    count: int
    first: torch.Tensor  # [H]: the prompt's first row
    last: torch.Tensor  # [H]: the latest row


@dataclass
class _PoolingStep:
    step_id: int
    req_ids: list[str]  # batch order
    pooled: dict[str, bytes]
    failed: dict[str, str]
    start_time: float


class PoolingModelRunner(ModelRunner):
    def __init__(self, config: TrillmConfig, rank: int = 0) -> None:
        if config.pooler is None:
            raise ValueError("PoolingModelRunner needs a pooling config (runner='pooling').")
        super().__init__(config, rank)
        self.pooler = config.pooler
        self._acc: dict[str, _Accumulated] = {}
        self._step: _PoolingStep | None = None
        eos = config.model.eos_token_ids
        self._placeholder = int(eos[0]) if eos else 0  # ends the request; never shown

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> None:
        start = time.perf_counter()
        self._step = None
        for req_id in sched.finished_req_ids:
            self._acc.pop(req_id, None)
        for new in sched.scheduled_new_reqs:  # re-sent after a preemption: pool it again
            self._acc.pop(new.req_id, None)
        failed = self._update_batch(sched)
        req_ids = [r for r in sched.num_scheduled_tokens if r not in failed]
        pooled: dict[str, bytes] = {}
        if req_ids:
            slots = np.array([self.batch.slot_of(r) for r in req_ids], dtype=np.int64)
            num_scheduled = np.array([sched.num_scheduled_tokens[r] for r in req_ids], np.int64)
            inputs = self.batch.prepare(slots, num_scheduled)
            hidden = self._forward(inputs)  # [T, H]; None: not the last pipeline stage
            self._num_steps += 1
            if hidden is None:  # the last stage pools; this one only sent its hidden states
                self._step = _PoolingStep(sched.step_id, req_ids, {}, failed, start)
                return
            starts = inputs.query_start_loc
            for i, req_id in enumerate(req_ids):
                self._add_rows(req_id, hidden[int(starts[i]) : int(starts[i + 1])])
            for i in inputs.sample_reqs.tolist():  # these prompts are complete
                acc = self._acc.pop(req_ids[i])
                if self.pooler.task == "classify":  # the score head on the last row
                    logits = self._model.lm_head(acc.last[None])[0]  # type: ignore[union-attr]
                    vec = class_probs(logits)  # [num_labels]
                else:
                    vec = finish_pooling(self.pooler, acc.summed, acc.count, acc.first, acc.last)
                pooled[req_ids[i]] = vec.cpu().numpy().astype(np.float32).tobytes()
        elif self.config.parallel.experts_span_cores and isinstance(self.model, torch.nn.Module):
            # -dp N -ep: counted as a forward, its MoE exchanges all the same (see ModelRunner)
            exchange_without_tokens(self.model, self.dtype, self.device)
        self._step = _PoolingStep(sched.step_id, req_ids, pooled, failed, start)

    def _add_rows(self, req_id: str, rows: torch.Tensor) -> None:  # rows [n, H]
        acc = self._acc.get(req_id)
        summed = rows.float().sum(dim=0)
        if acc is None:
            self._acc[req_id] = _Accumulated(summed, len(rows), rows[0].clone(), rows[-1].clone())
            return
        acc.summed += summed
        acc.count += len(rows)
        acc.last = rows[-1].clone()

    def sample_tokens(self, bitmask: dict[str, bytes | list[int]] | None) -> ModelRunnerOutput:
        step = self._step
        if step is None:
            raise RuntimeError("sample_tokens called without a successful execute_model.")
        self._step = None
        sampled = [[self._placeholder] if r in step.pooled else [] for r in step.req_ids]
        out = ModelRunnerOutput(
            step_id=step.step_id,
            req_ids=step.req_ids + list(step.failed),
            sampled_token_ids=sampled + [[] for _ in step.failed],
            model_time_s=time.perf_counter() - step.start_time,
            failed=step.failed,
            pooler_output=step.pooled,
        )
        return self.forward_clock.stamp(out)
