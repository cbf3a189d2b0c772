"""End to end through the engine (frontend task, engine core, worker subprocess, ring
buffers, detokenizer): greedy output equals transformers for every architecture while
requests are cancelled, with a KV cache small enough to force preemption, and with
prefix-cache hits."""

from __future__ import annotations

import random

import pytest
import trio
from hf_reference import hf_greedy

from trillm import SamplingParams, open_engine

NUM_REQUESTS = 16
MAX_TOKENS = 12

ARCHES = ["llama", "mistral", "qwen2", "qwen3"]


def make_prompts(seed: int, vocab: int = 4096) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(40)]  # prefix-cache hits
    prompts = []
    for i in range(NUM_REQUESTS):
        n = rng.randint(3, 60)
        body = [rng.randrange(3, vocab) for _ in range(n)]
        prompts.append(shared + body if i % 3 == 0 else body)
    return prompts


async def run_batch(engine, prompts, cancel: set[int]) -> dict[int, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    results: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        n_seen = 0
        async with engine.generate({"prompt_token_ids": prompts[i]}, params, f"r{i}") as outputs:
            async for out in outputs:
                n_seen += 1
                if i in cancel and n_seen == 3:
                    return  # leaving the loop aborts the request
                results[i] = out.outputs[0].token_ids

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return results


@pytest.mark.parametrize("arch", ARCHES)
def test_engine_matches_transformers(arch, tiny_model_factory):
    path = tiny_model_factory(arch)
    prompts = make_prompts(seed=ARCHES.index(arch))  # NOTE: hash(str) varies per process
    cancel = {1, 6, 11}
    expected = {i: hf_greedy(path, p, MAX_TOKENS) for i, p in enumerate(prompts) if i not in cancel}

    async def main():
        async with open_engine(
            path,
            max_model_len=256,
            num_gpu_blocks_override=24,  # 16 requests need ~70 blocks: forces preemption
            max_num_batched_tokens=64,  # long prompts are chunked
            max_num_seqs=16,
        ) as engine:
            first = await run_batch(engine, prompts, cancel)
            # A second wave with the same prompts hits the prefix cache.
            second = await run_batch(engine, prompts, set())
            stats = engine.get_stats()
            assert engine.get_stats().num_running_reqs == 0
            return first, second, stats

    first, second, stats = trio.run(main)
    for i, want in expected.items():
        assert first[i] == want, f"request {i} (first wave) diverged from transformers"
        assert second[i] == want, f"request {i} (second wave) diverged from transformers"
    assert stats.num_preemptions > 0, "the small KV cache should have forced preemption"
    assert stats.prefix_cache_hits > 0, "the second wave should hit the prefix cache"
    assert stats.kv_cache_usage == 0.0
