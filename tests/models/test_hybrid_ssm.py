"""Bamba (Mamba-2 layers around an attention layer) against transformers, and the per-request
state its Mamba layers keep (``trillm/attention/ssm_state.py``).

A tiny random Bamba in fp32 (SSD chunks of 8 positions, 2 groups of 4 heads, one attention
layer of 3): greedy tokens, sample logprobs and prompt logprobs equal transformers' for
prompts of 2 to 33 tokens batched together, prefilled whole or in 7-token chunks (so chunks
and SSD chunks never align); through the engine with a KV cache small enough to force
preemption and a token budget that chunks prompts; a request aborted mid-stream leaves its
slot to the next, which starts from a zero state. The same runs with the state not reset on a
fresh request, or reset at every chunk, give other tokens: the tests see those mistakes.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import trio
from engine_waves import two_waves
from hf_reference import hf_greedy
from runner_harness import (
    MiniScheduler,
    Req,
    check_logprobs,
    greedy_params,
    load_hf,
    make_runner,
    random_prompts,
    run_requests,
    transformers_greedy,
)

from trillm import SamplingParams, open_engine
from trillm.attention.ssm_state import SSMStateCache
from trillm.config import EngineArgs
from trillm.engine.config_builder import build_config
from trillm.model_executor import bamba_config
from trillm.model_executor.bamba_config import BambaConfigError
from trillm.testing.tiny_bamba import build_tiny_bamba

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LENS = [5, 19, 2, 33]  # within one SSD chunk of 8; across 3 and 5 of them
MAX_NEW = 10


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    path = build_tiny_bamba(tmp_path_factory.mktemp("bamba"))
    return str(path), load_hf(path)


@pytest.fixture(scope="module")
def runner(built):
    return make_runner(built[0])


# ---------------------------------------------------------------- greedy vs transformers


@pytest.mark.parametrize("chunk", [None, 7], ids=["whole", "chunked"])
def test_greedy_and_logprobs_equal_transformers(built, runner, chunk):
    _, hf = built
    prompts = random_prompts(LENS, seed=4)
    reqs = run_requests(runner, prompts, MAX_NEW, chunk=chunk, logprobs=2, prompt_logprobs=1)
    check_logprobs(hf, reqs, MAX_NEW, k_prompt=1, k=2)


def _max_logprob_diff(hf, reqs: list[Req]) -> float:
    worst = 0.0
    for req in reqs:
        _, logits = transformers_greedy(hf, req.prompt, MAX_NEW)
        ref = torch.log_softmax(logits, -1)
        ours = torch.tensor([row[0] for c in req.logprobs for row in c.logprobs])
        target = ref.gather(1, torch.tensor(req.output)[:, None])[:, 0]
        worst = max(worst, float((ours - target).abs().max()))
    return worst


def test_aborted_request_leaves_a_clean_slot(built, runner):
    """A request dropped mid-decode (``finished_req_ids``, as an abort sends it) frees its
    batch slot; the next request takes that slot and starts from a zero state."""
    _, hf = built
    first, second = random_prompts([21, 14], seed=8)
    sched = MiniScheduler(runner)
    aborted = Req("aborted", first, greedy_params(MAX_NEW, logprobs=0), MAX_NEW)
    sched.add(aborted)
    for _ in range(3):  # prefill and two decode steps
        sched.step()
    slot = runner.batch.slot_of("aborted")
    sched.active.remove(aborted)
    sched.finished.append("aborted")
    fresh = Req("next", second, greedy_params(MAX_NEW, logprobs=0), MAX_NEW)
    sched.add(fresh)
    sched.step()
    assert runner.batch.slot_of("next") == slot
    sched.run()
    assert fresh.output == transformers_greedy(hf, second, MAX_NEW)[0]
    assert _max_logprob_diff(hf, [fresh]) < 1e-4


_STEP = SSMStateCache.step


def _never_fresh(self, slots, context_lens, query_start_loc):
    """A mistake: a fresh request continues from whatever state its slot holds."""
    return _STEP(self, slots, context_lens + 1, query_start_loc)


def _always_fresh(self, slots, context_lens, query_start_loc):
    """A mistake: every chunk and decode step starts from a zero state."""
    return _STEP(self, slots, context_lens * 0, query_start_loc)


@pytest.mark.parametrize(
    ("rule", "chunk"), [(_never_fresh, None), (_always_fresh, 7)], ids=["stale", "restart"]
)
def test_the_wrong_state_rules_give_other_tokens(built, runner, monkeypatch, rule, chunk):
    _, hf = built
    prompts = random_prompts(LENS, seed=4)
    expected = [r.output for r in run_requests(runner, prompts, MAX_NEW, chunk=chunk)]
    monkeypatch.setattr(SSMStateCache, "step", rule)
    wrong = [r.output for r in run_requests(runner, prompts, MAX_NEW, chunk=chunk)]
    assert wrong != expected


# ---------------------------------------------------------------- through the engine

ENGINE = dict(
    dtype="float32",
    max_model_len=128,
    block_size=8,
    distributed_executor_backend="uni",
)


def test_engine_preempts_and_chunks(built):
    """Seven requests at once in 16 KV blocks (they need ~30): preempted requests are computed
    again from their prompt and outputs, from a zero state; 16-token budgets chunk the
    prompts, each chunk continuing from the state the previous one left. The second wave
    takes the slots the first left."""
    path, _ = built
    prompts = random_prompts([40, 9, 33, 1, 25, 17, 30], seed=3)  # 1: a one-token scan
    new = 2 * MAX_NEW
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    first, second, stats = two_waves(
        path, prompts, params, num_gpu_blocks_override=16, max_num_batched_tokens=16, **ENGINE
    )
    expected = [hf_greedy(path, p, new) for p in prompts]
    assert first == expected and second == expected
    assert stats.num_preemptions > 0, "the small KV cache should have forced preemption"


def test_engine_abort_then_the_slot_serves_the_next_request(built):
    """One state slot (max_num_seqs=1): a stream left after 3 of its 90 tokens is aborted
    (its slot held a decoded state), and the next request, in the same slot, equals
    transformers'."""
    path, _ = built
    first, second = random_prompts([30, 12], seed=9)
    long = SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)

    async def main():
        async with open_engine(path, max_num_seqs=1, **ENGINE) as engine:
            seen = 0
            async with engine.generate({"prompt_token_ids": first}, long, "left") as outputs:
                async for out in outputs:
                    seen = len(out.outputs[0].token_ids)
                    if seen >= 3:
                        break
            async with engine.generate({"prompt_token_ids": second}, params, "next") as outputs:
                async for out in outputs:
                    tokens = list(out.outputs[0].token_ids)
            return seen, tokens

    seen, tokens = trio.run(main)
    assert 3 <= seen < 90
    assert tokens == hf_greedy(path, second, MAX_NEW)


# ---------------------------------------------------------------- memory and configuration


def test_state_bytes_come_out_of_the_kv_budget(built):
    """Per request and Mamba layer: the conv state (3 x 192 channels, fp32) and the SSM state
    (8 heads x 16 x 16, fp32); the KV cache's budget pays for max_num_seqs of them; only the
    attention layer holds KV blocks."""
    path, _ = built
    runner = make_runner(path, max_num_seqs=4, num_gpu_blocks_override=None, kv_cache_memory="1MiB")
    layout = runner.ssm_layout
    assert layout is not None
    assert (layout.conv, layout.ssm, layout.num_layers, layout.kv_layers) == (
        (192, 3),
        (8, 16, 16),
        2,
        1,
    )
    per_request = 2 * (192 * 3 + 8 * 16 * 16) * 4
    assert layout.bytes_per_request(torch.float32) == per_request == 20_992
    assert runner.ssm_state_bytes() == 4 * per_request
    block = runner.kv_block_bytes()
    assert block == 1 * 2 * 2 * 16 * 8 * 4  # one layer, K and V, 2 heads of 16, 8 tokens
    assert runner.determine_num_blocks() == (2**20 - 4 * per_request) // block
    assert len(runner.kv_caches) == 1 and len(runner.ssm.conv) == 2


def test_prefix_caching_is_off_and_the_rest_refused(built):
    path, _ = built
    config = build_config(EngineArgs(model=path, device="cpu", max_model_len=128))
    assert not config.cache.enable_prefix_caching
    for name, value in (
        ("speculative_config", {"method": "ngram", "num_speculative_tokens": 2}),
        ("enable_lora", True),
        ("quantization", "fp8"),
    ):
        args = EngineArgs(model=path, device="cpu", max_model_len=128, **{name: value})
        with pytest.raises(ValueError, match=rf"BambaForCausalLM .*{name}=|{name}=.*Bamba"):
            build_config(args)


def test_every_transformers_config_field_is_decided():
    from transformers import BambaConfig

    fields = {f.name for f in dataclasses.fields(BambaConfig)}
    assert fields - set(bamba_config.FIELDS) == set()


def test_absent_keys_take_transformers_defaults():
    from transformers import BambaConfig

    hf = {
        "architectures": ["BambaForCausalLM"],
        "num_hidden_layers": 3,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "mamba_n_heads": 8,
        "attn_layer_indices": [2],
    }
    ours = bamba_config.prepare(hf, "BambaForCausalLM")
    theirs = BambaConfig(
        num_hidden_layers=3,
        hidden_size=64,
        num_attention_heads=4,
        mamba_n_heads=8,
        attn_layer_indices=[2],
    )
    for field in bamba_config._DEFAULTS:
        expected = getattr(theirs, field)
        got = ours[field]
        assert (list(got) if isinstance(got, tuple | list) else got) == (
            list(expected) if isinstance(expected, tuple | list) else expected
        ), field
    assert ours["layer_types"] == theirs.layers_block_type
    assert ours["rope_parameters"]["partial_rotary_factor"] == 0.5


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("time_step_limit", [0.001, 0.1], "time_step_limit"),
        ("time_step_limit", None, "time_step_limit"),
        ("mamba_n_groups", 3, "mamba_n_groups=3"),
        ("mamba_d_head", 12, "mamba_d_head=12"),
        ("mamba_n_heads", 7, "mamba_n_heads=7"),
        ("attn_layer_indices", [5], "attn_layer_indices"),
        ("layer_types", ["full_attention"] * 3, "layer_types"),
        ("mamba_chunk_size", 0, "mamba_chunk_size=0"),
    ],
)
def test_fields_trillm_would_not_run_as_transformers_are_refused(field, value, message):
    hf = {**_tiny_config(), field: value}
    with pytest.raises(BambaConfigError, match=message):
        bamba_config.prepare(hf, "BambaForCausalLM")


def test_infinity_as_transformers_writes_it_is_the_default_limit():
    hf = {**_tiny_config(), "time_step_limit": [0.0, {"__float__": "Infinity"}]}
    assert bamba_config.prepare(hf, "BambaForCausalLM")["time_step_limit"][1] == {
        "__float__": "Infinity"
    }
    hf["time_step_limit"] = [0.0, math.inf]
    bamba_config.prepare(hf, "BambaForCausalLM")


def _tiny_config() -> dict:
    from trillm.testing.tiny_bamba import BASE

    return {"architectures": ["BambaForCausalLM"], **BASE}
