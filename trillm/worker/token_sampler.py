"""P3 on the worker (``ModelRunner.sample_tokens``): the pending step's tokens and its output.

On the last pipeline stage ``TokenSampler`` samples the rows P2 kept (or verifies the step's
drafts: ``spec_verify.py``), appends the tokens to the persistent batch and the sampling
state, proposes the next drafts (the draft model, where there is one) and builds the
``ModelRunnerOutput`` in batch order. A stage before the last samples nothing
(``output_before_last_stage``). The pieces it sequences are in ``step_sampling.py``; the
batch, the sampling state and the drafter are the runner's, shared here.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from trillm.messages import LogprobsLists, ModelRunnerOutput
from trillm.sample.logprobs import LogprobsTensors
from trillm.sample.sampler import Sampler, SamplerOutput, SamplingState
from trillm.spec_decode.draft_model import DraftModelProposer
from trillm.worker.input_batch import InputBatch
from trillm.worker.spec_verify import DraftStep, accept_drafts
from trillm.worker.step_sampling import (
    Bitmask,
    PendingStep,
    bitmask_tensor,
    prompt_logprobs,
    sample_isolated,
    sample_logprobs,
)

logger = logging.getLogger(__name__)


class TokenSampler:
    """The last stage's P3 over the runner's batch, sampling state and drafter."""

    def __init__(
        self,
        batch: InputBatch,
        sampling_state: SamplingState,
        drafter: DraftModelProposer | None,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.batch = batch
        self.sampling_state = sampling_state
        self.drafter = drafter
        self.vocab_size = vocab_size
        self.device = device
        self.sampler = Sampler()

    def sample(self, pending: PendingStep, bitmask: Bitmask | None) -> ModelRunnerOutput:
        inputs = pending.inputs
        sampled_lists: list[list[int]] = [[] for _ in pending.req_ids]
        logprobs: dict[str, LogprobsLists] = {}
        failed: dict[str, str] = {}
        if len(inputs.sample_reqs) and pending.drafts:
            sampled_lists, logprobs, failed = self._verify(pending, bitmask)
        elif len(inputs.sample_reqs):
            rows = inputs.sample_reqs
            sample_req_ids = [pending.req_ids[i] for i in rows.tolist()]
            mask = self._bitmask_tensor(bitmask, sample_req_ids, pending.sample_logits)
            out, kept, failed = sample_isolated(
                self._call_sampler, pending.sample_logits, inputs.slots[rows], mask, sample_req_ids
            )
            rows, sample_req_ids = rows[kept], [sample_req_ids[i] for i in kept.tolist()]
            sample_slots = inputs.slots[rows]
            tokens = out.sampled_token_ids.cpu().numpy()
            self.batch.append_sampled(sample_slots, tokens)
            self.sampling_state.append_tokens(sample_slots.tolist(), tokens.tolist())
            for i, token in zip(rows.tolist(), tokens.tolist()):
                sampled_lists[i] = [token]
            logprobs = self._sample_logprobs(out.logprobs, sample_req_ids, sample_slots)
        refused = pending.failed  # new requests the batch never took (not in req_ids)
        drafts = {} if self.drafter is None else self._propose(pending, sampled_lists)
        return ModelRunnerOutput(
            step_id=pending.step_id,
            req_ids=pending.req_ids + list(refused),
            sampled_token_ids=sampled_lists + [[] for _ in refused],
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs(pending),
            model_time_s=time.perf_counter() - pending.start_time,
            failed={**refused, **failed},
            draft_token_ids=drafts,
        )

    def _propose(self, pending: PendingStep, sampled: list[list[int]]) -> dict[str, list[int]]:
        """The draft model's drafts for the next step, after recording how this step's fared
        (its back-off): for every request that sampled."""
        assert self.drafter is not None
        candidates = []
        for req_id, tokens in zip(pending.req_ids, sampled):
            if not tokens:
                continue
            verified = pending.drafts.get(req_id)
            if verified:
                self.drafter.record(req_id, len(verified), len(tokens) - 1)
            candidates.append((req_id, self.batch.slot_of(req_id)))
        try:
            return self.drafter.propose(self.batch, candidates)
        except Exception:  # NOTE: drafts only save time; the step's tokens stand without them
            logger.exception("the draft model failed to propose; this step has no drafts")
            self.drafter.forget_cache([slot for _, slot in candidates])
            return {}

    def _verify(
        self, pending: PendingStep, bitmask: Bitmask | None
    ) -> tuple[list[list[int]], dict[str, LogprobsLists], dict[str, str]]:
        """P3 with drafts: every drafted position sampled at once (a seeded row with the
        noise of its own output position), then ``spec_verify.accept_drafts``."""
        inputs, owner, offset = pending.inputs, pending.row_owner, pending.row_offset
        assert owner is not None and offset is not None and pending.num_drafts is not None
        batch_index = inputs.sample_reqs[owner]  # [N] each row's index in the batch
        row_req_ids = [pending.req_ids[i] for i in batch_index.tolist()]
        mask = self._bitmask_tensor(bitmask, row_req_ids, pending.sample_logits)
        out, kept, failed = sample_isolated(
            self._call_sampler,
            pending.sample_logits,
            inputs.slots[batch_index],
            mask,
            row_req_ids,
            offset.tolist(),
        )
        step = DraftStep(inputs, pending.req_ids, pending.drafts, pending.num_drafts, row_req_ids)
        sampled, logprobs = accept_drafts(self.batch, self.sampling_state, step, out, kept, failed)
        return sampled, logprobs, failed

    def _call_sampler(
        self,
        logits: torch.Tensor,
        slots: torch.Tensor,
        mask: torch.Tensor | None,
        offsets: list[int] | None,
    ) -> SamplerOutput:
        if offsets is None:  # no drafted positions this step
            return self.sampler(logits, self.sampling_state, slots, mask)
        return self.sampler(logits, self.sampling_state, slots, mask, step_offsets=offsets)

    def _bitmask_tensor(
        self, bitmask: Bitmask | None, req_ids: list[str], logits: torch.Tensor
    ) -> torch.Tensor | None:
        return bitmask_tensor(bitmask, req_ids, logits, self.vocab_size, self.device)

    def _sample_logprobs(
        self, tensors: LogprobsTensors | None, req_ids: list[str], slots: np.ndarray
    ) -> dict[str, LogprobsLists]:
        asked = [self.batch.params[slot].logprobs for slot in slots.tolist()]
        return sample_logprobs(tensors, req_ids, asked)


def output_before_last_stage(pending: PendingStep) -> ModelRunnerOutput:
    """A stage before the last samples nothing: its output only says the step ran (the
    executor returns the last stage's; its tokens come with a later step)."""
    refused = pending.failed
    nothing: list[list[int]] = [[] for _ in range(len(pending.req_ids) + len(refused))]
    return ModelRunnerOutput(
        step_id=pending.step_id,
        req_ids=pending.req_ids + list(refused),
        sampled_token_ids=nothing,
        model_time_s=time.perf_counter() - pending.start_time,
        failed=dict(refused),
    )
