"""The worker's multimodal inputs: each batch slot's items (``NewRequestData.mm_items``) and
the encoder's outputs, cached by content hash as the scheduler's encoder cache says.

An item is encoded (``model.encode_image``: vision tower + projector) by the first step whose
tokens reach it (``encode_step``; an item the encoder refuses fails that request alone), once
however many chunks its prefill takes and however many requests hold the same image; each
step then gets the rows its tokens cover (``step_embeddings``), which the model writes over
the placeholders' token embeddings. An output stays cached after its requests end, until the
scheduler evicts it (``SchedulerOutput.free_encoder_mm_hashes``; ``core/encoder_cache.py``
bounds the rows and the encoder work per step): an item needed again after that is encoded
again. With pipeline parallelism only the first stage, which holds the tower and the token
embeddings, encodes (``encodes``); the later stages keep the items for their positions.

Prompt embeddings (``--enable-prompt-embeds``) are one item of modality ``prompt_embeds``
over the whole prompt whose rows are written as given: no encoder runs.

M-RoPE models (Qwen2-VL: the model's ``mrope_merge_size``) rotate by [3, T] positions
(``rope_positions``, ``mrope.py``): computed per step from each request's items, so chunked
prefill, preemption (a re-sent request's items come again) and decoding need no other state.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from trillm.messages import PROMPT_EMBEDS_MODALITY as PROMPT_EMBEDS
from trillm.messages import MultiModalItem, SchedulerOutput
from trillm.worker.input_batch import InputBatch, StepInputs
from trillm.worker.mrope_positions import mrope_positions

logger = logging.getLogger(__name__)


class MultiModalInputs:
    def __init__(self, model: Any, device: torch.device, encodes: bool = True) -> None:
        self.model = model
        self.device = device
        self.encodes = encodes  # False on a pipeline stage after the first
        self._items: dict[int, list[MultiModalItem]] = {}  # slot -> its items
        self._given: dict[int, dict[int, torch.Tensor]] = {}  # slot -> offset -> prompt embeds
        self._cache: dict[str, torch.Tensor] = {}  # content hash -> [length, H]
        self.encoder_calls = 0
        # An M-RoPE model's spatial merge (None: the model rotates by plain positions)
        self.mrope_merge: int | None = getattr(model, "mrope_merge_size", None)
        # Whether an image's tokens attend to each other both ways (Gemma 3)
        self.bidirectional = bool(getattr(model, "bidirectional_image_spans", False))

    @classmethod
    def for_model(
        cls, model: Any, device: torch.device, prompt_embeds: bool = False, encodes: bool = True
    ) -> MultiModalInputs | None:
        """None for a text model, unless it takes prompt embeddings (--enable-prompt-embeds)."""
        takes = hasattr(model, "encode_image") or hasattr(model, "encode_audio")
        return cls(model, device, encodes) if takes or prompt_embeds else None

    def add(self, slot: int, items: list[MultiModalItem]) -> None:
        """A new request's items (encoded by the steps that reach them)."""
        for item in items:  # the model's encoder of each: encode_image, encode_audio
            if item.modality != PROMPT_EMBEDS and not hasattr(
                self.model, f"encode_{item.modality}"
            ):
                raise ValueError(f"{item.modality} inputs are not implemented for this model.")
        given = {m.offset: _values(m, self.device) for m in items if m.modality == PROMPT_EMBEDS}
        if given and self.encodes:
            self._given[slot] = given
        if items:
            self._items[slot] = items

    def drop(self, slot: int) -> None:
        self._items.pop(slot, None)
        self._given.pop(slot, None)

    def evict(self, content_hashes: list[str]) -> None:
        for content_hash in content_hashes:
            self._cache.pop(content_hash, None)

    def encode_chunk(self, slot: int, first: int, count: int) -> None:
        """Encodes the items that positions [first, first + count) of ``slot`` reach and the
        cache lacks."""
        for item in self._items.get(slot, ()):
            reached = item.offset < first + count and first < item.offset + item.length
            if reached and item.modality != PROMPT_EMBEDS and item.content_hash not in self._cache:
                self._cache[item.content_hash] = self._encode(item)

    def _encode(self, item: MultiModalItem) -> torch.Tensor:  # [length, H]
        rows = getattr(self.model, f"encode_{item.modality}")(_values(item, self.device))
        self.encoder_calls += 1
        if rows.shape[0] != item.length:
            raise ValueError(
                f"The {item.modality} has {rows.shape[0]} feature rows for "
                f"{item.length} placeholder tokens."
            )
        return rows

    def _rows(self, slot: int, item: MultiModalItem) -> torch.Tensor:  # [length, H]
        if item.modality == PROMPT_EMBEDS:
            return self._given[slot][item.offset]
        return self._cache[item.content_hash]

    def step_embeddings(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the step's rows inside placeholder ranges, their embeddings) or None."""
        if not self._items or not self.encodes:
            return None
        rows: list[np.ndarray] = []
        parts: list[torch.Tensor] = []
        starts = inputs.query_start_loc
        for i, slot in enumerate(inputs.slots.tolist()):
            items = self._items.get(slot)
            if not items:
                continue
            start, end = int(starts[i]), int(starts[i + 1])
            first = int(inputs.positions[start])  # the step's first position of this request
            for item in items:
                lo = max(first, item.offset)
                hi = min(first + end - start, item.offset + item.length)
                if lo < hi:
                    rows.append(np.arange(start + lo - first, start + hi - first))
                    parts.append(self._rows(slot, item)[lo - item.offset : hi - item.offset])
        if not rows:
            return None
        return torch.from_numpy(np.concatenate(rows)).to(self.device), torch.cat(parts)

    def bidirectional_spans(self, inputs: StepInputs) -> list[list[tuple[int, int]]] | None:
        """Per request of the step, its images' position ranges, for a model whose image
        tokens attend both ways; None when no row of the step is an image token (the
        attention keeps its causal fast paths). The scheduler keeps a span in one chunk."""
        if not self.bidirectional or not self._items:
            return None
        out: list[list[tuple[int, int]]] = []
        inside = False
        starts = inputs.query_start_loc
        for i, slot in enumerate(inputs.slots.tolist()):
            first = int(inputs.positions[int(starts[i])])
            last = first + int(starts[i + 1]) - int(starts[i])  # one past the step's last
            spans = [(m.offset, m.offset + m.length) for m in self._items.get(slot, [])]
            inside = inside or any(a < last and first < b for a, b in spans)
            out.append(spans)
        return out if inside else None

    def rope_positions(self, inputs: StepInputs) -> np.ndarray:  # [T] or [3, T] int64
        """What the rotary embedding takes: the positions, or for M-RoPE each token's (time,
        row, column); a request without images has its position three times."""
        if self.mrope_merge is None:
            return inputs.positions
        out = np.repeat(inputs.positions[None], 3, axis=0)
        starts = inputs.query_start_loc
        for i, slot in enumerate(inputs.slots.tolist()):
            items = self._items.get(slot)
            if items:
                rows = slice(int(starts[i]), int(starts[i + 1]))
                out[:, rows] = mrope_positions(items, inputs.positions[rows], self.mrope_merge)
        return out


def add_items(mm: MultiModalInputs | None, slot: int, items: list[MultiModalItem]) -> None:
    """A new request's items into the batch; a model without an encoder refuses them."""
    if mm is not None:
        mm.add(slot, items)
    elif items:
        raise ValueError("This model takes no multimodal inputs.")


def _values(item: MultiModalItem, device: torch.device) -> torch.Tensor:
    """The item's processed tensor (pixels, features, or prompt embeddings)."""
    values = np.frombuffer(item.data, np.float32).reshape(item.shape).copy()
    return torch.from_numpy(values).to(device)


def encode_step(
    mm: MultiModalInputs | None, sched: SchedulerOutput, batch: InputBatch, failed: dict[str, str]
) -> dict[str, str]:
    """Drops what the scheduler evicted, then encodes what the step's requests reach ->
    the requests whose item the encoder refused (req_id -> why): only they fail."""
    if mm is None or not mm.encodes:
        return {}
    mm.evict(sched.free_encoder_mm_hashes)
    refused: dict[str, str] = {}
    for req_id, count in sched.num_scheduled_tokens.items():
        if req_id in failed:
            continue
        slot = batch.slot_of(req_id)
        try:
            mm.encode_chunk(slot, int(batch.num_computed[slot]), count)
        except Exception as exc:  # NOTE: one request's item, not the step's fault
            logger.warning("request %s: its item could not be encoded: %r", req_id, exc)
            refused[req_id] = f"{type(exc).__name__}: {exc}"
    return refused


def drop_items(mm: MultiModalInputs | None, slot: int | None) -> None:
    if mm is not None and slot is not None:
        mm.drop(slot)


def set_mm_rows(mm: MultiModalInputs | None, model: Any, inputs: StepInputs) -> bool:
    """Hands the model the step's image rows; -> whether the forward must run eager: there
    were rows to write, or the model rotates by M-RoPE positions (a step program replays
    token embeddings and [T] positions only)."""
    if mm is None:
        return False
    rows = mm.step_embeddings(inputs)
    model.set_step_embeddings(rows)  # None clears what a failed forward left
    return rows is not None or mm.mrope_merge is not None
