"""An engine run twice over the same prompts, each time all of them in one request (so they
enter the same step, with no arrival-order luck): what the model tests use to check greedy
outputs under preemption, chunked prefill and prefix-cache hits (the second wave's)."""

from __future__ import annotations

from typing import Any

import trio

from trillm import SamplingParams, open_engine


async def wave(engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    results: dict[int, list[int]] = {}
    batch = [{"prompt_token_ids": p} for p in prompts]
    async with engine.generate_many(batch, params) as items:
        async for index, out in items:
            results[index] = out.outputs[0].token_ids
    return [results[i] for i in range(len(prompts))]


def two_waves(
    path: str, prompts: list[list[int]], params: SamplingParams, **engine_args: Any
) -> tuple[list[list[int]], list[list[int]], Any]:
    """Both waves' token ids and the engine's stats after them."""

    async def main():
        async with open_engine(path, **engine_args) as engine:
            first, second = await wave(engine, prompts, params), await wave(engine, prompts, params)
            return first, second, engine.get_stats()

    return trio.run(main)
