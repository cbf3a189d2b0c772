"""The persistent batch: per-request state in fixed slots, updated by SchedulerOutput diffs.

Every array is indexed by slot, so a step's inputs are built with numpy fancy indexing over
the scheduled requests (no per-token Python loops). A request's token list is prompt +
output tokens; the runner appends each sampled token itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from trillm.attention.backend import AttentionMetadata
from trillm.messages import NewRequestData
from trillm.sampling_params import SamplingParams
from trillm.utils import cdiv


class BatchFullError(RuntimeError):
    """More concurrent requests than max_num_seqs slots, or an unknown request id."""


@dataclass
class StepInputs:
    """One step's flattened batch, on the host (numpy), in batch order."""

    slots: np.ndarray  # [R] int64
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [R + 1] int32
    context_lens: np.ndarray  # [R] int32
    seq_lens: np.ndarray  # [R] int32
    block_table: np.ndarray  # [R, max_blocks_this_step] int32
    sample_reqs: np.ndarray  # [n] int64: batch indices of requests that sample this step
    sample_rows: np.ndarray  # [n] int64: their last row in the flat batch

    def attention_metadata(self, device: torch.device) -> AttentionMetadata:
        """The step's attention metadata: its index arrays on ``device``, lengths on the host."""

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        query_lens = np.diff(self.query_start_loc)
        return AttentionMetadata(
            num_reqs=len(self.slots),
            num_tokens=len(self.input_ids),
            query_start_loc=dev(self.query_start_loc),
            seq_lens=dev(self.seq_lens),
            context_lens=dev(self.context_lens),
            block_table=dev(self.block_table),
            slot_mapping=dev(self.slot_mapping),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(self.seq_lens.max()),
            query_lens_cpu=query_lens.tolist(),
            seq_lens_cpu=self.seq_lens.tolist(),
        )


class InputBatch:
    def __init__(
        self, max_num_reqs: int, max_model_len: int, block_size: int, max_blocks_per_req: int
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        # NOTE: one spare column: the token sampled at max_model_len is recorded, never fed.
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # prompt + outputs
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self.wants_prompt_logprobs = np.zeros(max_num_reqs, dtype=bool)
        self.req_slot: dict[str, int] = {}
        self._free = list(range(max_num_reqs - 1, -1, -1))  # pop() hands out slot 0 first

    def __len__(self) -> int:
        return len(self.req_slot)

    def slot_of(self, req_id: str) -> int:
        slot = self.req_slot.get(req_id)
        if slot is None:
            raise BatchFullError(f"Request {req_id!r} was scheduled but never sent in full.")
        return slot

    def add_request(self, new: NewRequestData) -> int:
        if not self._free:
            raise BatchFullError(f"All {self.max_num_reqs} batch slots are in use.")
        slot = self._free.pop()
        self.req_slot[new.req_id] = slot
        tokens = list(new.prompt_token_ids) + list(new.output_token_ids)
        self.token_ids[slot, : len(tokens)] = tokens
        self.num_tokens[slot] = len(tokens)
        self.num_prompt_tokens[slot] = len(new.prompt_token_ids)
        self.num_computed[slot] = new.num_computed_tokens
        self.num_blocks[slot] = 0
        self.append_blocks(slot, new.block_ids)
        self.params[slot] = new.sampling_params
        self.wants_prompt_logprobs[slot] = new.sampling_params.prompt_logprobs is not None
        return slot

    def remove_request(self, req_id: str) -> int | None:
        """Frees the request's slot; None when the worker never held it (not an error)."""
        slot = self.req_slot.pop(req_id, None)
        if slot is None:
            return None
        self.params[slot] = None
        self.wants_prompt_logprobs[slot] = False
        self._free.append(slot)
        return slot

    def append_blocks(self, slot: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[slot])
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            raise BatchFullError(
                f"Block table of slot {slot} would hold {end} blocks, more than "
                f"max_model_len allows ({self.block_table.shape[1]})."
            )
        self.block_table[slot, start:end] = block_ids
        self.num_blocks[slot] = end

    def append_sampled(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """slots [n], tokens [n]: the tokens sampled this step, appended to each request."""
        self.token_ids[slots, self.num_tokens[slots]] = tokens
        self.num_tokens[slots] += 1

    def write_drafts(self, slot: int, drafts: list[int]) -> None:
        """Draft tokens to verify this step, after the request's tokens (not counted in them:
        the accepted ones are appended by ``append_tokens``)."""
        start = int(self.num_tokens[slot])
        self.token_ids[slot, start : start + len(drafts)] = drafts

    def append_tokens(self, slot: int, tokens: list[int]) -> None:
        """Several tokens for one request (a verified run of drafts plus the target's own)."""
        start = int(self.num_tokens[slot])
        self.token_ids[slot, start : start + len(tokens)] = tokens
        self.num_tokens[slot] = start + len(tokens)

    def prepare(self, slots: np.ndarray, num_scheduled: np.ndarray) -> StepInputs:
        """slots [R], num_scheduled [R] -> the flattened step (positions computed..+n each)."""
        num_reqs = len(slots)
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        total = int(query_start_loc[-1])
        context_lens = self.num_computed[slots]  # [R]
        seq_lens = context_lens + num_scheduled
        row_req = np.repeat(np.arange(num_reqs), num_scheduled)  # [T] request of each row
        offset_in_req = np.arange(total) - query_start_loc[row_req]
        positions = context_lens[row_req] + offset_in_req  # [T]
        row_slot = slots[row_req]
        block_ids = self.block_table[row_slot, positions // self.block_size].astype(np.int64)
        max_blocks = cdiv(int(seq_lens.max(initial=0)), self.block_size)
        sample_reqs = np.nonzero(seq_lens >= self.num_tokens[slots])[0]
        return StepInputs(
            slots=slots,
            input_ids=self.token_ids[row_slot, positions].astype(np.int64),
            positions=positions,
            slot_mapping=block_ids * self.block_size + positions % self.block_size,
            query_start_loc=query_start_loc,
            context_lens=context_lens.astype(np.int32),
            seq_lens=seq_lens.astype(np.int32),
            block_table=self.block_table[slots, :max_blocks],
            sample_reqs=sample_reqs,
            sample_rows=query_start_loc[sample_reqs + 1].astype(np.int64) - 1,
        )
