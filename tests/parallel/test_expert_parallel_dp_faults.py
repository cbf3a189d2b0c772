"""A forward that fails inside one MoE layer's exchanges on one engine core's rank under
``-dp 2 --enable-expert-parallel`` (trillm/distributed/expert_step_faults.py): the failing
rank completes the layer's all-to-alls with the sizes already agreed and goes on with zeros,
every rank of every core agrees at the forward's end on whose step failed, and only those
requests end; the engine serves on and its close ends every rank with exit code 0.

Where the failure leaves the failing rank's experts able to run (its own tokens' side of the
layer), the other core's request keeps the single-rank engine's greedy tokens. Where the
experts' computation itself fails, the other core's tokens routed to those experts have no
output: their requests fail too (only they: the others keep their tokens), and the same
request sent again gets the single-rank tokens.
"""

from __future__ import annotations

import logging

import pytest
import trio
from expert_faults import POISON, expected_tokens, failing_engine, run_with_fault
from expert_parallel_models import ODD_EXPERTS
from parallel_models import LIMITS
from parallel_reference import greedy

from trillm.engine.llm import LLM

# Core 0's requests when core 1's experts fail (the router keeps 9 together): their prompt
# suffixes (see the last test) and length.
SUFFIXES = [1, 33, 45, 50, 54, 62, 63, 70, 78]
MANY = len(SUFFIXES)
A_TOKENS = 40


@pytest.fixture(scope="module")
def mixtral(tiny_model_factory):
    path = tiny_model_factory("mixtral", num_hidden_layers=2, **ODD_EXPERTS["mixtral"])
    return path, expected_tokens(path)


@pytest.mark.parametrize(
    "failure",
    [{"before_exchange": 2}, {"before_exchange": 3}, {"before_exchange": 8}],
    ids=["before-layer-1-rows", "before-layer-1-ids", "before-layer-2-combine"],
)
def test_a_failure_inside_a_layer_fails_only_its_cores_requests(mixtral, failure):
    """Core 1's rank fails between two exchanges of a layer (after the counts, its rows not
    sent; after its rows, its experts' ids not sent; or with its experts run, the combine
    not sent):
    B ends with an abort, A keeps the single-rank tokens, both serve on, every rank exits 0."""
    path, expected = mixtral
    got = run_with_fault(path, failure)
    assert got["b"].finish_reason == "abort"
    assert got["a"].finish_reason == "length"
    assert list(got["a"].token_ids) == expected
    assert list(got["again"].token_ids) == expected
    assert len(got["c"].token_ids) == 4
    assert got["codes"] == [0, 0], got["codes"]


def test_a_failure_in_the_experts_fails_the_request_routed_to_them(mixtral, caplog):
    """Core 1's rank's experts fail in the first MoE layer while A decodes on core 0: B ends
    with an abort; A, whose token went to those experts, ends with one too, its log naming
    why; A's prompt sent again gets the single-rank tokens, the engine serves on, every rank
    exits 0."""
    path, expected = mixtral
    with caplog.at_level(logging.ERROR, logger="trillm.engine.core"):
        got = run_with_fault(path, {"fail_experts": 1})
    assert got["b"].finish_reason == "abort"
    assert got["a"].finish_reason == "abort"
    assert list(got["a"].token_ids) == expected[: len(got["a"].token_ids)]
    why = (
        "the experts of Expert-parallel rank 1 (engine core 1, rank 0) failed in MoE layer 1 "
        "of this forward, and this request's tokens were routed to them"
    )
    assert why in caplog.text
    assert "told to fail in MoE layer 1's experts" in caplog.text  # core 1's own error
    assert list(got["again"].token_ids) == expected
    assert len(got["c"].token_ids) == 4
    assert got["codes"] == [0, 0], got["codes"]


def test_a_failure_on_one_tensor_parallel_rank_fails_its_whole_core(tmp_path):
    """-dp 2 -tp 2 -ep (DeepSeek-V3, 4 expert ranks): only core 1's second rank fails, inside
    the first MoE layer; its core's first rank (the one that samples) fails the step with it,
    core 0's request keeps the single-rank tokens, and every rank exits 0."""
    from trillm.testing.tiny_deepseek import build_tiny_deepseek

    path = build_tiny_deepseek(
        "v3", tmp_path, num_hidden_layers=2, moe_intermediate_size=31, n_shared_experts=2
    )
    expected = expected_tokens(str(path))
    failure = {"before_exchange": 2, "fail_rank": 1}
    got = run_with_fault(str(path), failure, tensor_parallel_size=2)
    assert got["b"].finish_reason == "abort"
    assert got["a"].finish_reason == "length"
    assert list(got["a"].token_ids) == expected
    assert list(got["again"].token_ids) == expected
    assert len(got["c"].token_ids) == 4
    assert got["codes"] == [0, 0, 0, 0], got["codes"]


def test_an_experts_failure_fails_only_the_requests_routed_to_them(mixtral):
    """MANY requests decode on core 0 (one shared first block keeps them there) when core
    1's rank's experts fail in the first MoE layer (B's first step): B ends with an abort
    (its core's step failed); of core 0's requests those whose token went to those experts
    end with an abort too (the log names why), the others keep their single-rank greedy
    tokens (a request's attention reads only its own tokens), and an aborted one sent again
    equals.

    Which of the A's are lost depends only on their decode position L at B's step (a token's
    route in layer 1 is a function of its request's own tokens), so the engine is paused
    twice to make L one number for all of them: the A's are admitted together at a resume
    (one prefill step), and B is admitted while they are paused at some L in 1..A_TOKENS-1.
    For this seed's model and these prompt suffixes (``SUFFIXES``, picked from 80 by
    transformers' routing of every decode position: top-2 of 4 experts, 2 per rank, a
    token avoids rank 1's experts ~20% of the time), at every L in 1..39 at least one A's
    token avoids them and at least two go to them, each with a router-logit margin >= 0.003
    between the deciding experts (so float differences between the layouts cannot flip
    it): ``0 < lost < MANY`` holds at every L, whatever the timing. Every lost A was lost in
    that one step, so all have the same length."""
    path, _ = mixtral
    shared = list(range(100, 116))  # one full block: the router's prefix affinity
    prompts = [{"prompt_token_ids": shared + [200 + i, 300 + i]} for i in SUFFIXES]
    with LLM(path, distributed_executor_backend="uni", **LIMITS) as llm:
        outs = llm.generate(prompts, greedy(A_TOKENS), use_tqdm=False)
        expected = [list(o.outputs[0].token_ids) for o in outs]
    kwargs = {"fail_prompt": POISON, "fail_experts": 1}

    async def main():
        async with failing_engine(path, kwargs) as engine:
            cores = engine.engine_cores.cores
            got: list = [None] * MANY
            first = trio.Event()

            async def one(i: int) -> None:
                async with engine.generate(prompts[i], greedy(A_TOKENS), f"A{i}") as a:
                    outs = [await a.__anext__()]
                    first.set()
                    outs += [out async for out in a]
                got[i] = outs[-1].outputs[0]

            async def admitted(core: int, waiting: int) -> None:
                with trio.fail_after(30):
                    while cores[core].scheduler.num_waiting < waiting:
                        await trio.sleep(0.01)

            async with trio.open_nursery() as nursery:
                await engine.pause_generation(mode="keep", clear_cache=False)
                for i in range(MANY):
                    nursery.start_soon(one, i)
                await admitted(0, MANY)
                await engine.resume_generation()  # the A's prefill in one step
                await first.wait()
                await engine.pause_generation(mode="keep", clear_cache=False)
                running = cores[0].scheduler.get_request_counts()[0]
                poison = {"prompt_token_ids": POISON}
                async with engine.generate(poison, greedy(4), "B") as b:
                    await admitted(1, 1)
                    await engine.resume_generation()  # B's first step: the A's at one L
                    last_b = [out async for out in b][-1].outputs[0]
            routed = list(engine.router.routed)
            lost = [i for i in range(MANY) if got[i].finish_reason == "abort"]
            again = None
            if lost:
                async with engine.generate(prompts[lost[0]], greedy(A_TOKENS), "again") as a:
                    again = [out async for out in a][-1].outputs[0]
        codes = [p.returncode for ex in engine.executors for p in ex.processes]
        return got, last_b, routed, running, lost, again, codes

    got, last_b, routed, running, lost, again, codes = trio.run(main)
    assert routed == [MANY, 1], routed  # the A's on core 0, B on core 1
    assert running == MANY, running  # none had ended before B's step
    assert last_b.finish_reason == "abort"
    for i, out in enumerate(got):
        if i in lost:
            assert list(out.token_ids) == expected[i][: len(out.token_ids)]
        else:
            assert out.finish_reason == "length"
            assert list(out.token_ids) == expected[i]
    assert 0 < len(lost) < MANY, [g.finish_reason for g in got]
    assert len({len(got[i].token_ids) for i in lost}) == 1, [len(g.token_ids) for g in got]
    assert list(again.token_ids) == expected[lost[0]]
    assert codes == [0, 0], codes
