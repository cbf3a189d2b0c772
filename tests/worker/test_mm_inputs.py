"""The worker's multimodal inputs on a stand-in encoder: an item encoded by the first step that
reaches it, rows sliced per prefill chunk from that one encoding, the cache shared by requests
holding the same image and kept after they end until the scheduler evicts it (then encoded
again), an item the encoder refuses failing its own request without leaving anything behind,
and no encoding on a pipeline stage after the first."""

from __future__ import annotations

import numpy as np
import torch

from trillm.messages import CachedRequestData, MultiModalItem, SchedulerOutput
from trillm.worker.input_batch import StepInputs
from trillm.worker.mm_inputs import MultiModalInputs, encode_step, set_mm_rows


class Encoder:
    """``encode_image``: row r of an image is its first pixel + r (so slices are checkable)."""

    def __init__(self, rows: int) -> None:
        self.rows, self.calls, self.step = rows, 0, "unset"

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return pixels.flatten()[0] + torch.arange(self.rows, dtype=torch.float32)[:, None]

    def set_step_embeddings(self, rows):
        self.step = rows


def item(value: float, offset: int, length: int = 4) -> MultiModalItem:
    data = np.full((1, 2, 2), value, np.float32)
    return MultiModalItem("image", f"h{value}", offset, length, data.tobytes(), [1, 2, 2])


def step(slots: list[int], firsts: list[int], counts: list[int]) -> StepInputs:
    positions = np.concatenate([np.arange(f, f + c) for f, c in zip(firsts, counts)])
    loc = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    empty = np.zeros(0, np.int64)
    return StepInputs(
        np.array(slots), positions, positions, positions, loc, empty, empty, empty, empty, empty
    )


class Batch:
    """What ``encode_step`` reads of the persistent batch: each request's slot and computed
    tokens."""

    def __init__(self, computed: dict[str, tuple[int, int]]) -> None:
        self.slots = {r: slot for r, (slot, _) in computed.items()}
        self.num_computed = np.zeros(4, np.int64)
        for slot, done in computed.values():
            self.num_computed[slot] = done

    def slot_of(self, req_id: str) -> int:
        return self.slots[req_id]


def sched(scheduled: dict[str, int], evicted: tuple[str, ...] = ()) -> SchedulerOutput:
    total = sum(scheduled.values())
    out = SchedulerOutput(1, [], CachedRequestData(), scheduled, total)
    out.free_encoder_mm_hashes = list(evicted)
    return out


def test_chunks_take_their_rows_from_one_encoding():
    model = Encoder(4)
    mm = MultiModalInputs(model, torch.device("cpu"))
    mm.add(0, [item(10.0, offset=2)])  # placeholders at positions 2..5
    mm.add(1, [item(10.0, offset=0)])  # the same image: no second encoding
    batch = Batch({"a": (0, 0), "b": (1, 0)})
    assert encode_step(mm, sched({"a": 2}), batch, {}) == {} and model.calls == 0  # not reached
    assert encode_step(mm, sched({"a": 4, "b": 2}), batch, {}) == {} and model.calls == 1
    # slot 0: positions 0..3 (rows 2, 3 of the step take image rows 0, 1); slot 1: 0..1
    rows, emb = mm.step_embeddings(step([0, 1], [0, 0], [4, 2]))
    assert rows.tolist() == [2, 3, 4, 5] and emb[:, 0].tolist() == [10, 11, 10, 11]
    rows, emb = mm.step_embeddings(step([0], [4], [3]))  # the next chunk: image rows 2, 3
    assert rows.tolist() == [0, 1] and emb[:, 0].tolist() == [12, 13]
    assert mm.step_embeddings(step([0], [6], [1])) is None  # past the image: decode
    assert set_mm_rows(mm, model, step([0], [6], [1])) is False and model.step is None
    mm.drop(0)
    mm.drop(1)
    mm.add(2, [item(10.0, offset=0)])  # after its requests: still cached
    encode_step(mm, sched({"c": 4}), Batch({"c": (2, 0)}), {})
    assert model.calls == 1
    mm.add(3, [item(10.0, offset=0)])  # evicted by the scheduler: encoded again
    encode_step(mm, sched({"d": 4}, evicted=("h10.0",)), Batch({"d": (3, 0)}), {})
    assert model.calls == 2


def test_an_item_the_encoder_refuses_fails_alone_and_leaves_nothing():
    model = Encoder(3)
    mm = MultiModalInputs(model, torch.device("cpu"))
    mm.add(0, [item(1.0, 0, length=3), item(2.0, 5, length=4)])
    mm.add(1, [item(1.0, 0, length=3)])
    batch = Batch({"a": (0, 0), "b": (1, 0)})
    refused = encode_step(mm, sched({"a": 9, "b": 3}), batch, {})
    assert list(refused) == ["a"] and "3 feature rows for 4 placeholder tokens" in refused["a"]
    assert set(mm._cache) == {"h1.0"}  # b's image, which b's step needs
    assert mm.step_embeddings(step([1], [0], [3]))[1][:, 0].tolist() == [1, 2, 3]
    assert encode_step(mm, sched({"a": 9}), batch, {"a": "refused at add"}) == {}


def test_a_later_pipeline_stage_encodes_nothing():
    model = Encoder(4)
    mm = MultiModalInputs(model, torch.device("cpu"), encodes=False)
    mm.add(0, [item(10.0, offset=0)])
    assert encode_step(mm, sched({"a": 4}), Batch({"a": (0, 0)}), {}) == {}
    assert model.calls == 0 and mm.step_embeddings(step([0], [0], [4])) is None
