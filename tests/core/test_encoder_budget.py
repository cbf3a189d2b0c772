"""The scheduler's encoder budget and encoder cache (core/encoder_cache.py, vLLM's
max_num_encoder_input_tokens and EncoderCacheManager), in both twins: a chunk that reaches an
item the step cannot encode ends at the item's start (the text before it is computed), an
entry nobody needs stays cached until an item needs its rows (the worker is told to drop it),
a preempted request reuses its cached item, and the twins decide alike under random load
while a mirror of the worker's cache never passes the budgets."""

from __future__ import annotations

import random

import pytest
from scheduler_twin_helpers import IMPL_NAMES, FakeWorker, ecr, get_impl, make_scheduler, step

from trillm.core.encoder_cache import EncoderCache
from trillm.messages import FinishReason, MultiModalItem, SchedulerOutput


def image_request(req_id: str, items: list[tuple[str, int, int]], n: int = 14, max_tokens=2):
    """Items as (content hash, offset, rows); prompt tokens unique to the request."""
    req = ecr(req_id, [hash(req_id) % 1000 * 100 + i for i in range(n)], max_tokens=max_tokens)
    req.mm_items = [MultiModalItem("image", h, o, k, b"", [3, 4, 4]) for h, o, k in items]
    req.extra_hash_keys = [f"mm:image:{h}" for h, _, _ in items]
    return req


@pytest.fixture(params=IMPL_NAMES)
def impl(request):
    return get_impl(request.param)


def budget_scheduler(impl, cache_rows: int, step_rows: int, **kwargs):
    sched = make_scheduler(impl, **kwargs)
    sched.encoder_cache = EncoderCache(cache_rows, step_rows)
    return sched


def test_an_item_past_the_step_encoder_budget_waits_with_the_text_before_it(impl):
    sched = budget_scheduler(impl, cache_rows=20, step_rows=12, max_num_batched_tokens=32)
    sched.add_request(image_request("a", [("x", 2, 10)]))
    sched.add_request(image_request("b", [("y", 3, 10)]))
    worker = FakeWorker()
    first, _ = step(sched, worker)
    assert first.num_scheduled_tokens == {"a": 14, "b": 3}  # b's text up to its image
    second, _ = step(sched, worker)
    assert second.num_scheduled_tokens == {"a": 1, "b": 11}
    assert first.free_encoder_mm_hashes == second.free_encoder_mm_hashes == []


def test_without_an_encoder_cache_nothing_waits(impl):
    sched = make_scheduler(impl, max_num_batched_tokens=32)
    sched.add_request(image_request("a", [("x", 2, 10)]))
    sched.add_request(image_request("b", [("y", 3, 10)]))
    assert step(sched, FakeWorker())[0].num_scheduled_tokens == {"a": 14, "b": 14}


def test_a_cache_of_one_item_evicts_what_no_request_needs(impl):
    sched = budget_scheduler(impl, cache_rows=10, step_rows=32, max_num_batched_tokens=32)
    worker = FakeWorker()
    sched.add_request(image_request("a", [("x", 2, 10)], max_tokens=3))
    sched.add_request(image_request("b", [("y", 3, 10)], max_tokens=3))
    out, _ = step(sched, worker)
    assert out.num_scheduled_tokens == {"a": 14, "b": 3}  # a holds the cache's rows
    out, _ = step(sched, worker)  # a's prefill has passed x: y takes its rows
    assert out.num_scheduled_tokens == {"a": 1, "b": 11}
    assert out.free_encoder_mm_hashes == ["x"]
    sched.add_request(image_request("c", [("y", 0, 10)]))  # a hit: no eviction, no wait
    out, _ = step(sched, worker)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 14}
    assert out.free_encoder_mm_hashes == []


def test_two_items_of_one_prompt_through_a_cache_of_one(impl):
    # the second item waits until the chunks have passed the first, then evicts it
    sched = budget_scheduler(impl, cache_rows=10, step_rows=10, max_num_batched_tokens=16)
    sched.add_request(image_request("a", [("x", 1, 10), ("y", 13, 10)], n=24))
    worker = FakeWorker()
    chunks = []
    for _ in range(3):
        out, _ = step(sched, worker)
        chunks.append((out.num_scheduled_tokens["a"], out.free_encoder_mm_hashes))
    assert chunks == [(13, []), (11, ["x"]), (1, [])]


def test_a_head_left_waiting_for_blocks_takes_nothing_in_the_cache(impl):
    # 5 blocks of 4: a's 14 + 2 tokens take 4; b's image would be encoded, but b gets no
    # blocks this step: its entry is not kept (nor counted) until it is scheduled
    sched = budget_scheduler(impl, 20, 20, num_blocks=5, max_num_batched_tokens=32)
    sched.add_request(image_request("a", [("x", 2, 10)]))
    sched.add_request(image_request("b", [("y", 3, 10)]))
    assert step(sched, FakeWorker())[0].num_scheduled_tokens == {"a": 14}
    assert sched.encoder_cache.num_cached_rows == sched.encoder_cache.num_held_rows == 10


def test_a_preempted_request_holds_nothing_and_reuses_its_cached_item(impl):
    # 8 blocks of 4, each 16-token prompt takes 4: a's first new token needs a fifth, so b is
    # preempted while it still holds y; it takes y again from the cache when it comes back
    sched = budget_scheduler(impl, 40, 40, num_blocks=8, max_num_batched_tokens=32)
    sched.add_request(image_request("a", [("x", 2, 10)], n=16, max_tokens=10))
    sched.add_request(image_request("b", [("y", 3, 10)], n=16, max_tokens=10))
    worker = FakeWorker()
    evicted: list[str] = []
    while sched.has_unfinished_requests():
        evicted += step(sched, worker)[0].free_encoder_mm_hashes
        if sched.num_preemptions and "b" in sched.waiting_req_ids():
            assert sched.encoder_cache.num_held_rows == 0  # y may go if another needs rows
    assert sched.num_preemptions > 0 and evicted == []
    assert sched.encoder_cache.num_cached_rows == 20  # both kept for a later request


class CacheMirror:
    """The worker's side: drops what the scheduler evicts, encodes what a step's chunks reach
    and it lacks; checks the rows held and encoded per step against the budgets."""

    def __init__(self, cache_rows: int, step_rows: int) -> None:
        self.cache_rows, self.step_rows = cache_rows, step_rows
        self.items: dict[str, list[MultiModalItem]] = {}
        self.cached: dict[str, int] = {}
        self.encoded = 0

    def apply(self, out: SchedulerOutput) -> None:
        for content_hash in out.free_encoder_mm_hashes:
            self.cached.pop(content_hash, None)
        computed = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        rows = []
        for req_id, n in out.num_scheduled_tokens.items():
            first = computed[req_id]
            for m in self.items.get(req_id, ()):
                reached = m.offset < first + n and first < m.offset + m.length
                if reached and m.content_hash not in self.cached:
                    self.cached[m.content_hash] = m.length
                    rows.append(m.length)
        self.encoded += len(rows)
        assert sum(rows) <= self.step_rows or len(rows) == 1, rows
        assert sum(self.cached.values()) <= self.cache_rows or len(self.cached) == 1


def random_request(rng: random.Random, req_id: str):
    """1-2 items of 3-8 rows from a pool of 5 images (so entries are shared and reused)."""
    n = rng.randrange(12, 36)
    first = rng.randrange(0, n - 8)
    items = [(f"h{rng.randrange(5)}", first, rng.randrange(3, 9))]
    end = first + items[0][2]
    if end + 4 < n and rng.random() < 0.5:
        items.append((f"h{rng.randrange(5)}", end + 1, rng.randrange(2, min(9, n - end))))
    items = [(h, o, k) for i, (h, o, k) in enumerate(items) if i == 0 or h != items[0][0]]
    return image_request(req_id, items, n=n, max_tokens=rng.randrange(1, 6))


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", range(3))
def test_the_twins_decide_alike_within_the_budgets(seed, policy):
    # same requests, aborts and steps: identical messages each step (evictions included),
    # with preemption (few blocks; under priority a victim may have been scheduled earlier in
    # the step); the worker's mirror never passes either budget
    rng = random.Random(seed)
    config = {"num_blocks": 16, "max_num_batched_tokens": 12, "max_num_seqs": 4, "policy": policy}
    twins = [budget_scheduler(get_impl(name), 12, 9, **config) for name in IMPL_NAMES]
    workers = [FakeWorker(seed=seed) for _ in twins]
    mirror = CacheMirror(12, 9)
    evictions = 0
    for i in range(300):
        roll = rng.random()
        if roll < 0.2:
            req = random_request(rng, f"r{i}")
            req.priority, req.arrival_time = rng.randrange(3), float(i)
            mirror.items[req.request_id] = req.mm_items
            for sched in twins:
                sched.add_request(req)
        elif roll < 0.22 and twins[0].running_req_ids():
            victim = rng.choice(twins[0].running_req_ids())
            for sched in twins:
                sched.finish_requests(victim, FinishReason.ABORT)
        else:
            results = [step(sched, worker) for sched, worker in zip(twins, workers)]
            assert results[0] == results[1], f"diverged at event {i}"
            mirror.apply(results[0][0])
            evictions += len(results[0][0].free_encoder_mm_hashes)
    stats = twins[0].get_stats()
    assert stats == twins[1].get_stats()
    assert stats.num_preemptions > 0 and evictions > 0 and mirror.encoded > 0, stats
