"""The scheduler's encoder budget and encoder cache, in encoder output rows (tokens), as vLLM's
``max_num_encoder_input_tokens`` and ``EncoderCacheManager``.

Each step may encode up to ``compute_budget`` rows of multimodal items; the worker's cache of
encoder outputs (keyed by the item's content hash) holds up to ``cache_size`` rows. Both are
``max_num_batched_tokens``, as vLLM derives them; an item larger than either is encoded in a
step of its own, into an otherwise empty cache (vLLM raises both to the largest item).

A chunk that reaches an item the step cannot encode (its budget is spent, or the cache's rows
are held by running requests) ends at the item's start: the text before it is computed, the
item waits for a later step. An entry is held while a request whose prefill has not passed
the item needs it; one nobody holds stays cached (a later request, or the same one after a
preemption, reuses it) until an item that needs its rows evicts it, oldest first. The worker
encodes what its step needs and is not cached, and drops what the scheduler evicted
(``SchedulerOutput.free_encoder_mm_hashes``): both sides hold the same entries.

Both scheduler twins (``scheduler.py``, ``ext/scheduler.pyx``) call this one object; prompt
embeddings run no encoder and are not counted.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

from trillm.messages import PROMPT_EMBEDS_MODALITY, MultiModalItem

if TYPE_CHECKING:
    from trillm.config import TrillmConfig

logger = logging.getLogger(__name__)

# Bytes of one element of the model's dtype, for the start-up log line.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class EncoderCache:
    def __init__(self, cache_size: int, compute_budget: int) -> None:
        self.cache_size = cache_size
        self.compute_budget = compute_budget
        self.num_free = cache_size  # rows no entry takes (< 0 only for an oversized item)
        # req_id -> its encoder items in prompt order: (content hash, offset, rows)
        self._items: dict[str, list[tuple[str, int, int]]] = {}
        self._rows: dict[str, int] = {}  # content hash -> rows of its cached output
        self._holders: dict[str, set[str]] = {}  # content hash -> requests that need it
        self._freeable: OrderedDict[str, None] = OrderedDict()  # held by none, oldest first
        self._evicted: list[str] = []  # since the last step's output
        self._step_left = compute_budget
        # This step's changes per request, undone when it is not scheduled after all:
        # the entries it added (to encode) and the holds it took.
        self._step_added: dict[str, list[str]] = {}
        self._step_held: dict[str, list[str]] = {}

    # ------------------------------------------------------------------ requests

    def add_request(self, req_id: str, items: list[MultiModalItem]) -> None:
        encoded = [
            (m.content_hash, m.offset, m.length)
            for m in items
            if m.modality != PROMPT_EMBEDS_MODALITY
        ]
        if encoded:
            self._items[req_id] = encoded

    def free_request(self, req_id: str) -> None:
        """A finished or preempted request holds nothing (its entries stay cached)."""
        for content_hash, _, _ in self._items.get(req_id, ()):
            self._release(req_id, content_hash)

    def remove_request(self, req_id: str) -> None:
        self.free_request(req_id)
        self._items.pop(req_id, None)

    # ------------------------------------------------------------------ one step

    def new_step(self) -> None:
        self._step_left = self.compute_budget

    def cut(self, req_id: str, num_computed: int, n: int) -> int:
        """The tokens of a chunk of ``n`` from ``num_computed`` that this step can give
        ``req_id``: the chunk ends at the start of the first item it cannot encode. The items
        the chunk reaches are held (and counted, when they must be encoded)."""
        items = self._items.get(req_id)
        if items is None:
            return n
        end = num_computed + n
        for content_hash, offset, rows in items:
            if offset >= end:
                break
            if offset + rows <= num_computed:  # the decoder has taken all its rows
                self._release(req_id, content_hash)
            elif content_hash in self._rows:
                self._hold(req_id, content_hash)
            elif self._can_encode(rows):
                self._encode(req_id, content_hash, rows)
            else:
                return max(0, offset - num_computed)
        return n

    def unschedule(self, req_id: str) -> None:
        """``req_id`` takes no tokens this step after all: its holds and entries of this step
        go (an entry another request took meanwhile stays, for that one)."""
        for content_hash in self._step_held.pop(req_id, ()):
            self._release(req_id, content_hash)
        for content_hash in self._step_added.pop(req_id, ()):
            self._release(req_id, content_hash)
            if content_hash in self._freeable:  # never encoded: nothing to evict in the worker
                del self._freeable[content_hash]
                del self._holders[content_hash]
                rows = self._rows.pop(content_hash)
                self.num_free += rows
                self._step_left += rows

    def end_step(self) -> list[str]:
        """-> the hashes evicted since the last step, for the worker; this step's changes
        are final (a preemption between steps keeps what the step encoded)."""
        self._step_added.clear()
        self._step_held.clear()
        evicted, self._evicted = self._evicted, []
        return evicted

    # ------------------------------------------------------------------ entries

    def _can_encode(self, rows: int) -> bool:
        """Within this step's budget (an item over the whole budget: alone in its step) and
        with rows the cache has free or can free."""
        if rows > self._step_left and self._step_left < self.compute_budget:
            return False
        held = self.num_held_rows
        if rows > self.cache_size - held and held > 0:
            return False
        while self.num_free < rows and self._freeable:
            self._evict(next(iter(self._freeable)))
        return True

    def _encode(self, req_id: str, content_hash: str, rows: int) -> None:
        self._rows[content_hash] = rows
        self._holders[content_hash] = {req_id}
        self.num_free -= rows
        self._step_left -= rows
        self._step_added.setdefault(req_id, []).append(content_hash)

    def _hold(self, req_id: str, content_hash: str) -> None:
        holders = self._holders[content_hash]
        if req_id not in holders:
            holders.add(req_id)
            self._freeable.pop(content_hash, None)
            self._step_held.setdefault(req_id, []).append(content_hash)

    def _release(self, req_id: str, content_hash: str) -> None:
        holders = self._holders.get(content_hash)
        if holders is not None and req_id in holders:
            holders.discard(req_id)
            if not holders:
                self._freeable[content_hash] = None

    def _evict(self, content_hash: str) -> None:
        del self._freeable[content_hash]
        del self._holders[content_hash]
        self.num_free += self._rows.pop(content_hash)
        self._evicted.append(content_hash)

    # ------------------------------------------------------------------ stats

    @property
    def num_cached_rows(self) -> int:
        return self.cache_size - self.num_free

    @property
    def num_held_rows(self) -> int:
        """The rows of entries some request still needs (never evicted)."""
        return self.num_cached_rows - sum(self._rows[h] for h in self._freeable)


def encoder_cache_for(config: TrillmConfig) -> EncoderCache | None:
    """A multimodal model's encoder cache and budget (None for a text model), said once in
    the log in rows and bytes."""
    model = config.model
    if model.mm_config is None:
        return None
    budget = config.scheduler.max_num_batched_tokens
    row_bytes = model.hidden_size * DTYPE_BYTES.get(model.dtype, 4)
    logger.info(
        "encoder cache: %d tokens (%.1f MiB of %s rows of %d values); encoder budget: %d "
        "tokens per step (max_num_batched_tokens; a larger item is encoded alone)",
        budget,
        budget * row_bytes / 2**20,
        model.dtype,
        model.hidden_size,
        budget,
    )
    return EncoderCache(budget, budget)
