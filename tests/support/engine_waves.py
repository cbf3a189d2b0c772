"""Engine runs for the model tests' preemption checks: the same prompts twice, all of them in
one request each time (they enter the same step, with no arrival-order luck; the second wave
hits the prefix cache), or each prompt its own request, all started at once."""

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


def concurrent_requests(
    path: str, prompts: list[dict], params: SamplingParams, **engine_args: Any
) -> tuple[list[list[int]], Any]:
    """Each prompt (an engine prompt dict, images included) its own request ``r<i>``, all
    started at once; their token ids and the engine's stats after them."""

    async def main():
        async with open_engine(path, **engine_args) as engine:
            results: dict[int, list[int]] = {}

            async def one(i: int) -> None:
                async with engine.generate(prompts[i], params, f"r{i}") as outputs:
                    async for out in outputs:
                        results[i] = out.outputs[0].token_ids

            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(one, i)
            return [results[i] for i in range(len(prompts))], engine.get_stats()

    return trio.run(main)
