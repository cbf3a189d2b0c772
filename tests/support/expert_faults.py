"""A step that fails on one engine core under ``-dp 2 --enable-expert-parallel`` (the tests
of tests/parallel/test_expert_parallel_dp*.py): ``run_with_fault`` streams a request on core 0
while the poison prompt fails on core 1 (``failing_engine``: its workers'
``trillm.testing.failing_runner``);
``expected_tokens`` is the single-rank engine's greedy tokens of that request."""

from __future__ import annotations

import trio
from parallel_models import LIMITS
from parallel_reference import greedy

from trillm.engine.llm import LLM

POISON = [5, 6, 7, 8, 9]  # the prompt whose first step fails on core 1 (FailingRunner)
LONG = 24


def failing_engine(path: str, kwargs: dict, **layout):
    """``open_engine`` of ``path`` under -dp 2 -ep (``layout``: more of it), its workers'
    FailingRunner told ``kwargs`` (which prompt fails, where)."""
    from trillm.engine.engine_startup import open_engine

    return open_engine(
        path,
        runner="trillm.testing.failing_runner:FailingRunner",
        runner_kwargs=kwargs,
        data_parallel_size=2,
        enable_expert_parallel=True,
        distributed_timeout_seconds=20,
        **layout,
        **LIMITS,
    )


def run_with_fault(path: str, failure: dict, **layout) -> dict:
    """Request A streams on core 0; B (the poison prompt) is sent to core 1 after A's first
    token, so B's first forward fails while A decodes; then A's prompt again and a new one.
    -> the last outputs of each, and every rank's exit code after the close."""
    kwargs = {"fail_prompt": POISON, **failure}

    async def main() -> dict:
        async with failing_engine(path, kwargs, **layout) as engine:
            async with engine.generate("one two", greedy(LONG), "A") as a:
                first_a = await a.__anext__()
                async with engine.generate({"prompt_token_ids": POISON}, greedy(4), "B") as b:
                    outs_b = [out async for out in b]
                assert engine.router.routed == [1, 1]  # B went to core 1
                outs_a = [first_a] + [out async for out in a]
            async with engine.generate("one two", greedy(LONG), "A2") as again:
                outs_again = [out async for out in again]
            async with engine.generate("five six", greedy(4), "C") as c:
                outs_c = [out async for out in c]
        codes = [p.returncode for ex in engine.executors for p in ex.processes]
        last = {"a": outs_a, "b": outs_b, "again": outs_again, "c": outs_c}
        return {k: v[-1].outputs[0] for k, v in last.items()} | {"codes": codes}

    return trio.run(main)


def expected_tokens(path: str) -> list[int]:
    with LLM(path, distributed_executor_backend="uni", **LIMITS) as llm:
        return list(llm.generate(["one two"], greedy(LONG), use_tqdm=False)[0].outputs[0].token_ids)
