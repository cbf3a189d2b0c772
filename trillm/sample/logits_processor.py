"""Custom logits processors with vLLM v1's interface (``vllm.v1.sample.logits_processor``).

A processor written for vLLM runs unchanged with its imports pointed here: subclass
``LogitsProcessor`` (or ``AdapterLogitsProcessor`` to wrap per-request callables) and pass
the class, or its name ``pkg.mod:Cls``, as ``--logits-processors`` / ``logits_processors``
(trillm/config/logits_processors.py loads it). Each model worker builds one instance per
class (``trillm/sample/custom_batch.py`` keeps the instances' batch in vLLM's shape).

Batch indices are rows of the logits a step's ``apply`` receives: ``update_state`` says
which request each row holds, as diffs to handle in vLLM's order (removed, added, moved).
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, auto
from functools import partial
from typing import Any, TypeVar

import torch

from trillm.sampling_params import SamplingParams

__all__ = [
    "AdapterLogitsProcessor",
    "AddedRequest",
    "BatchUpdate",
    "LogitsProcessor",
    "MoveDirectionality",
    "MovedRequest",
    "RemovedRequest",
    "RequestLogitsProcessor",
    "process_dict_updates",
]


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()  # the request at index a moves to index b (b's is gone)
    SWAP = auto()  # the requests at a and b trade places


RemovedRequest = int  # its batch index
# (index, params, prompt token ids, output token ids: a live list, grown as tokens come)
AddedRequest = tuple[int, SamplingParams, list[int] | None, list[int]]
MovedRequest = tuple[int, int, MoveDirectionality]  # (a, b, direction)

# vLLM's per-request callables: (output ids, row) or (prompt ids, output ids, row) -> row
RequestLogitsProcessor = (
    Callable[[list[int], torch.Tensor], torch.Tensor]
    | Callable[[list[int], list[int], torch.Tensor], torch.Tensor]
)


@dataclass(frozen=True)
class BatchUpdate:
    """How the batch changed since the last ``update_state``: apply removed, then added
    (an add may take a removed request's index), then moved (in order)."""

    batch_size: int  # requests in the batch now: rows [0, batch_size) of apply's logits
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """vLLM v1's batch-level logits processor."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ValueError for params this processor cannot take (a 400 at admission)."""
        return None

    @abstractmethod
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [batch_size, V] -> the processed logits (in place or a new tensor)."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True: never changes a row's argmax, so skipped on all-greedy steps and applied
        after temperature; False: applied before penalties on every step."""
        raise NotImplementedError

    def needs_output_token_ids(self) -> bool:
        """vLLM's async-scheduling hint; trillm's output lists always hold real ids."""
        return False

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before every ``apply``; None: the batch did not change."""
        raise NotImplementedError


S = TypeVar("S")


def process_dict_updates(
    req_entries: dict[int, S],
    batch_update: BatchUpdate | None,
    new_state: Callable[[SamplingParams, list[int] | None, list[int]], S | None],
) -> bool:
    """Keeps ``req_entries`` (batch index -> a request's state) in step with a batch update;
    ``new_state`` gives an added request's state, or None when the processor skips it.
    Returns whether the entries changed."""
    if batch_update is None:
        return False
    changed = False
    for index in batch_update.removed:
        changed |= req_entries.pop(index, None) is not None
    for index, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is not None:
            req_entries[index] = state
            changed = True
        else:
            changed |= req_entries.pop(index, None) is not None
    for a, b, direction in batch_update.moved:
        a_state = req_entries.pop(a, None)
        b_state = req_entries.pop(b, None)
        if a_state is not None:
            req_entries[b] = a_state
        if direction is MoveDirectionality.SWAP and b_state is not None:
            req_entries[a] = b_state
        changed |= a_state is not None or b_state is not None
    return changed


class AdapterLogitsProcessor(LogitsProcessor):
    """A batch-level processor from per-request callables: subclasses implement
    ``is_argmax_invariant`` and ``new_req_logits_processor`` and call ``super().__init__``."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.req_info: dict[int, partial[torch.Tensor]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        """The request's callable, or None when it does not apply to the request."""
        raise NotImplementedError

    def _new_state(
        self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
    ) -> partial[torch.Tensor] | None:
        req_lp = self.new_req_logits_processor(params)
        if req_lp is None:
            return None
        # NOTE: the partial holds the live output list, so each call sees the latest tokens.
        takes_prompt = len(inspect.signature(req_lp).parameters) == 3
        args = [prompt_ids, output_ids] if takes_prompt else [output_ids]
        return partial(req_lp, *args)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, req_lp in self.req_info.items():
            row = logits[index]
            new_row = req_lp(row)
            if new_row is not row:
                logits[index] = new_row
        return logits
