"""SamplingState: the persistent per-slot sampling parameters and token history (P3 inputs).

A request keeps its slot from ``add_request`` to ``remove_request``; per-slot tensors are
written once on add and read by gathering the batch's slots each step (vLLM's persistent batch).

Memory, for R slots and vocabulary V (R=256, V=152k in brackets):
- output token counts: int16 [R, V] (78 MB). int16 rather than int32 halves it; counts saturate
  near 32k (a token generated that often is penalised out of reach anyway). uint8 would saturate
  at 255, which changes small frequency penalties on long outputs, so it is not used.
- prompt tokens, allowed tokens, stop tokens: packed bitmasks int32 [R, ceil(V/32)] (4.9 MB each)
  instead of bool rows (39 MB each); unpacked only for the rows and steps that need them.
- logit_bias: padded ids/values [R, B] with B the largest bias dict seen (padding adds 0.0).
Counts and the output history are only maintained for slots that need them (penalties, bad
words); other slots' rows are left stale and cleared when the slot is reused.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trillm.sample.bad_words import BadWords
from trillm.sample.bitmask import num_words, pack_token_ids
from trillm.sample.custom_batch import CustomLogitsProcessors
from trillm.sample.thinking_budget import ThinkingBudgets
from trillm.sampling_params import SamplingParams

_COUNT_DTYPE = torch.int16
_COUNT_MAX = torch.iinfo(_COUNT_DTYPE).max

# Feature name -> the slots whose request uses it; flags are derived from these sets.
_FEATURES = (
    "random",
    "seeded",
    "top_k",
    "top_p",
    "min_p",
    "penalties",
    "repetition",
    "min_tokens",
    "logit_bias",
    "allowed",
    "bad_words",
)


class SlotError(ValueError):
    """A slot is out of range, already taken (add) or empty (remove / append)."""


class SamplingState:
    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device | str) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        r, v, w = max_num_reqs, vocab_size, num_words(vocab_size)
        f32, i64, i32 = torch.float32, torch.long, torch.int32
        self.temperature = self._full((r,), 1.0, f32)  # [R], 0 = greedy
        self.top_k = self._full((r,), v, i64)  # [R], >= V = disabled
        self.top_p = self._full((r,), 1.0, f32)  # [R]
        self.min_p = self._full((r,), 0.0, f32)  # [R]
        self.presence_penalty = self._full((r,), 0.0, f32)  # [R]
        self.frequency_penalty = self._full((r,), 0.0, f32)  # [R]
        self.repetition_penalty = self._full((r,), 1.0, f32)  # [R]
        self.min_tokens = self._full((r,), 0, i64)  # [R]
        self.num_output = self._full((r,), 0, i64)  # [R] output tokens so far
        self.output_counts = self._full((r, v), 0, _COUNT_DTYPE)  # [R, V]
        self.prompt_bits = self._full((r, w), 0, i32)  # [R, W] tokens in the prompt
        self.allowed_bits = self._full((r, w), -1, i32)  # [R, W] all ones = all allowed
        self.stop_bits = self._full((r, w), 0, i32)  # [R, W] tokens min_tokens suppresses
        self.bias_ids = self._full((r, 0), 0, i64)  # [R, B]
        self.bias_values = self._full((r, 0), 0.0, f32)  # [R, B], 0.0 in the padding
        # Host side.
        self._num_output: list[int] = [0] * r
        self._seeds: dict[int, int] = {}  # slot -> seed (random rows only)
        self._num_logprobs: dict[int, int] = {}  # slot -> k (requests that asked)
        self._chosen_ids: dict[int, list[int]] = {}  # slot -> its logprob_token_ids
        self.thinking = ThinkingBudgets()  # thinking_token_budget requests
        self._top_k: dict[int, int] = {}  # slot -> enabled k
        self._min_tokens: dict[int, int] = {}  # slot -> min_tokens, until reached
        self._bad_words: dict[int, BadWords] = {}
        self._history: dict[int, list[int]] = {}  # slot -> output ids (bad-words slots only)
        self._occupied: set[int] = set()
        self._slots_with: dict[str, set[int]] = {name: set() for name in _FEATURES}
        # --logits-processors: told of every request and token (set by the model runner)
        self.custom: CustomLogitsProcessors | None = None

    def _full(self, shape: tuple[int, ...], value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.full(shape, value, dtype=dtype, device=self.device)

    # ------------------------------------------------------------------ flags

    @property
    def num_active(self) -> int:
        return len(self._occupied)

    @property
    def all_greedy(self) -> bool:
        return not self._slots_with["random"]

    @property
    def all_random(self) -> bool:
        return len(self._slots_with["random"]) == len(self._occupied)

    @property
    def any_seeded(self) -> bool:
        return bool(self._slots_with["seeded"])

    @property
    def any_top_k(self) -> bool:
        return bool(self._slots_with["top_k"])

    @property
    def max_top_k(self) -> int:
        """The largest enabled top_k (call only when ``any_top_k``)."""
        return max(self._top_k.values())

    @property
    def any_top_p(self) -> bool:
        return bool(self._slots_with["top_p"])

    @property
    def any_min_p(self) -> bool:
        return bool(self._slots_with["min_p"])

    @property
    def any_penalties(self) -> bool:
        return bool(self._slots_with["penalties"])

    @property
    def any_repetition_penalty(self) -> bool:
        return bool(self._slots_with["repetition"])

    @property
    def any_min_tokens(self) -> bool:
        return bool(self._slots_with["min_tokens"])

    @property
    def any_logit_bias(self) -> bool:
        return bool(self._slots_with["logit_bias"])

    @property
    def any_allowed_token_ids(self) -> bool:
        return bool(self._slots_with["allowed"])

    @property
    def any_bad_words(self) -> bool:
        return bool(self._slots_with["bad_words"])

    @property
    def max_num_logprobs(self) -> int | None:
        """The largest ``logprobs`` among active requests; None when none asked."""
        return max(self._num_logprobs.values()) if self._num_logprobs else None

    def has_request(self, slot: int) -> bool:
        return slot in self._occupied

    def num_output_tokens(self, slot: int) -> int:
        return self._num_output[slot]

    def seed(self, slot: int) -> int | None:
        """The seed of a seeded random request in ``slot``; None otherwise."""
        return self._seeds.get(slot)

    # ------------------------------------------------------------------ add / remove

    def add_request(
        self,
        slot: int,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
    ) -> None:
        """Claims ``slot``; ``output_token_ids`` are tokens generated before a preemption."""
        self._check_slot(slot)
        if slot in self._occupied:
            raise SlotError(f"slot {slot} is already taken; remove_request it first.")
        self._occupied.add(slot)
        self._set_scalars(slot, params)
        self._set_features(slot, params)
        self._set_token_sets(slot, params, prompt_token_ids)
        self._set_logit_bias(slot, params.logit_bias or {})
        self._num_output[slot] = 0
        self.num_output[slot] = 0
        if self.custom is not None:  # before append_tokens fills its output list
            self.custom.add_request(slot, params, prompt_token_ids)
        self.thinking.add(slot, params, prompt_token_ids)
        if slot in self._slots_with["penalties"]:
            self.output_counts[slot].zero_()
        if output_token_ids:
            n = len(output_token_ids)
            self.append_tokens([slot] * n, list(output_token_ids))

    def holds(self, slot: int) -> bool:
        return slot in self._occupied

    def remove_request(self, slot: int) -> None:
        self._check_slot(slot)
        if slot not in self._occupied:
            raise SlotError(f"slot {slot} holds no request.")
        self._occupied.discard(slot)
        for slots in self._slots_with.values():
            slots.discard(slot)
        for per_slot in (self._seeds, self._num_logprobs, self._top_k, self._min_tokens):
            per_slot.pop(slot, None)
        self._chosen_ids.pop(slot, None)
        self.thinking.remove(slot)
        self._bad_words.pop(slot, None)
        self._history.pop(slot, None)
        if self.custom is not None:
            self.custom.remove_request(slot)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_num_reqs:
            raise SlotError(f"slot {slot} is outside [0, {self.max_num_reqs}).")

    def _set_scalars(self, slot: int, params: SamplingParams) -> None:
        top_k = params.top_k if 0 < params.top_k < self.vocab_size else self.vocab_size
        self.temperature[slot] = params.temperature
        self.top_k[slot] = top_k
        self.top_p[slot] = params.top_p
        self.min_p[slot] = params.min_p
        self.presence_penalty[slot] = params.presence_penalty
        self.frequency_penalty[slot] = params.frequency_penalty
        self.repetition_penalty[slot] = params.repetition_penalty
        self.min_tokens[slot] = params.min_tokens

    def _set_features(self, slot: int, params: SamplingParams) -> None:
        on = self._slots_with
        if not params.greedy:
            on["random"].add(slot)
            if params.seed is not None:
                on["seeded"].add(slot)
                self._seeds[slot] = params.seed
            if 0 < params.top_k < self.vocab_size:
                on["top_k"].add(slot)
                self._top_k[slot] = params.top_k
            if params.top_p < 1.0:
                on["top_p"].add(slot)
            if params.min_p > 0.0:
                on["min_p"].add(slot)
        if params.repetition_penalty != 1.0:
            on["repetition"].add(slot)
        if (
            params.repetition_penalty != 1.0
            or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
        ):
            on["penalties"].add(slot)
        if params.min_tokens > 0 and params.all_stop_token_ids:
            on["min_tokens"].add(slot)
            self._min_tokens[slot] = params.min_tokens
        if params.logit_bias:
            on["logit_bias"].add(slot)
        if params.allowed_token_ids:
            on["allowed"].add(slot)
        if params.bad_words_token_ids:
            on["bad_words"].add(slot)
            self._bad_words[slot] = BadWords(params.bad_words_token_ids)
            self._history[slot] = []
        if params.logprobs is not None:
            self._num_logprobs[slot] = params.logprobs
        if params.logprob_token_ids:
            self._chosen_ids[slot] = list(params.logprob_token_ids)

    def _set_token_sets(
        self, slot: int, params: SamplingParams, prompt_token_ids: Sequence[int]
    ) -> None:
        v = self.vocab_size
        self.prompt_bits[slot] = self._packed(
            prompt_token_ids if slot in self._slots_with["repetition"] else ()
        )
        if params.allowed_token_ids:
            self.allowed_bits[slot] = self._packed(params.allowed_token_ids)
        else:
            self.allowed_bits[slot] = -1
        stop_ids = params.all_stop_token_ids if slot in self._slots_with["min_tokens"] else ()
        self.stop_bits[slot] = self._packed([t for t in stop_ids if 0 <= t < v])

    def _packed(self, token_ids: Sequence[int]) -> torch.Tensor:
        return torch.from_numpy(pack_token_ids(token_ids, self.vocab_size)).to(self.device)

    def _set_logit_bias(self, slot: int, bias: dict[int, float]) -> None:
        if len(bias) > self.bias_ids.shape[1]:
            self._grow_bias(len(bias))
        self.bias_ids[slot] = 0
        self.bias_values[slot] = 0.0
        if bias:
            n = len(bias)
            self.bias_ids[slot, :n] = torch.tensor(list(bias.keys()), dtype=torch.long)
            self.bias_values[slot, :n] = torch.tensor(list(bias.values()), dtype=torch.float32)

    def _grow_bias(self, needed: int) -> None:
        width = 1 << (needed - 1).bit_length()  # next power of two
        pad = width - self.bias_ids.shape[1]
        self.bias_ids = torch.nn.functional.pad(self.bias_ids, (0, pad))
        self.bias_values = torch.nn.functional.pad(self.bias_values, (0, pad))

    # ------------------------------------------------------------------ token history

    def append_token(self, slot: int, token_id: int) -> None:
        self.append_tokens([slot], [token_id])

    def append_tokens(
        self, slots: torch.Tensor | Sequence[int], tokens: torch.Tensor | Sequence[int]
    ) -> None:
        """Records sampled tokens: slots [n], tokens [n] (a slot may repeat, in order).

        The slots are read on the host (one small copy if they live on the device); the tokens
        only when a bad-words request is among them, and stay on the device otherwise.
        """
        slot_list = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
        if not slot_list:
            return
        for slot in slot_list:
            if slot not in self._occupied:
                raise SlotError(f"slot {slot} holds no request.")
        slot_t = torch.as_tensor(slot_list, dtype=torch.long).to(self.device, non_blocking=True)
        token_t = torch.as_tensor(tokens, dtype=torch.long).to(self.device, non_blocking=True)
        self.num_output.index_add_(0, slot_t, torch.ones_like(slot_t))
        if self.any_penalties:
            self._count_tokens(slot_t, token_t)
        self._update_host(slot_list, tokens)

    def _count_tokens(self, slot_t: torch.Tensor, token_t: torch.Tensor) -> None:
        # NOTE: saturating increment without a host sync: entries within len(slots) of the
        # int16 maximum stop growing, so repeated (slot, token) pairs cannot overflow.
        limit = _COUNT_MAX - slot_t.numel()
        current = self.output_counts[slot_t, token_t]
        increment = (current < limit).to(_COUNT_DTYPE)
        self.output_counts.index_put_((slot_t, token_t), increment, accumulate=True)

    def _update_host(self, slot_list: list[int], tokens) -> None:
        for slot in slot_list:
            self._num_output[slot] += 1
        if self.custom is not None or self.thinking:
            token_list = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
            if self.custom is not None:
                self.custom.append_tokens(slot_list, token_list)
            self.thinking.append_tokens(slot_list, token_list)
        for slot in self._min_tokens.keys() & set(slot_list):
            if self._num_output[slot] >= self._min_tokens[slot]:
                del self._min_tokens[slot]
                self._slots_with["min_tokens"].discard(slot)
        if self._history and any(slot in self._history for slot in slot_list):
            token_list = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
            for slot, token in zip(slot_list, token_list):
                history = self._history.get(slot)
                if history is not None:
                    history.append(int(token))

    # ------------------------------------------------------------------ host-side helpers

    def banned_words(self, slot_list: Sequence[int]) -> tuple[list[int], list[int]]:
        """(rows, token ids) to ban this step for the bad-words requests among the batch rows."""
        rows: list[int] = []
        tokens: list[int] = []
        for row, slot in enumerate(slot_list):
            bad_words = self._bad_words.get(slot)
            if bad_words is None:
                continue
            for token in bad_words.banned(self._history[slot]):
                rows.append(row)
                tokens.append(token)
        return rows, tokens

    def chosen_logprob_ids(self, slot_list: Sequence[int]) -> dict[int, list[int]]:
        """Batch row -> its request's logprob_token_ids, for the rows that have them."""
        chosen = self._chosen_ids
        if not chosen:
            return {}
        return {row: chosen[slot] for row, slot in enumerate(slot_list) if slot in chosen}

    def seeded_rows(
        self, slot_list: Sequence[int], offsets: Sequence[int] | None = None
    ) -> tuple[list[int], list[int], list[int]]:
        """(rows, seeds, steps) of the seeded random requests among the batch rows; a row's
        step is its slot's output count plus its offset (a drafted position's)."""
        rows, seeds, steps = [], [], []
        for row, slot in enumerate(slot_list):
            seed = self._seeds.get(slot)
            if seed is not None:
                rows.append(row)
                seeds.append(seed)
                steps.append(self._num_output[slot] + (offsets[row] if offsets is not None else 0))
        return rows, seeds, steps
