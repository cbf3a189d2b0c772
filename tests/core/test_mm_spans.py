"""Prefill chunks around image spans that attend both ways (Gemma 3): a chunk never ends inside
a span (it ends at the span's start, or the request waits for a step that holds the rest of
the span), with other requests sharing the budget; the engine picks the
Python scheduler for such a model and refuses a step budget smaller than an image."""

from __future__ import annotations

import pytest
from scheduler_twin_helpers import FakeWorker, ecr, get_impl, make_scheduler, step

from trillm.core.mm_spans import check_budget, clamp_to_spans
from trillm.messages import MultiModalItem

SPAN = (5, 15)  # an image's 10 tokens at positions 5 .. 14


def image_request(req_id: str, n: int = 24, seed: int = 0):
    req = ecr(req_id, [seed * 1000 + i for i in range(n)], max_tokens=2)
    req.mm_items = [MultiModalItem("image", "h", SPAN[0], SPAN[1] - SPAN[0], b"", [3, 4, 4])]
    req.extra_hash_keys = ["mm:image:h"]
    return req


def spans_scheduler(**kwargs):
    sched = make_scheduler(get_impl("python"), **kwargs)
    sched.keep_mm_spans_whole = True
    return sched


def test_clamp_to_spans():
    spans = [SPAN, (20, 30)]
    assert clamp_to_spans(0, 12, spans) == 5  # would end inside: ends at the span's start
    assert clamp_to_spans(0, 15, spans) == 15  # ends where the span ends
    assert clamp_to_spans(5, 10, spans) == 10  # the whole span
    assert clamp_to_spans(5, 8, spans) == 0  # starts at it, cannot finish it: waits
    assert clamp_to_spans(8, 4, spans) == 0  # (a prefix-cache hit inside it) the same
    assert clamp_to_spans(8, 15, spans) == 12  # the rest of one, then up to the next
    assert clamp_to_spans(15, 5, spans) == 5


def test_chunks_end_before_a_span_and_take_it_whole():
    sched = spans_scheduler(max_num_batched_tokens=12)
    sched.add_request(image_request("a"))
    worker = FakeWorker()
    chunks = [step(sched, worker)[0].num_scheduled_tokens["a"] for _ in range(3)]
    assert chunks == [5, 12, 7]  # 0..5, 5..17 (the span 5..15 whole), 17..24


def test_without_keeping_spans_the_chunk_splits_the_image():
    sched = make_scheduler(get_impl("python"), max_num_batched_tokens=12)
    sched.add_request(image_request("a"))
    assert step(sched, FakeWorker())[0].num_scheduled_tokens["a"] == 12


def test_a_span_waits_for_a_step_with_the_budget_for_it():
    # b's prefill ends at its span's start while a takes most of the budget; b's span
    # goes whole in a later step, never split
    sched = spans_scheduler(max_num_batched_tokens=16)
    sched.add_request(ecr("a", list(range(9)), max_tokens=4))
    sched.add_request(image_request("b", seed=1))
    worker = FakeWorker()
    seen: list[tuple[int, int]] = []
    done = 0
    while sched.has_unfinished_requests():
        out = step(sched, worker)[0]
        n = out.num_scheduled_tokens.get("b", 0)
        if n and done < 24:
            seen.append((done, done + n))
            done += n
    for start, end in seen:
        assert not (SPAN[0] < end < SPAN[1]), seen
    assert seen[0] == (0, 5)


def test_the_step_budget_must_hold_an_image():
    from types import SimpleNamespace

    config = SimpleNamespace(
        scheduler=SimpleNamespace(max_num_batched_tokens=8, long_prefill_token_threshold=0)
    )
    with pytest.raises(ValueError, match="max_num_batched_tokens=8 is less than an image's 10"):
        check_budget(config, 10)
    config.scheduler.max_num_batched_tokens, config.scheduler.long_prefill_token_threshold = 64, 4
    with pytest.raises(ValueError, match="long_prefill_token_threshold=4"):
        check_budget(config, 10)
