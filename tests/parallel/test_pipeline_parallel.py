"""Pipeline parallelism (issue 14): PP=2 and TP=2 x PP=2 give PP=1's greedy tokens, through the
Python API and over HTTP; with two micro-batches in flight (the batch queue) under preemption,
with mixed lengths, a single request, one batch in flight, and an abort while another batch
is in flight; each stage builds and loads only its layers; a killed stage-1 rank takes the
engine down cleanly; what has no pipeline path is refused by name.

The Llama has 3 layers (an uneven split: 1 + 2) and a head tied to its embedding (so the last
stage holds the embedding too); the Gemma 2 passes the residual stream as its hidden states
(the Llama passes hidden states and residual), with sliding windows and soft-capping. The PP=1
reference runs in-process ("uni").
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import httpx
import pytest
import torch
import trio
from parallel_reference import greedy, http_greedy_tokens, reference_tokens
from server_harness import ServerProcess, open_request, read_until
from worker_processes import pid_alive, shm_segments, worker_ranks

from trillm import open_engine
from trillm.engine.llm import LLM
from trillm.sampling_params import SamplingParams, StructuredOutputsParams

PROMPTS = ["Hello there, how", "The capital of France is", "1 2 3 1 2 3 1 2 3 1 2"]
MAX_TOKENS = 8
LIMITS = {"max_model_len": 128, "kv_cache_memory": "8MiB"}
# n-gram drafts: a variable number of the last stage's tokens per request reach stage 0.
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def llama(tiny_model_factory) -> str:
    return tiny_model_factory("llama", num_hidden_layers=3, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def gemma2(tiny_model_factory) -> str:
    return tiny_model_factory("gemma2", num_hidden_layers=2)


def generate(model: str, **kwargs) -> list[list[int]]:
    with LLM(model, **LIMITS, **kwargs) as llm:
        outs = llm.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def pp1_tokens(llama) -> list[list[int]]:
    return reference_tokens(llama, PROMPTS, MAX_TOKENS, **LIMITS)


# ---------------------------------------------------------------- what each stage holds


def test_each_stage_builds_and_loads_only_its_layers(llama):
    """Stage 0 of 2: the embedding and layer 0; stage 1: layers 1-2, the final norm, the head
    and (tied) the embedding. Each stage's parameters equal the checkpoint's tensors of the
    same name, and the other stage's tensors are never read."""
    from safetensors.torch import load_file

    from trillm.attention.selector import get_attention_backend
    from trillm.config import EngineArgs
    from trillm.distributed.pipeline import PipelineGroup, set_pp_group, stage_layers
    from trillm.engine.config_builder import build_config
    from trillm.model_executor.layers.linear import loaded_parameters
    from trillm.model_executor.loader import build_model, iterate_weights, safetensors_files

    config = build_config(EngineArgs(llama, device="cpu", **LIMITS))
    whole = load_file(safetensors_files(llama)[0])
    held, read = {}, {}
    try:
        for stage in (0, 1):
            start, end = stage_layers(3, 2, stage)
            pp = PipelineGroup(stage, 2, 0, 1, start, end)
            set_pp_group(pp)
            model = build_model(config.model, get_attention_backend("torch", "cpu"), "cpu")
            held[stage] = dict(loaded_parameters(model))  # packed weights read back
            wanted = partial(pp.wants_weight, tied=True)
            read[stage] = {name for name, _ in iterate_weights(llama, wanted=wanted)}
            for name, param in held[stage].items():
                if name in whole:  # (q/k/v and gate/up are stacked here)
                    assert torch.equal(param.detach(), whole[name]), name
    finally:
        set_pp_group(PipelineGroup())

    def layers(names: set[str]) -> set[str]:
        return {n.split(".")[2] for n in names if ".layers." in n}

    def others(names: set[str]) -> set[str]:
        return {n for n in names if ".layers." not in n}

    assert (stage_layers(3, 2, 0), stage_layers(3, 2, 1)) == ((0, 1), (1, 3))
    for stage, expected in ((0, {"0"}), (1, {"1", "2"})):
        assert layers(set(held[stage])) == layers(read[stage]) == expected
    assert others(set(held[0])) == others(read[0]) == {"model.embed_tokens.weight"}
    assert (
        others(set(held[1]))
        == others(read[1])
        == {"model.embed_tokens.weight", "model.norm.weight"}
    )


# ---------------------------------------------------------------- the Python API


def test_python_api_pp2_matches_pp1(llama, gemma2, pp1_tokens):
    """Greedy tokens equal PP=1's on both families; the Llama run also verifies n-gram drafts
    (several tokens per request per step cross from the last stage) and samples seeded
    requests in the same batch (the executor fails the engine if any rank's tokens differ
    from the last stage's, so their finishing shows the stages stayed in step)."""
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=7, ignore_eos=True)
    with LLM(llama, pipeline_parallel_size=2, speculative_config=NGRAM, **LIMITS) as llm:
        outs = llm.generate(PROMPTS * 2, [greedy(MAX_TOKENS)] * 3 + [sampled] * 3, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:3]] == pp1_tokens
    assert [len(o.outputs[0].token_ids) for o in outs[3:]] == [MAX_TOKENS] * 3
    reference = reference_tokens(gemma2, PROMPTS, MAX_TOKENS, **LIMITS)
    assert generate(gemma2, pipeline_parallel_size=2) == reference


def test_draft_model_on_the_last_stage_drafts_verified_across_stages(llama, pp1_tokens):
    """A draft model (the target's copy: its drafts are what the target samples) runs whole on
    the last stage, which proposes after sampling; every stage runs the verifying step's
    1 + d rows, and the accepted tokens reach stage 0 with a later step. Greedy tokens equal
    PP=1's, and the drafts were accepted."""
    draft = {"method": "draft_model", "model": llama, "num_speculative_tokens": 2}
    with LLM(llama, pipeline_parallel_size=2, speculative_config=draft, **LIMITS) as llm:
        outs = llm.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)
        spec = llm.engine.get_stats().spec_decoding
    assert [o.outputs[0].token_ids for o in outs] == pp1_tokens
    assert spec.num_draft_tokens >= 6, spec
    assert spec.num_accepted_tokens >= 0.9 * spec.num_draft_tokens, spec


def test_tp2_x_pp2_matches_pp1(llama, pp1_tokens):
    """4 ranks: two stages of two tensor-parallel ranks each (slow on 2 cores: few tokens)."""
    got = generate(llama, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert got == pp1_tokens


def test_what_pp_cannot_do_is_refused_by_name(llama):
    with pytest.raises(ValueError, match="pipeline_parallel_size=4 is more stages than"):
        LLM(llama, pipeline_parallel_size=4, **LIMITS)
    with pytest.raises(ValueError, match="pipeline_parallel_size > 1 needs .*'mp'"):
        LLM(llama, pipeline_parallel_size=2, distributed_executor_backend="uni", **LIMITS)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an integer >= 1"):
        LLM(llama, pipeline_parallel_size=0, **LIMITS)


# ---------------------------------------------------------------- micro-batches in flight

# 4 blocks of 16 tokens: one request of max_model_len fits, three of over 16 tokens do not, so
# requests are preempted (and recomputed) while other steps are in flight.
TINY_KV = {"max_model_len": 64, "num_gpu_blocks_override": 4}
MIXED_MAX_TOKENS = [24, 5, 24, 12, 2, 24]  # some finish while other batches are in flight
CONSTRAINED = 3  # this request's output follows a regex (its bitmask rides on its step)


def mixed_params() -> list[SamplingParams]:
    params = [
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MIXED_MAX_TOKENS
    ]
    params[CONSTRAINED].structured_outputs = StructuredOutputsParams(regex="[a-c]{3,6}")
    return params


def run_queued(llm: LLM, prompts: list[str], params) -> tuple[list[list[int]], int]:
    """-> (each prompt's tokens, the most steps in flight at once during the call)."""
    core = llm.engine.cores[0]
    before = Counter(core.batch_queue.depths)
    outs = llm.generate(prompts, params, use_tqdm=False)
    depths = core.batch_queue.depths - before
    return [o.outputs[0].token_ids for o in outs], max(depths, default=0)


def test_micro_batches_in_flight_match_pp1_under_preemption(llama):
    """PP=2 keeps two steps in flight over disjoint requests: six concurrent requests of mixed
    lengths, one of them constrained by a regex, under a cache too small for them
    (preemptions) give PP=1's greedy tokens under the same cache; a single request (fewer than
    two batches' worth) runs one step at a time and gives its PP=1 tokens too."""
    prompts = PROMPTS * 2
    with LLM(llama, distributed_executor_backend="uni", **TINY_KV) as llm:
        outs = llm.generate(prompts, mixed_params(), use_tqdm=False)
        reference = [o.outputs[0].token_ids for o in outs]
    assert re.fullmatch("[a-c]{3,6}", outs[CONSTRAINED].outputs[0].text)
    lengths = [len(t) for i, t in enumerate(reference) if i != CONSTRAINED]
    assert lengths == [n for i, n in enumerate(MIXED_MAX_TOKENS) if i != CONSTRAINED]
    with LLM(llama, pipeline_parallel_size=2, **TINY_KV) as llm:
        got, depth = run_queued(llm, prompts, mixed_params())
        assert got == reference
        assert depth == 2
        assert llm.engine.cores[0].scheduler.get_stats().num_preemptions > 0
        got, depth = run_queued(llm, prompts[:1], mixed_params()[0])
        assert got == reference[:1]
        assert depth == 1  # the only request is in the step in flight


def test_one_batch_in_flight_when_asked(llama, pp1_tokens, monkeypatch):
    """TRILLM_PP_MICRO_BATCHES=1 (the comparison the benchmark makes): the same tokens, never
    two steps in flight; a number outside 1..pipeline_parallel_size is refused by name."""
    monkeypatch.setenv("TRILLM_PP_MICRO_BATCHES", "1")
    with LLM(llama, pipeline_parallel_size=2, **LIMITS) as llm:
        got, depth = run_queued(llm, PROMPTS, greedy(MAX_TOKENS))
    assert (got, depth) == (pp1_tokens, 1)
    monkeypatch.setenv("TRILLM_PP_MICRO_BATCHES", "3")
    with pytest.raises(ValueError, match="TRILLM_PP_MICRO_BATCHES='3': must be an integer"):
        LLM(llama, pipeline_parallel_size=2, **LIMITS)


def test_a_step_failing_on_stage_0_fails_at_once_and_the_engine_serves_on(llama, pp1_tokens):
    """Stage 0's forward raises (a token id past the embedding, slipped past the frontend's
    check on purpose): it still hands stage 1 placeholder hidden states, so that step fails at
    once, its request alone ends, and the engine serves on (stage 1 used to wait in recv until
    the collective timeout, 120 s, and the engine then died)."""

    async def main():
        async with open_engine(llama, pipeline_parallel_size=2, **LIMITS) as engine:
            bad = await engine.preprocessor.prepare(PROMPTS[0], greedy(MAX_TOKENS))
            bad.prompt_token_ids[1] = 10**6  # stage 0's embedding raises IndexError
            start = time.monotonic()
            async with engine.generate(bad) as outputs:
                last = [out async for out in outputs][-1]
            elapsed = time.monotonic() - start
            after = []
            for prompt in PROMPTS:
                async with engine.generate(prompt, greedy(MAX_TOKENS)) as outputs:
                    after.append([out async for out in outputs][-1].outputs[0].token_ids)
            return last, elapsed, after, engine.is_dead

    last, elapsed, after, dead = trio.run(main)
    assert last.outputs[0].finish_reason == "abort" and last.outputs[0].token_ids == []
    assert elapsed < 30
    assert after == pp1_tokens and not dead


# ---------------------------------------------------------------- HTTP, then a killed stage


@pytest.fixture(scope="module")
def server(llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("pp-server") / "server.log"
    srv = ServerProcess(
        [llama, "-pp", "2", "--max-model-len", "128", "--kv-cache-memory", "8MiB"], log
    ).start()
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


def test_http_pp2_matches_pp1_token_for_token(server, pp1_tokens):
    assert http_greedy_tokens(server.base_url, PROMPTS, MAX_TOKENS) == pp1_tokens


def test_http_abort_while_another_batch_is_in_flight(server, pp1_tokens):
    """A stream whose client leaves mid-generation is aborted while the other requests' steps
    are in flight; they still get PP=1's tokens, and the server serves on."""
    streamed = open_request(
        server,
        "/v1/completions",
        {"prompt": "x", "max_tokens": 100, "ignore_eos": True, "stream": True},
    )
    read_until(streamed, b"data: {")

    def one(prompt: str) -> list[int]:
        body = {
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        r = httpx.post(server.base_url + "/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(one, p) for p in PROMPTS]
        time.sleep(0.3)
        streamed.close()  # the client leaves: the server aborts its request
        got = [f.result() for f in futures]
    assert got == pp1_tokens
    assert one(PROMPTS[0]) == pp1_tokens[0]


def test_killed_stage1_rank_fails_requests_then_the_server_exits_clean(server):
    """The last stage's rank killed mid-generation: the stream ends with an error event, the
    other request with a 503, /health answers 503, the process exits 1 and leaves neither
    stage 0's worker nor a shared-memory segment behind."""
    ranks = worker_ranks(server.proc.pid)
    assert sorted(ranks) == [0, 1]
    segments = shm_segments(server.proc.pid)
    assert segments
    body = {"prompt": "x", "max_tokens": 100, "ignore_eos": True}
    streamed = open_request(server, "/v1/completions", {**body, "stream": True})
    read_until(streamed, b"data: {")
    plain = open_request(server, "/v1/completions", body)
    time.sleep(0.2)
    os.kill(ranks[1], signal.SIGKILL)
    tail = read_until(streamed, b"[DONE]")
    assert b"ServiceUnavailableError" in tail and b"rank 1" in tail, tail
    assert read_until(plain, b"}}").startswith(b"HTTP/1.1 503")
    try:
        assert httpx.get(server.url + "/health", timeout=5).status_code == 503
    except httpx.ConnectError:
        pass  # already past the grace period and gone
    assert server.proc.wait(timeout=30) == 1, server.log()
    assert not pid_alive(ranks[0]) and not pid_alive(ranks[1])
    assert not any(os.path.exists(s) for s in segments)
