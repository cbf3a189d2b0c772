"""-dp 2 --enable-expert-parallel: a step whose every request the worker refuses (a new
request its sampling tensors cannot take) still takes part in the other core's MoE exchanges.

The engine core counts that step as a forward (dp_lockstep.py), so its ranks must run every
MoE layer's exchanges with no tokens; without them the other core's rank waits in its
all-to-all until the collective timeout and the engine dies (one request harming another).
"""

from __future__ import annotations

import pytest
import trio
from expert_parallel_models import ODD_EXPERTS
from parallel_models import LIMITS
from parallel_reference import greedy

from trillm import SamplingParams


def _refused_by_the_worker() -> SamplingParams:
    params = SamplingParams(temperature=1.0, max_tokens=4)
    params.temperature = 1e39  # past float32, set after validation: the worker's write raises
    return params


def test_a_step_the_worker_refuses_whole_still_exchanges(tiny_model_factory):
    from trillm.engine.engine_startup import open_engine

    path = tiny_model_factory("mixtral", num_hidden_layers=2, **ODD_EXPERTS["mixtral"])

    async def main():
        async with open_engine(
            path,
            data_parallel_size=2,
            enable_expert_parallel=True,
            distributed_timeout_seconds=20,
            **LIMITS,
        ) as engine:
            with trio.fail_after(60):
                async with engine.generate("one two", greedy(24), "A") as a:
                    outs_a = [await a.__anext__()]
                    async with engine.generate("three four", _refused_by_the_worker(), "B") as b:
                        outs_b = [out async for out in b]
                    assert (engine.engine_index_of("A"), engine.router.routed) == (0, [1, 1])
                    outs_a += [out async for out in a]
                async with engine.generate("five six", greedy(4), "C") as c:
                    outs_c = [out async for out in c]
            assert not engine.is_dead
            return outs_a[-1], outs_b[-1], outs_c[-1]

    last_a, last_b, last_c = trio.run(main)
    assert last_b.outputs[0].finish_reason == "abort"
    assert last_b.outputs[0].token_ids == []
    assert last_a.outputs[0].finish_reason == "length"
    assert len(last_a.outputs[0].token_ids) == 24
    assert len(last_c.outputs[0].token_ids) == 4


def test_a_pooling_step_the_worker_refuses_whole_still_exchanges(tiny_model_factory):
    """The pooling runner's twin: two prompts embedded at once, one per core; core 1's worker
    refuses its prompt (``RefusingPoolingRunner``), core 0's is embedded, and the engine
    embeds on."""
    from trillm.engine.llm import LLM
    from trillm.errors import RequestFailedError

    path = tiny_model_factory("mixtral", num_hidden_layers=2, **ODD_EXPERTS["mixtral"])
    poison = [5, 6, 7, 8, 9]
    with LLM(
        path,
        convert="embed",
        runner="trillm.testing.refusing_runner:RefusingPoolingRunner",
        runner_kwargs={"refuse_prompt": poison},
        data_parallel_size=2,
        enable_expert_parallel=True,
        distributed_timeout_seconds=20,
        **LIMITS,
    ) as llm:
        with pytest.raises(RequestFailedError, match="ended without its vector"):
            llm.embed(["one two", {"prompt_token_ids": poison}], use_tqdm=False)
        assert llm.engine.router.routed == [1, 1]
        again = llm.embed(["one two", "three four"], use_tqdm=False)
        assert not llm.engine.is_dead
    assert [len(o.outputs.embedding) for o in again] == [64, 64]
