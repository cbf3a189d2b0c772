"""Prompt embeddings (``--enable-prompt-embeds``) through the Python API on a tiny random
Llama: ``LLM.generate({"prompt_embeds": embed_tokens(ids)})`` is greedy-equal to the same ids
given as tokens (tokens and logprobs) and to transformers, batched with token prompts and
prefilled in chunks, through preemption; the prefix cache hits a repeated embeddings prompt
and only that; bad tensors and what cannot be served with embeddings are refused by name."""

from __future__ import annotations

import pytest
import torch
from hf_reference import hf_greedy, load_hf_model

from trillm import LLM, SamplingParams
from trillm.config.engine_args import EngineArgs
from trillm.engine.config_builder import build_config
from trillm.sampling_params import BeamSearchParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_NEW = 8
BUDGET = 16  # max_num_batched_tokens: longer prompts are prefilled in chunks
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
LENS = [5, 37, 21, 44]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from trillm.testing.tiny_models import build_tiny_model

    return str(build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama-embeds")))


@pytest.fixture(scope="module")
def llm(path):
    engine = LLM(
        path,
        max_model_len=64,
        num_gpu_blocks_override=5,  # 80 token slots for ~240 wanted at once: preemption
        max_num_batched_tokens=BUDGET,
        enable_prompt_embeds=True,
        distributed_executor_backend="uni",
    )
    yield engine
    engine.shutdown()


def prompt_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 4000, (n,), generator=g).tolist()


def embeds(path: str, ids: list[int]) -> torch.Tensor:
    """transformers' input embeddings of ``ids`` [n, hidden]."""
    with torch.no_grad():
        return load_hf_model(path).get_input_embeddings()(torch.tensor(ids)).clone()


def sampled(out) -> tuple[list[int], list[float]]:
    sample = out.outputs[0]
    chosen = [lp[t].logprob for t, lp in zip(sample.token_ids, sample.logprobs, strict=True)]
    return list(sample.token_ids), chosen


def test_embeds_equal_their_tokens_batched_chunked_and_preempted(llm, path):
    ids = [prompt_ids(n, seed) for seed, n in enumerate(LENS)]
    prompts = []
    for p in ids:  # each prompt twice in one batch: as embeddings and as tokens
        prompts += [{"prompt_embeds": embeds(path, p)}, {"prompt_token_ids": p}]
    stats_before = llm.engine.get_stats().num_preemptions
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.get_stats().num_preemptions > stats_before
    worst = 0.0
    for i, p in enumerate(ids):
        by_embeds, by_tokens = outs[2 * i], outs[2 * i + 1]
        assert len(by_embeds.prompt_token_ids) == len(p)
        tokens, logprobs = sampled(by_embeds)
        ref_tokens, ref_logprobs = sampled(by_tokens)
        assert tokens == ref_tokens == hf_greedy(path, p, MAX_NEW)
        worst = max(worst, *(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True)))
    assert worst < 1e-4, worst


def test_prefix_cache_hits_the_same_embeddings_only(llm, path):
    rows = embeds(path, prompt_ids(40, 11))
    params = SamplingParams(temperature=0.0, max_tokens=2)
    first = llm.generate({"prompt_embeds": rows}, params, use_tqdm=False)[0]
    again = llm.generate({"prompt_embeds": rows.clone()}, params, use_tqdm=False)[0]
    other = rows.clone()
    other[0] += 0.25  # one value of the first row differs
    changed = llm.generate({"prompt_embeds": other}, params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 32  # two full blocks of 16
    assert changed.num_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_bf16_and_f16_rows_are_taken(llm, path):
    p = prompt_ids(9, 21)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    rows = embeds(path, p)
    want = llm.generate({"prompt_embeds": rows}, params, use_tqdm=False)[0].outputs[0]
    for dtype in (torch.bfloat16, torch.float16):
        got = llm.generate({"prompt_embeds": rows.to(dtype)}, params, use_tqdm=False)[0]
        assert len(got.outputs[0].token_ids) == 4 and got.prompt_token_ids == [0] * 9
    assert len(want.token_ids) == 4


def test_truncate_prompt_tokens_keeps_the_last_rows(llm, path):
    p = prompt_ids(30, 31)
    params = SamplingParams(temperature=0.0, max_tokens=4, truncate_prompt_tokens=12)
    got = llm.generate({"prompt_embeds": embeds(path, p)}, params, use_tqdm=False)[0]
    want = llm.generate({"prompt_token_ids": p[-12:]}, params, use_tqdm=False)[0]
    assert len(got.prompt_token_ids) == 12
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


BAD = {
    "an int64 tensor": (torch.zeros(3, 64, dtype=torch.int64), "float32, bfloat16 or float16"),
    "a float64 tensor": (torch.zeros(3, 64, dtype=torch.float64), "float32, bfloat16 or float16"),
    "one dimension": (torch.zeros(64), "shape [num_tokens, 64]"),
    "a wrong width": (torch.zeros(3, 65), "shape [num_tokens, 64]"),
    "no rows": (torch.zeros(0, 64), "shape [num_tokens, 64]"),
    "a batch dimension": (torch.zeros(1, 3, 64), "shape [num_tokens, 64]"),
    "NaN": (torch.full((3, 64), float("nan")), "NaN or infinite"),
    "infinity": (torch.full((3, 64), float("inf")), "NaN or infinite"),
    "more rows than the context": (torch.zeros(65, 64), "maximum context length (64)"),
    "a list": ([[0.0] * 64], "dense torch tensor"),
    "a sparse tensor": (torch.zeros(3, 64).to_sparse(), "dense torch tensor"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_tensors_are_refused_naming_prompt_embeds(llm, case):
    value, words = BAD[case]
    with pytest.raises(ValueError, match="prompt_embeds") as info:
        llm.generate({"prompt_embeds": value}, GREEDY, use_tqdm=False)
    assert words in str(info.value)
    assert info.value.param == "prompt_embeds"


def test_what_embeddings_cannot_serve_is_refused_by_name(llm, path):
    rows = embeds(path, prompt_ids(6, 41))
    with pytest.raises(ValueError, match="prompt_logprobs is not supported with prompt_embeds"):
        llm.generate({"prompt_embeds": rows}, SamplingParams(prompt_logprobs=1), use_tqdm=False)
    with pytest.raises(ValueError, match=r"takes no other keys, got \['multi_modal_data'\]"):
        llm.generate({"prompt_embeds": rows, "multi_modal_data": {}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="Beam search does not take prompt_embeds"):
        llm.beam_search([{"prompt_embeds": rows}], BeamSearchParams(beam_width=2, max_tokens=2))


def test_refused_without_the_flag_and_where_the_model_cannot_take_them(path, tmp_path):
    from trillm.testing.tiny_models import build_tiny_model

    engine = LLM(path, max_model_len=64, kv_cache_memory="4MiB", distributed_executor_backend="uni")
    try:
        with pytest.raises(ValueError, match="--enable-prompt-embeds") as info:
            engine.generate({"prompt_embeds": torch.zeros(3, 64)}, GREEDY, use_tqdm=False)
        assert info.value.param == "prompt_embeds"
    finally:
        engine.shutdown()
    gemma = str(build_tiny_model("gemma", tmp_path / "gemma"))
    with pytest.raises(ValueError, match="--enable-prompt-embeds: GemmaForCausalLM does not"):
        build_config(EngineArgs(model=gemma, enable_prompt_embeds=True))
    with pytest.raises(ValueError, match="--enable-prompt-embeds: pipeline parallelism"):
        build_config(EngineArgs(model=path, enable_prompt_embeds=True, pipeline_parallel_size=2))
