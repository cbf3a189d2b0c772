"""ModelRunner numerics against Hugging Face transformers on the same tiny random weights.

A small in-test scheduler allocates blocks and builds SchedulerOutput diffs, so the runner is
driven exactly as the engine drives it: all at once, in 7-token prefill chunks, and with a
shared prefix whose K/V another request left in the cache.
"""

from __future__ import annotations

import pytest
from runner_harness import (
    BLOCK_SIZE,
    MAX_NEW,
    MiniScheduler,
    Req,
    check_logprobs,
    greedy_params,
    load_hf,
    make_runner,
    random_prompts,
    transformers_greedy,
)

from trillm.messages import CachedRequestData, NewRequestData, SchedulerOutput
from trillm.testing.tiny_models import build_tiny_model

PROMPT_LENS = [3, 60, 17, 8, 33, 5, 41, 24, 9]

ARCHES = ["llama", "mistral", "qwen2", "qwen3"]
# Rope scaling variants: checked in the plain batched run (the rope is per position, so the
# chunked and prefix-cached paths exercise nothing rope-specific).
ROPE_VARIANTS = {
    "llama-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-llama3": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "llama-yarn": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 512,
            }
        },
    ),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=ARCHES)
def tiny(request, tmp_path_factory):
    path = build_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    return path, load_hf(path)


@pytest.fixture(scope="module")
def reference(tiny):
    _, hf = tiny
    return [transformers_greedy(hf, p, MAX_NEW)[0] for p in random_prompts(PROMPT_LENS)]


def _run_batch(path, chunk: int | None) -> list[list[int]]:
    sched = MiniScheduler(make_runner(path), chunk=chunk)
    reqs = [
        Req(f"r{i}", p, greedy_params(), MAX_NEW) for i, p in enumerate(random_prompts(PROMPT_LENS))
    ]
    for req in reqs:
        sched.add(req)
    sched.run()
    return [r.output for r in reqs]


@pytest.mark.parametrize("chunk", [None, 7], ids=["whole", "chunk7"])
def test_greedy_matches_transformers(tiny, reference, chunk):
    path, _ = tiny
    assert _run_batch(path, chunk) == reference


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_rope_scaling_greedy_matches_transformers(variant, tmp_path):
    arch, overrides = ROPE_VARIANTS[variant]
    path = build_tiny_model(arch, tmp_path / variant, **overrides)
    hf = load_hf(path)
    reference = [transformers_greedy(hf, p, MAX_NEW)[0] for p in random_prompts(PROMPT_LENS)]
    assert _run_batch(path, None) == reference


def test_shared_prefix_from_cache(tiny):
    path, hf = tiny
    runner = make_runner(path)
    sched = MiniScheduler(runner, chunk=16)
    shared = random_prompts([24], seed=7)[0]  # 3 full blocks
    first = Req("first", shared + [5, 6, 7], greedy_params(2), 2)
    sched.add(first)
    sched.run()
    prefix_blocks = first.blocks[: len(shared) // BLOCK_SIZE]
    suffixes = random_prompts([1, 9, 30, 4, 16, 2, 11, 20], seed=3)
    reqs = [Req(f"s{i}", shared + s, greedy_params(), MAX_NEW) for i, s in enumerate(suffixes)]
    for req in reqs:
        sched.add(req, prefix_blocks=prefix_blocks, num_computed=len(shared))
    sched.run()
    expected = [transformers_greedy(hf, r.prompt, MAX_NEW)[0] for r in reqs]
    assert [r.output for r in reqs] == expected


def test_logprobs_match_transformers(tiny):
    path, hf = tiny
    runner = make_runner(path)
    sched = MiniScheduler(runner, chunk=7)
    prompts = random_prompts([19, 6, 30], seed=11)
    reqs = [
        Req(f"l{i}", p, greedy_params(6, logprobs=3, prompt_logprobs=2), 6)
        for i, p in enumerate(prompts)
    ]
    plain = Req("plain", random_prompts([10], seed=12)[0], greedy_params(6), 6)
    for req in [*reqs, plain]:
        sched.add(req)
    sched.run()
    assert plain.logprobs == [] and plain.prompt_logprobs == []
    check_logprobs(hf, reqs, 6, k_prompt=2, k=3)


def test_step_with_only_finished_requests(tiny):
    path, _ = tiny
    runner = make_runner(path)
    sched = MiniScheduler(runner)
    reqs = [Req(f"f{i}", p, greedy_params(2), 2) for i, p in enumerate(random_prompts([4, 9]))]
    for req in reqs:
        sched.add(req)
    sched.run()
    assert len(runner.batch) == 2  # finished, but the runner hears of it next step
    sched.step()  # nothing scheduled: only the finished ids travel
    assert len(runner.batch) == 0
    assert runner.sampling_state.num_active == 0


def test_bitmask_restricts_only_its_request(tiny, reference):
    path, _ = tiny
    sched = MiniScheduler(make_runner(path))
    words = [0] * (4096 // 32)
    words[77 // 32] = 1 << (77 % 32)  # only token 77 allowed
    prompts = random_prompts(PROMPT_LENS)
    masked = Req("masked", prompts[0], greedy_params(3), 3)
    free = Req("free", prompts[1], greedy_params(3), 3)
    sched.add(masked)
    sched.add(free)
    while sched.active:
        sched.step(bitmask={"masked": words})
    assert masked.output == [77, 77, 77]
    assert free.output == reference[1][:3]


def test_a_request_that_makes_the_sampler_fail_fails_alone(tiny, reference):
    # A sampler failure caused by one request's row (injected here: the real sampler refuses
    # nothing that SamplingParams lets through) is retried row by row: that request alone is
    # reported failed, the others get exactly the tokens they get alone.
    path, _ = tiny
    runner = make_runner(path)
    real = runner.token_sampler.sampler

    def sampler(logits, state, slots, bitmask=None):
        if runner.batch.slot_of("bad") in slots.tolist():
            raise FloatingPointError("this row's parameters broke the sampler")
        return real(logits, state, slots, bitmask)

    runner.token_sampler.sampler = sampler
    prompts = random_prompts(PROMPT_LENS)
    good = Req("good", prompts[1], greedy_params(3), 3)
    bad = Req("bad", prompts[0], greedy_params(3), 3)
    sched = MiniScheduler(runner)
    sched.add(bad)
    sched.add(good)
    runner.execute_model(sched_output := _first_step(sched))
    out = runner.sample_tokens(None)
    assert list(out.failed) == ["bad"] and "FloatingPointError" in out.failed["bad"]
    by_id = dict(zip(out.req_ids, out.sampled_token_ids))
    assert by_id["bad"] == [] and by_id["good"] == reference[1][:1]
    assert sorted(out.req_ids) == sorted(sched_output.num_scheduled_tokens)


def _first_step(sched: MiniScheduler) -> SchedulerOutput:
    """The scheduler's first step as a SchedulerOutput, without running it."""
    new_reqs, scheduled = [], {}
    for req in sched.active:
        sched._grow(req, req.num_tokens)
        scheduled[req.req_id] = req.num_tokens
        req.sent = True
        new_reqs.append(NewRequestData(req.req_id, req.prompt, [], req.params, list(req.blocks), 0))
    return SchedulerOutput(0, new_reqs, CachedRequestData(), scheduled, sum(scheduled.values()))
