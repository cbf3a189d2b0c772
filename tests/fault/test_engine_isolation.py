"""One request never harms another inside the engine (issue 11, defects 1 and 2).

SamplingParams refuses out-of-range values (tests/test_request_bounds.py); these tests go
around that check on purpose (the fields are mutated after validation), as a bug elsewhere
could, and show that the engine still ends the offending request alone: a request whose data
the IPC codec cannot encode is taken out of its step, and one the worker cannot take (its
float32 sampling tensors overflow) fails there while the rest of the step runs. The engine is
the real one: worker subprocess, shared-memory rings, the embedded default model.
"""

from __future__ import annotations

import pytest
import trio

from trillm import SamplingParams, open_engine
from trillm.outputs import RequestOutput

# The worker is a subprocess all the same, forked from this pytest worker's rank zygote server
# rather than a fresh Python importing torch (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("ranks_from_one_zygote")
PROMPT = "In the beginning God created"


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _overflowing_temperature() -> SamplingParams:
    params = SamplingParams(temperature=1.0, max_tokens=4)
    params.temperature = 1e39  # past float32: the worker's tensor write raises
    return params


def _unencodable_seed() -> SamplingParams:
    params = SamplingParams(temperature=1.0, max_tokens=4, seed=1)
    params.seed = 2**64  # msgpack carries 64-bit integers only
    return params


async def _last(engine, params: SamplingParams, request_id: str) -> RequestOutput:
    last = None
    async with engine.generate(PROMPT, params, request_id) as outputs:
        async for out in outputs:
            last = out
    assert last is not None
    return last


async def _hostile_beside_a_stream(engine, hostile: SamplingParams, tag: str):
    """A long greedy request decodes; the hostile one arrives in the middle of it."""
    results: dict[str, RequestOutput] = {}

    async def long_request() -> None:
        results["long"] = await _last(engine, _params(24), f"long-{tag}")

    async def hostile_request() -> None:
        await trio.sleep(0.3)  # the long request is decoding by now: one step holds both
        results["hostile"] = await _last(engine, hostile, f"hostile-{tag}")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(long_request)
        nursery.start_soon(hostile_request)
    return results["long"], results["hostile"]


def test_a_request_that_breaks_the_worker_or_the_codec_fails_alone():
    async def main():
        async with open_engine(None, max_model_len=256) as engine:
            alone = await _last(engine, _params(24), "reference")
            outcomes = [
                await _hostile_beside_a_stream(engine, make(), make.__name__)
                for make in (_overflowing_temperature, _unencodable_seed)
            ]
            after = await _last(engine, _params(24), "after")
            assert not engine.is_dead
            assert engine.get_stats().num_running_reqs == 0
            return alone, outcomes, after

    alone, outcomes, after = trio.run(main)
    want = alone.outputs[0].token_ids
    assert len(want) == 24
    for long, hostile in outcomes:
        assert hostile.outputs[0].finish_reason == "abort"
        assert hostile.outputs[0].token_ids == []
        assert long.outputs[0].finish_reason == "length"
        assert long.outputs[0].token_ids == want  # unharmed, and unchanged
    assert after.outputs[0].token_ids == want
