"""The model runner's longrope state (Phi-3.5 / Phi-4-mini): which table each token rotates
by, and the step at which a request crosses the original context.

A longrope model keeps a short and a long cos|sin table (``layers/rotary.py``); a token uses
the long one iff its request is longer than ``original_max_position_embeddings`` (its known
tokens, or ``p + 1`` at position p), as transformers picks per forward. A request whose cached
tokens were computed on the short table and that grows past the original context is computed
again from position 0 in that step, on the long table: transformers' Phi-3 ``generate`` drops
its cache there. Its K/V blocks are written again in place, so they must be its own: the
engine keeps prefix caching off for longrope models (``engine/config_builder.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from trillm.model_executor.layers.rotary import LongRopeIndex

if TYPE_CHECKING:
    from trillm.worker.input_batch import InputBatch, StepInputs


class LongRopeState:
    def __init__(self, index: LongRopeIndex, max_num_reqs: int) -> None:
        self.index = index
        # Per batch slot: its cached K/V were computed on the long table.
        self.long = np.zeros(max_num_reqs, dtype=bool)

    def reset(self, slot: int) -> None:
        """A request (re)enters a slot: nothing of it computed by this runner yet."""
        self.long[slot] = False

    def switch(
        self,
        slots: np.ndarray,  # [R] the step's requests' batch slots
        num_tokens: np.ndarray,  # [R] their known tokens (prompt + outputs)
        num_computed: np.ndarray,  # [R] their tokens already in the cache
        num_scheduled: np.ndarray,  # [R] their tokens this step computes
    ) -> np.ndarray:  # [R] bool: computed again from position 0 this step
        """Which requests cross to the long table this step with short-table K/V cached: the
        caller widens their step to their cached tokens too and sets them uncomputed."""
        long = self.index.is_long(num_tokens, num_computed + num_scheduled)
        recomputed: np.ndarray = long & ~self.long[slots] & (num_computed > 0)
        self.long[slots] = long
        return recomputed

    def rope_positions(
        self,
        positions: np.ndarray,  # [T] int64
        num_tokens: np.ndarray,  # [T] int64: each token's request's known tokens
    ) -> np.ndarray:  # [T] int64: rows of the [short; long] table
        return self.index.rope_positions(positions, num_tokens)

    def widen_step(
        self, batch: InputBatch, slots: np.ndarray, num_scheduled: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The step's token counts with the requests crossing to the long table this step
        widened to their cached tokens (and set uncomputed in ``batch``), and which they are."""
        computed = batch.num_computed[slots]
        recomputed = self.switch(slots, batch.num_tokens[slots], computed, num_scheduled)
        if not recomputed.any():
            return num_scheduled, recomputed
        batch.num_computed[slots[recomputed]] = 0
        return num_scheduled + computed * recomputed, recomputed

    def batch_rope_positions(self, batch: InputBatch, inputs: StepInputs) -> np.ndarray:
        """Each of the step's tokens' row in the [short; long] table, by its request's length."""
        num_tokens = np.repeat(batch.num_tokens[inputs.slots], np.diff(inputs.query_start_loc))
        return self.rope_positions(inputs.positions, num_tokens)
