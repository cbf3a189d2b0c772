"""KV block manager: one suite run against the Python twin and the native extension."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from scheduler_twin_helpers import IMPL_NAMES, check_kv_invariants, ecr, get_impl

from trillm.core.errors import BlockAllocationError
from trillm.core.kv_cache_manager import hash_block_tokens as py_hash
from trillm.core.kv_cache_manager import string_hash_key


@pytest.fixture(params=IMPL_NAMES)
def impl(request):
    return get_impl(request.param)


def new_request(impl, req_id, prompt, **kw):
    return impl.Request.from_engine_core_request(ecr(req_id, prompt, **kw))


def admit(kv, req, num_new_tokens=None):
    """Prefix lookup + allocation the way the scheduler admits a waiting request."""
    blocks, num_hit = kv.get_computed_blocks(req)
    n = req.num_tokens - num_hit if num_new_tokens is None else num_new_tokens
    assert kv.can_allocate(req, n, blocks)
    kv.allocate_slots(req, n, blocks)
    req.num_computed_tokens = num_hit
    return blocks, num_hit


def compute_all(kv, req):
    """Pretend the worker computed every token, then register the full blocks."""
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)


def test_allocate_free_refcounts_usage(impl):
    kv = impl.KVCacheManager(num_blocks=8, block_size=4)
    a = new_request(impl, "a", list(range(10)))
    assert kv.can_allocate(a, 10)
    new = kv.allocate_slots(a, 10)
    assert new == [0, 1, 2]  # 10 tokens -> 3 blocks, taken from the head of the free queue
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.num_free_blocks == 5
    assert kv.usage == pytest.approx(3 / 8)
    a.num_computed_tokens = 10
    assert kv.allocate_slots(a, 2) == []  # fits in the third block (12 slots)
    assert kv.allocate_slots(a, 3) == [3]
    check_kv_invariants(kv, {"a": kv.get_block_ids("a")})
    kv.free(a)
    assert kv.get_block_ids("a") == []
    assert kv.num_free_blocks == 8
    assert kv.usage == 0.0
    check_kv_invariants(kv, {})
    kv.free(a)  # freeing twice is a no-op, never a double free
    check_kv_invariants(kv, {})


def test_allocate_without_room_raises(impl):
    kv = impl.KVCacheManager(num_blocks=2, block_size=4)
    a = new_request(impl, "a", list(range(9)))
    assert not kv.can_allocate(a, 9)
    with pytest.raises(BlockAllocationError, match="call can_allocate first"):
        kv.allocate_slots(a, 9)
    check_kv_invariants(kv, {})
    assert kv.can_allocate(a, 8)


def test_prefix_hit_shares_blocks(impl):
    kv = impl.KVCacheManager(num_blocks=16, block_size=4)
    a = new_request(impl, "a", list(range(10)))
    admit(kv, a)
    compute_all(kv, a)  # blocks 0 and 1 are full -> cached; block 2 is partial
    b = new_request(impl, "b", list(range(8)) + [99, 98, 97])
    blocks, num_hit = kv.get_computed_blocks(b)
    assert blocks == kv.get_block_ids("a")[:2]
    assert num_hit == 8
    admit(kv, b)
    assert kv.get_block_ids("b")[:2] == blocks
    refs = kv.get_ref_counts()
    assert [refs[x] for x in blocks] == [2, 2]
    check_kv_invariants(kv, {"a": kv.get_block_ids("a"), "b": kv.get_block_ids("b")})
    # Counters count tokens at admission: a looked up 10 (0 hit), b 11 (8 hit).
    assert kv.prefix_cache_queries == 21
    assert kv.prefix_cache_hits == 8


def test_prompt_logprobs_requests_skip_the_prefix_cache(impl):
    # Prompt logprobs need the logits of every prompt position: a cache hit would skip them.
    kv = impl.KVCacheManager(num_blocks=16, block_size=4)
    a = new_request(impl, "a", list(range(10)))
    admit(kv, a)
    compute_all(kv, a)
    same = list(range(8)) + [99]
    assert kv.get_computed_blocks(new_request(impl, "b", same))[1] == 8
    assert kv.get_computed_blocks(new_request(impl, "c", same, prompt_logprobs=2)) == ([], 0)


def test_hit_never_covers_the_last_token(impl):
    kv = impl.KVCacheManager(num_blocks=16, block_size=4)
    a = new_request(impl, "a", list(range(8)))
    admit(kv, a)
    compute_all(kv, a)
    same = new_request(impl, "same", list(range(8)))
    blocks, num_hit = kv.get_computed_blocks(same)
    assert num_hit == 4  # the second block holds the last token: it is recomputed
    assert blocks == kv.get_block_ids("a")[:1]


def test_mismatch_stops_the_chain(impl):
    kv = impl.KVCacheManager(num_blocks=16, block_size=4)
    a = new_request(impl, "a", list(range(13)))
    admit(kv, a)
    compute_all(kv, a)
    # Same third block, different first block: chain hashing gives no hit at all.
    b = new_request(impl, "b", [50, 1, 2, 3] + list(range(4, 13)))
    assert kv.get_computed_blocks(b) == ([], 0)
    c = new_request(impl, "c", list(range(4)) + [77] + list(range(5, 13)))
    assert kv.get_computed_blocks(c)[1] == 4


def test_lru_eviction_order_and_lazy_eviction(impl):
    kv = impl.KVCacheManager(num_blocks=4, block_size=4)
    a = new_request(impl, "a", list(range(10)))  # blocks 0, 1 full; 2 partial
    admit(kv, a)
    compute_all(kv, a)
    assert kv.num_cached_blocks_total() == 2
    kv.free(a)
    # Freed in reverse order: the request's tail is evicted first; block 3 was never used.
    assert kv.free_block_ids() == [3, 2, 1, 0]
    probe = new_request(impl, "probe", list(range(10)))
    assert kv.get_computed_blocks(probe)[1] == 8  # freed blocks keep their hashes
    x = new_request(impl, "x", [40])
    assert kv.allocate_slots(x, 1) == [3]
    y = new_request(impl, "y", [41])
    assert kv.allocate_slots(y, 1) == [2]
    assert kv.num_cached_blocks_total() == 2  # block 2 had no hash
    z = new_request(impl, "z", [42])
    assert kv.allocate_slots(z, 1) == [1]  # evicts the second cached block lazily
    assert kv.num_cached_blocks_total() == 1
    assert kv.get_computed_blocks(probe) == ([0], 4)
    check_kv_invariants(kv, {r: kv.get_block_ids(r) for r in ("x", "y", "z")})


def test_hit_on_free_block_leaves_the_free_queue(impl):
    kv = impl.KVCacheManager(num_blocks=6, block_size=4)
    a = new_request(impl, "a", list(range(9)))
    admit(kv, a)
    compute_all(kv, a)
    kv.free(a)
    b = new_request(impl, "b", list(range(9)))
    blocks, _ = kv.get_computed_blocks(b)
    assert blocks == [0, 1]
    # Revived blocks cost free slots: 2 hits + 1 fresh block.
    assert kv.can_allocate(b, 1, blocks)
    admit(kv, b)
    assert 0 not in kv.free_block_ids() and 1 not in kv.free_block_ids()
    assert kv.get_block_ids("b")[:2] == [0, 1]
    assert kv.num_free_blocks == 3
    check_kv_invariants(kv, {"b": kv.get_block_ids("b")})


def test_revived_blocks_count_against_free_space(impl):
    kv = impl.KVCacheManager(num_blocks=3, block_size=4)
    a = new_request(impl, "a", list(range(9)))
    admit(kv, a)
    compute_all(kv, a)
    kv.free(a)
    b = new_request(impl, "b", list(range(8)) + [5, 6, 7, 8, 9, 10, 11, 12, 13])
    blocks, _ = kv.get_computed_blocks(b)
    assert blocks == [0, 1]
    # 17 tokens need 5 blocks: 2 hits + 3 fresh, but only 3 blocks exist in all.
    assert not kv.can_allocate(b, 9, blocks)
    with pytest.raises(BlockAllocationError):
        kv.allocate_slots(b, 9, blocks)
    check_kv_invariants(kv, {})


@pytest.mark.parametrize("field", ["cache_salt", "extra_hash_keys"])
def test_salt_and_extra_keys_isolate_hits(impl, field):
    kv = impl.KVCacheManager(num_blocks=16, block_size=4)
    value_a = "tenant-a" if field == "cache_salt" else ["lora-a"]
    value_b = "tenant-b" if field == "cache_salt" else ["lora-b"]
    a = new_request(impl, "a", list(range(9)), **{field: value_a})
    admit(kv, a)
    compute_all(kv, a)
    other = new_request(impl, "b", list(range(9)), **{field: value_b})
    assert kv.get_computed_blocks(other) == ([], 0)
    unsalted = new_request(impl, "c", list(range(9)))
    assert kv.get_computed_blocks(unsalted) == ([], 0)
    same = new_request(impl, "d", list(range(9)), **{field: value_a})
    assert kv.get_computed_blocks(same)[1] == 8


def test_salt_only_on_first_block(impl):
    plain = new_request(impl, "p", list(range(8)))
    salted = new_request(impl, "s", list(range(8)), cache_salt="s")
    kv = impl.KVCacheManager(num_blocks=8, block_size=4)
    hp, hs = kv.block_hashes(plain), kv.block_hashes(salted)
    salt_key = string_hash_key("salt:s")
    assert hs[0] == py_hash(None, list(range(4)), [salt_key])
    assert hs[1] == py_hash(hs[0], list(range(4, 8)), [])  # the chain carries the salt
    assert hp[0] == py_hash(None, list(range(4)), [])
    assert hp[0] != hs[0] and hp[1] != hs[1]


def test_prefix_caching_disabled(impl):
    kv = impl.KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    a = new_request(impl, "a", list(range(12)))
    admit(kv, a)
    compute_all(kv, a)
    assert kv.num_cached_blocks_total() == 0
    assert kv.get_computed_blocks(new_request(impl, "b", list(range(12)))) == ([], 0)
    assert kv.prefix_cache_queries == 0


def test_reset_prefix_cache(impl):
    kv = impl.KVCacheManager(num_blocks=16, block_size=4)
    a = new_request(impl, "a", list(range(12)))
    admit(kv, a)
    compute_all(kv, a)
    kv.reset_prefix_cache()
    assert kv.num_cached_blocks_total() == 0
    assert kv.get_computed_blocks(new_request(impl, "b", list(range(12)))) == ([], 0)
    check_kv_invariants(kv, {"a": kv.get_block_ids("a")})


def test_duplicate_content_is_cached_once(impl):
    kv = impl.KVCacheManager(num_blocks=16, block_size=4)
    a = new_request(impl, "a", list(range(9)))
    b = new_request(impl, "b", list(range(9)))
    admit(kv, a)
    admit(kv, b)  # no hit yet: a has not been computed
    compute_all(kv, a)
    compute_all(kv, b)
    assert kv.num_cached_blocks_total() == 2
    assert (
        kv.get_computed_blocks(new_request(impl, "c", list(range(9))))[0]
        == kv.get_block_ids("a")[:2]
    )
    kv.free(a)  # b's duplicate blocks stay usable, a's stay cached in the free queue
    assert kv.get_computed_blocks(new_request(impl, "d", list(range(9))))[1] == 8


def test_output_tokens_are_hashed_too(impl):
    kv = impl.KVCacheManager(num_blocks=16, block_size=4)
    a = new_request(impl, "a", list(range(6)))
    admit(kv, a)
    for t in (6, 7, 8):
        a.append_output_token(t)
    kv.allocate_slots(a, 3)
    compute_all(kv, a)
    assert kv.num_cached_blocks_total() == 2
    assert kv.get_computed_blocks(new_request(impl, "b", list(range(10))))[1] == 8


def test_hash_twins_agree_and_are_process_independent():
    cases = [
        (None, [1, 2, 3, 4], []),
        (2**127 + 12345, [0, 2**31 - 1, 7, 7], [string_hash_key("x:lora")]),
        (5, [], [1, 2]),
    ]
    native = get_impl("native").hash_block_tokens
    values = [py_hash(*c) for c in cases]
    assert values == [native(*c) for c in cases]
    assert len(set(values)) == 3 and all(0 <= v < 2**128 for v in values)
    code = (
        "from trillm.core.kv_cache_manager import hash_block_tokens as h, string_hash_key as k;"
        f"print([h(*c) for c in {cases!r}], k('salt:a'))"
    )
    env = dict(os.environ, PYTHONHASHSEED="123")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == f"{values} {string_hash_key('salt:a')}"


def test_block_hashes_of_requests_agree_across_twins():
    py_impl, nat_impl = get_impl("python"), get_impl("native")
    prompt = list(range(100, 123))
    hashes = []
    for impl in (py_impl, nat_impl):
        req = new_request(impl, "r", prompt, cache_salt="salt", extra_hash_keys=["k1", "k2"])
        hashes.append(impl.KVCacheManager(8, 4).block_hashes(req))
    assert len(hashes[0]) == 5
    assert hashes[0] == hashes[1]
