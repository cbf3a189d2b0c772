"""The custom logits processors of one model worker, and their batch in vLLM's shape.

vLLM's processors index requests by their row in the step's logits and learn of changes as
``BatchUpdate`` diffs. Here the processors' batch is the rows the sampler is handed (the
requests that sample this step, in batch order): a request joins it when it first samples
and leaves it when it does not sample (preempted, unscheduled or finished), as vLLM's
persistent batch drops unscheduled requests and adds them back later. Each sampler call
diffs the rows against the last call's: removed indices, added requests (lowest free index
first, then appended), unidirectional moves that close the gaps, then swaps that put every
request at its row, so ``apply`` needs no copy.

A processor that raises is rebuilt (fresh instances, every request added again at the next
call) and the call raises ``LogitsProcessorError``: the sampler then samples row by row
(``worker/step_sampling.sample_isolated``), so only the requests whose rows still fail end,
with the processor's error; the engine carries on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from trillm.config.logits_processors import load_logits_processors
from trillm.sample.logits_processor import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    MovedRequest,
)
from trillm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from trillm.config import TrillmConfig

T = TypeVar("T")


class LogitsProcessorError(RuntimeError):
    """A custom logits processor raised; the message names it and its error."""


@dataclass(eq=False)  # identity: a slot reused by another request is another request
class _Request:
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)  # live, as vLLM hands it


def processor_config(config: TrillmConfig, device: torch.device) -> SimpleNamespace:
    """What a processor's ``vllm_config`` holds: vLLM's attribute names over trillm's parts
    (``model_config``: model, tokenizer, dtype, vocab_size, max_model_len, hf_config, ...;
    ``scheduler_config``: max_num_seqs, max_num_batched_tokens, max_model_len)."""
    return SimpleNamespace(
        model_config=config.model,
        scheduler_config=config.scheduler,
        cache_config=config.cache,
        parallel_config=config.parallel,
        device_config=SimpleNamespace(device=device, device_type=device.type),
        speculative_config=None,  # refused with custom processors
        lora_config=config.lora,
        seed=config.seed,
        trillm_config=config,
    )


def build_custom_processors(
    config: TrillmConfig, device: torch.device
) -> CustomLogitsProcessors | None:
    """The worker's instances of ``config.logits_processors``; None without any."""
    if not config.logits_processors:
        return None
    classes = load_logits_processors(config.logits_processors)
    return CustomLogitsProcessors(classes, processor_config(config, device), device)


class CustomLogitsProcessors:
    def __init__(
        self,
        classes: Sequence[type[LogitsProcessor]],
        vllm_config: Any,
        device: torch.device,
    ) -> None:
        self._classes = list(classes)
        self._config = vllm_config
        self._device = device
        self._by_slot: dict[int, _Request] = {}
        self._rows: list[_Request] = []  # the processors' batch: index -> request
        self._changing: list[LogitsProcessor] = []  # may change argmax: every step
        self._invariant: list[LogitsProcessor] = []  # argmax-invariant: random rows only
        self._build()

    def _build(self) -> None:
        pin = self._device.type == "cuda"  # is_pin_memory: pinned host copies help there
        procs = [cls(self._config, self._device, pin) for cls in self._classes]
        self._changing = [p for p in procs if not p.is_argmax_invariant()]
        self._invariant = [p for p in procs if p.is_argmax_invariant()]
        self._rows = []

    # ------------------------------------------------------------------ requests

    def add_request(self, slot: int, params: SamplingParams, prompt_ids: Sequence[int]) -> None:
        self._by_slot[slot] = _Request(params, list(prompt_ids))

    def remove_request(self, slot: int) -> None:
        self._by_slot.pop(slot, None)

    def append_tokens(self, slots: Sequence[int], tokens: Sequence[int]) -> None:
        for slot, token in zip(slots, tokens):
            request = self._by_slot.get(slot)
            if request is not None:
                request.output_ids.append(int(token))

    # ------------------------------------------------------------------ a sampler call

    def apply_argmax_changing(self, logits: torch.Tensor, slots: Sequence[int]) -> torch.Tensor:
        """Brings the processors' batch to ``slots`` (logits' rows) and applies those that
        may change a row's argmax (vLLM: after bad words, before penalties)."""
        update = self._update([self._by_slot[slot] for slot in slots])
        for proc in (*self._changing, *self._invariant):
            self._call(proc, proc.update_state, update)
        for proc in self._changing:
            logits = self._call(proc, proc.apply, logits)
        return logits

    def apply_argmax_invariant(self, logits: torch.Tensor) -> torch.Tensor:
        """The argmax-invariant ones, after temperature (vLLM skips them on all-greedy
        steps; the sampler calls this only when some row samples at random)."""
        for proc in self._invariant:
            logits = self._call(proc, proc.apply, logits)
        return logits

    def _call(self, proc: LogitsProcessor, method: Callable[[Any], T], arg: Any) -> T:
        try:
            return method(arg)
        except Exception as exc:
            self._build()  # its state is unknown now: start over, every request re-added
            raise LogitsProcessorError(
                f"custom logits processor {type(proc).__name__}.{method.__name__} raised "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def _update(self, target: list[_Request]) -> BatchUpdate | None:
        rows: list[_Request | None] = list(self._rows)
        wanted = set(map(id, target))
        removed = [i for i, r in enumerate(rows) if r is not None and id(r) not in wanted]
        for i in removed:
            rows[i] = None
        held = set(map(id, (r for r in rows if r is not None)))
        added = self._add(rows, [r for r in target if id(r) not in held])
        # NOTE: as vLLM's, an add that takes a removed request's index replaces it: that
        # index is not also reported removed (processors may handle adds before removals).
        refilled = {index for index, *_ in added}
        removed = [i for i in removed if i not in refilled]
        moved = _condense(rows) + _swap_into_place(rows, target)
        self._rows = list(target)
        if not (removed or added or moved):
            return None
        return BatchUpdate(len(target), removed, added, moved)

    @staticmethod
    def _add(rows: list[_Request | None], new: list[_Request]) -> list[AddedRequest]:
        added: list[AddedRequest] = []
        free = [i for i, r in enumerate(rows) if r is None]
        for request in new:
            index = free.pop(0) if free else len(rows)
            if index == len(rows):
                rows.append(request)
            else:
                rows[index] = request
            added.append((index, request.params, request.prompt_ids, request.output_ids))
        return added


def _condense(rows: list[_Request | None]) -> list[MovedRequest]:
    """Fills each gap, lowest first, with the highest-indexed request (vLLM's compaction)."""
    moved: list[MovedRequest] = []
    while rows and rows[-1] is None:
        rows.pop()
    while None in rows:
        hole = rows.index(None)
        last = len(rows) - 1
        rows[hole] = rows.pop()
        moved.append((last, hole, MoveDirectionality.UNIDIRECTIONAL))
        while rows and rows[-1] is None:
            rows.pop()
    return moved


def _swap_into_place(rows: list[_Request | None], target: list[_Request]) -> list[MovedRequest]:
    """Swaps that put ``target[i]`` at index i (the batch's reordering)."""
    moved: list[MovedRequest] = []
    where = {id(r): i for i, r in enumerate(rows)}
    for i, request in enumerate(target):
        j = where[id(request)]
        if j != i:
            other = rows[i]
            rows[i], rows[j] = request, other
            where[id(request)] = i
            if other is not None:
                where[id(other)] = j
            moved.append((i, j, MoveDirectionality.SWAP))
    return moved
