"""The worker's multimodal inputs: each batch slot's items (``NewRequestData.mm_items``) and
the encoder's outputs, cached by content hash while a request holding the item lives.

An item is encoded (``model.encode_image``: vision tower + projector) when its request joins
the batch (so an item the encoder refuses fails that request alone), once however many
chunks its prefill takes and however many requests hold the same image; each step then gets
the rows its tokens cover (``step_embeddings``), which the model writes over the
placeholders' token embeddings.

Prompt embeddings (``--enable-prompt-embeds``) are one item of modality ``prompt_embeds``
over the whole prompt whose rows are written as given: no encoder runs.

M-RoPE models (Qwen2-VL: the model's ``mrope_merge_size``) rotate by [3, T] positions
(``rope_positions``, ``mrope.py``): computed per step from each request's items, so chunked
prefill, preemption (a re-sent request's items come again) and decoding need no other state.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import torch

from trillm.messages import PROMPT_EMBEDS_MODALITY as PROMPT_EMBEDS
from trillm.messages import MultiModalItem
from trillm.worker.input_batch import StepInputs
from trillm.worker.mrope_positions import mrope_positions


class MultiModalInputs:
    def __init__(self, model: Any, device: torch.device) -> None:
        self.model = model
        self.device = device
        self._items: dict[int, list[MultiModalItem]] = {}  # slot -> its items
        self._refs: Counter[str] = Counter()  # content hash -> slots holding it
        self._cache: dict[str, torch.Tensor] = {}  # content hash -> [length, H]
        self.encoder_calls = 0
        # An M-RoPE model's spatial merge (None: the model rotates by plain positions)
        self.mrope_merge: int | None = getattr(model, "mrope_merge_size", None)
        # Whether an image's tokens attend to each other both ways (Gemma 3)
        self.bidirectional = bool(getattr(model, "bidirectional_image_spans", False))

    @classmethod
    def for_model(
        cls, model: Any, device: torch.device, prompt_embeds: bool = False
    ) -> MultiModalInputs | None:
        """None for a text model, unless it takes prompt embeddings (--enable-prompt-embeds)."""
        takes = hasattr(model, "encode_image") or hasattr(model, "encode_audio")
        return cls(model, device) if takes or prompt_embeds else None

    def add(self, slot: int, items: list[MultiModalItem]) -> None:
        """A new request's items, encoded now (cache hits aside): an item the encoder cannot
        take fails its own request in ``_update_batch``, not the step."""
        for item in items:  # the model's encoder of each: encode_image, encode_audio
            if item.modality != PROMPT_EMBEDS and not hasattr(
                self.model, f"encode_{item.modality}"
            ):
                raise ValueError(f"{item.modality} inputs are not implemented for this model.")
        try:
            for item in items:
                self._encode(item)
        except Exception:
            for item in items:  # encoded for this request alone: not kept
                if not self._refs[item.content_hash]:
                    self._cache.pop(item.content_hash, None)
            raise
        for item in items:
            self._refs[item.content_hash] += 1
        if items:
            self._items[slot] = items

    def drop(self, slot: int) -> None:
        for item in self._items.pop(slot, []):
            self._refs[item.content_hash] -= 1
            if not self._refs[item.content_hash]:
                del self._refs[item.content_hash]
                self._cache.pop(item.content_hash, None)

    def _encode(self, item: MultiModalItem) -> torch.Tensor:
        cached = self._cache.get(item.content_hash)
        if cached is None:
            values = torch.from_numpy(
                np.frombuffer(item.data, np.float32).reshape(item.shape).copy()
            ).to(self.device)
            if item.modality == PROMPT_EMBEDS:  # the rows themselves
                self._cache[item.content_hash] = values
                return values
            cached = getattr(self.model, f"encode_{item.modality}")(values)
            self.encoder_calls += 1
            if cached.shape[0] != item.length:
                raise ValueError(
                    f"The {item.modality} has {cached.shape[0]} feature rows for "
                    f"{item.length} placeholder tokens."
                )
            self._cache[item.content_hash] = cached
        return cached

    def step_embeddings(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the step's rows inside placeholder ranges, their embeddings) or None."""
        if not self._items:
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
                    parts.append(self._encode(item)[lo - item.offset : hi - item.offset])
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
