"""P3: turn the model's last-position logits into sampled tokens (stage 8 of the lifecycle).

Order, as vLLM's: structured-output bitmask -> allowed_token_ids -> bad words -> logit_bias ->
min_tokens -> custom logits processors that may change the argmax -> penalties -> (logprobs of
the raw logits) -> greedy argmax, or temperature -> min_p -> argmax-invariant custom ones ->
top_k -> top_p -> exponential-race sample. Everything is batched over the rows; the only
per-request host loops are the bad-words match and the seeded generators, and they only visit
requests that use them. Flags on ``SamplingState`` skip the stages no active request asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trillm.sample.bitmask import apply_bitmask, unpack_bitmask
from trillm.sample.logprobs import LogprobsTensors, compute_topk_logprobs, write_chosen_logprobs
from trillm.sample.penalties import apply_penalties
from trillm.sample.race import SeededNoise, exponential_race
from trillm.sample.state import SamplingState, SlotError
from trillm.sample.topk_topp import apply_min_p, apply_top_k, apply_top_k_top_p

__all__ = ["Sampler", "SamplerOutput", "SamplingState", "SlotError", "LogprobsTensors"]

_NEG_INF = float("-inf")


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # long [n]
    # Logprobs of the raw model logits: the sampled token then the top-k, where k is the largest
    # ``logprobs`` among the active requests; None when no active request asked.
    logprobs: LogprobsTensors | None


class _SlotList:
    """The batch's slots on the host, copied from the device at most once per step."""

    def __init__(self, slots: torch.Tensor) -> None:
        self._slots = slots
        self._list: list[int] | None = None

    def get(self) -> list[int]:
        if self._list is None:
            self._list = self._slots.tolist()
        return self._list


def _any_processor(state: SamplingState) -> bool:
    """Whether some row's logits are changed before sampling (``Sampler._process``)."""
    return (
        state.any_allowed_token_ids
        or state.any_bad_words
        or state.any_logit_bias
        or state.any_min_tokens
        or state.any_penalties
        or state.custom is not None
        or bool(state.thinking)
    )


class Sampler:
    def __init__(self) -> None:
        self._noise = SeededNoise()

    def __call__(
        self,
        logits: torch.Tensor,
        state: SamplingState,
        slots: torch.Tensor,
        bitmask: torch.Tensor | None = None,
        step_offsets: Sequence[int] | None = None,
    ) -> SamplerOutput:
        """logits: float32 [n, V] (not modified); slots: long [n], the state slot of each row
        (cheapest on the host); bitmask: int32 [n, ceil(V/32)] or None (all allowed);
        step_offsets: [n] or None, how many tokens past the slot's recorded outputs each row
        samples (speculative decoding verifies several positions of one slot: a seeded row
        then draws the noise of its own output position)."""
        slot_list = _SlotList(slots)
        slots = slots.to(device=logits.device, dtype=torch.long, non_blocking=True)
        # Greedy rows with no processor only read the logits: no copy (on CPU the copy also
        # wakes torch's idle threads, ~0.6 ms of a decode step).
        reads_only = bitmask is None and state.all_greedy and not _any_processor(state)
        owned = logits if reads_only else logits.clone()
        processed = self._process(owned, state, slots, slot_list, bitmask)  # [n, V]
        sampled = self._sample(processed, state, slots, slot_list, step_offsets)
        k = state.max_num_logprobs
        logprobs = None if k is None else compute_topk_logprobs(logits, sampled, k)
        if logprobs is not None and (chosen := state.chosen_logprob_ids(slot_list.get())):
            write_chosen_logprobs(logprobs, logits, chosen)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def process_logits(
        self,
        logits: torch.Tensor,
        state: SamplingState,
        slots: torch.Tensor,
        bitmask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The logits after every processor, before temperature: what greedy rows argmax."""
        slot_list = _SlotList(slots)
        slots = slots.to(device=logits.device, dtype=torch.long, non_blocking=True)
        return self._process(logits.clone(), state, slots, slot_list, bitmask)

    # ------------------------------------------------------------------ logits processing

    def _process(
        self,
        logits: torch.Tensor,  # [n, V], owned: modified in place
        state: SamplingState,
        slots: torch.Tensor,
        slot_list: _SlotList,
        bitmask: torch.Tensor | None,
    ) -> torch.Tensor:
        # NOTE: a processor added here belongs in _any_processor too (greedy rows with none
        # pass the caller's logits in without a copy).
        if bitmask is not None:
            apply_bitmask(logits, bitmask)
        if state.any_allowed_token_ids:
            apply_bitmask(logits, state.allowed_bits[slots])
        if state.any_bad_words:
            _ban_bad_words(logits, state, slot_list.get())
        if state.any_logit_bias:
            logits.scatter_add_(1, state.bias_ids[slots], state.bias_values[slots])
        if state.any_min_tokens:
            _suppress_stop_tokens(logits, state, slots)
        if state.custom is not None:  # --logits-processors, vLLM's place for them
            logits = state.custom.apply_argmax_changing(logits, slot_list.get())
        if state.any_penalties:
            logits = _penalise(logits, state, slots)
        if state.thinking:  # last: a spent thinking budget overrides every other processor
            _force_tokens(logits, *state.thinking.forced_rows(slot_list.get()))
        return logits

    # ------------------------------------------------------------------ sampling

    def _sample(
        self,
        logits: torch.Tensor,  # [n, V] processed
        state: SamplingState,
        slots: torch.Tensor,
        slot_list: _SlotList,
        step_offsets: Sequence[int] | None = None,
    ) -> torch.Tensor:
        if state.all_greedy:
            return row_argmax(logits)  # [n]
        greedy = None if state.all_random else row_argmax(logits)  # [n]
        temperature = state.temperature[slots]  # [n], 0 on greedy rows
        is_greedy = temperature == 0.0
        logits.div_(torch.where(is_greedy, 1.0, temperature).unsqueeze(1))
        probs = self._filtered_probs(logits, state, slots)
        rows, seeds, steps = (
            state.seeded_rows(slot_list.get(), step_offsets) if state.any_seeded else ((), (), ())
        )
        random = exponential_race(probs, self._noise.draw(probs, rows, seeds, steps))
        if greedy is None:
            return random
        return torch.where(is_greedy, greedy, random)

    def _filtered_probs(
        self, logits: torch.Tensor, state: SamplingState, slots: torch.Tensor
    ) -> torch.Tensor:
        if state.any_min_p:
            apply_min_p(logits, state.min_p[slots])
        if state.custom is not None:  # the argmax-invariant ones: after min_p, as vLLM
            logits = state.custom.apply_argmax_invariant(logits)
        if state.any_top_p:
            top_k = state.top_k[slots] if state.any_top_k else None
            logits = apply_top_k_top_p(logits, top_k, state.top_p[slots])
        elif state.any_top_k:
            apply_top_k(logits, state.top_k[slots], state.max_top_k)
        return torch.softmax(logits, dim=-1)


def _ban_bad_words(logits: torch.Tensor, state: SamplingState, slot_list: list[int]) -> None:
    rows, tokens = state.banned_words(slot_list)
    if rows:
        row_t = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
        token_t = torch.tensor(tokens, dtype=torch.long).to(logits.device, non_blocking=True)
        logits.index_put_((row_t, token_t), torch.tensor(_NEG_INF, device=logits.device))


def _force_tokens(logits: torch.Tensor, rows: list[int], tokens: list[int]) -> None:
    """Each row in ``rows`` keeps only its token (vLLM's thinking budget forcing the end of
    reasoning): the others -inf, so greedy and random sampling both pick it."""
    if not rows:
        return
    row_t = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
    token_t = torch.tensor(tokens, dtype=torch.long).to(logits.device, non_blocking=True)
    logits[row_t] = _NEG_INF
    logits[row_t, token_t] = 0.0


def _suppress_stop_tokens(logits: torch.Tensor, state: SamplingState, slots: torch.Tensor):
    """EOS and stop_token_ids -> -inf on rows that have not yet produced min_tokens."""
    below = state.num_output[slots] < state.min_tokens[slots]  # [n]
    stop = unpack_bitmask(state.stop_bits[slots], logits.shape[1])  # [n, V]
    logits.masked_fill_(stop & below.unsqueeze(1), _NEG_INF)


def _penalise(logits: torch.Tensor, state: SamplingState, slots: torch.Tensor) -> torch.Tensor:
    prompt_mask = None
    if state.any_repetition_penalty:
        prompt_mask = unpack_bitmask(state.prompt_bits[slots], logits.shape[1])
    return apply_penalties(
        logits,
        state.output_counts[slots],
        prompt_mask,
        state.repetition_penalty[slots],
        state.frequency_penalty[slots],
        state.presence_penalty[slots],
    )


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1): each row's first maximum, a NaN counting as the maximum (torch's
    and numpy's rule alike). A CPU float32 tensor goes through numpy's argmax: one thread, SIMD,
    no wake-up of torch's thread pool, whose threads then spin against the engine's kernels:
    SmolLM2-135M's 16 x 49,152 logits (a concurrency-16 decode step) in 0.06-0.08 ms against
    1.3 ms (torch, 1 thread) or 1.9-4.0 ms of CPU (torch's 2 threads, a busy host)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2:
        return logits.argmax(dim=-1)
    return torch.from_numpy(logits.numpy().argmax(axis=-1).astype("int64", copy=False))
