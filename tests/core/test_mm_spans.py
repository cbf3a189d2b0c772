"""Prefill chunks around image spans that attend both ways (Gemma 3): a chunk never ends inside
a span (it ends at the span's start, or the request waits for a step that holds the rest of
the span), with other requests sharing the budget; both scheduler twins keep the rule and decide
alike, and a step budget smaller than an image is refused."""

from __future__ import annotations

import random

import pytest
from scheduler_twin_helpers import IMPL_NAMES, FakeWorker, ecr, get_impl, make_scheduler, step

from trillm.core.mm_spans import check_budget, clamp_to_spans
from trillm.messages import FinishReason, MultiModalItem

SPAN = (5, 15)  # an image's 10 tokens at positions 5 .. 14


def image_request(req_id: str, n: int = 24, seed: int = 0, spans=(SPAN,), max_tokens: int = 2):
    req = ecr(req_id, [seed * 1000 + i for i in range(n)], max_tokens=max_tokens)
    req.mm_items = [
        MultiModalItem("image", f"h{start}", start, stop - start, b"", [3, 4, 4])
        for start, stop in spans
    ]
    req.extra_hash_keys = [f"mm:image:{item.content_hash}" for item in req.mm_items]
    return req


@pytest.fixture(params=IMPL_NAMES)
def impl(request):
    return get_impl(request.param)


def spans_scheduler(impl, **kwargs):
    sched = make_scheduler(impl, **kwargs)
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


def test_chunks_end_before_a_span_and_take_it_whole(impl):
    sched = spans_scheduler(impl, max_num_batched_tokens=12)
    sched.add_request(image_request("a"))
    worker = FakeWorker()
    chunks = [step(sched, worker)[0].num_scheduled_tokens["a"] for _ in range(3)]
    assert chunks == [5, 12, 7]  # 0..5, 5..17 (the span 5..15 whole), 17..24


def test_without_keeping_spans_the_chunk_splits_the_image(impl):
    sched = make_scheduler(impl, max_num_batched_tokens=12)
    sched.add_request(image_request("a"))
    assert step(sched, FakeWorker())[0].num_scheduled_tokens["a"] == 12


def test_a_span_waits_for_a_step_with_the_budget_for_it(impl):
    # b's prefill ends at its span's start while a takes most of the budget; b's span
    # goes whole in a later step, never split
    sched = spans_scheduler(impl, max_num_batched_tokens=16)
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


def test_a_prefix_cache_hit_inside_a_span_waits_to_take_the_span_rest_whole(impl):
    # b shares a's first 8 tokens (2 cached blocks): it starts at 8, inside the span 5..15.
    # Behind x's 6-token prompt only 6 tokens of the budget are left, which would end b's
    # chunk at 14: b waits, and takes 8..19 in the next step.
    sched = spans_scheduler(impl, max_num_batched_tokens=12)
    worker = FakeWorker()
    sched.add_request(image_request("a"))
    while sched.has_unfinished_requests():
        step(sched, worker)
    b = image_request("b")
    b.prompt_token_ids[8:] = [7000 + i for i in range(16)]
    sched.add_request(ecr("x", [5000 + i for i in range(6)], max_tokens=3))
    sched.add_request(b)
    assert step(sched, worker)[0].num_scheduled_tokens == {"x": 6}
    out = step(sched, worker)[0]
    assert out.num_scheduled_tokens == {"x": 1, "b": 11}
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8


def random_image_request(rng: random.Random, req_id: str):
    """1-2 images; prompts that share a prefix (cache hits, some ending inside a span)."""
    n = rng.randrange(12, 40)
    start = rng.randrange(0, n - 8)
    spans = [(start, start + rng.randrange(3, 9))]
    if spans[0][1] + 4 < n and rng.random() < 0.5:
        second = rng.randrange(spans[0][1], n - 3)
        spans.append((second, min(n, second + rng.randrange(2, 9))))
    req = image_request(req_id, n, spans=spans, max_tokens=rng.randrange(1, 6))
    shared = rng.randrange(n)  # the first tokens are one of two prompts'
    base = rng.randrange(2)
    req.prompt_token_ids = [base] * shared + [rng.randrange(9) for _ in range(n - shared)]
    req.extra_hash_keys = [f"mm:image:{base}"]
    return req


@pytest.mark.parametrize("seed", range(3))
def test_the_twins_keep_spans_alike(seed):
    # same requests, aborts and steps: identical messages each step, with preemption (few
    # blocks) and prefix-cache hits that end inside a span
    rng = random.Random(seed)
    config = {"num_blocks": 16, "max_num_batched_tokens": 10, "max_num_seqs": 4}
    twins = [spans_scheduler(get_impl(name), **config) for name in IMPL_NAMES]
    workers = [FakeWorker(seed=seed) for _ in twins]
    for i in range(300):
        roll = rng.random()
        if roll < 0.2:
            req = random_image_request(rng, f"r{i}")
            for sched in twins:
                sched.add_request(req)
        elif roll < 0.22 and twins[0].running_req_ids():
            victim = rng.choice(twins[0].running_req_ids())
            for sched in twins:
                sched.finish_requests(victim, FinishReason.ABORT)
        else:
            results = [step(sched, worker) for sched, worker in zip(twins, workers)]
            assert results[0] == results[1], f"diverged at event {i}"
    stats = twins[0].get_stats()
    assert stats == twins[1].get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, stats
