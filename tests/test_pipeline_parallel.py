"""Pipeline parallelism (issue 14): PP=2 and TP=2 x PP=2 give PP=1's greedy tokens, through the
Python API and over HTTP; each stage builds and loads only its layers; a killed stage-1 rank
takes the engine down cleanly; what has no pipeline path is refused by name.

The Llama has 3 layers (an uneven split: 1 + 2) and a head tied to its embedding (so the last
stage holds the embedding too); the Gemma 2 passes the residual stream as its hidden states
(the Llama passes hidden states and residual), with sliding windows and soft-capping. The PP=1
reference runs in-process ("uni").
"""

from __future__ import annotations

import os
import signal
import time
from functools import partial

import httpx
import pytest
import torch
from parallel_reference import greedy, http_greedy_tokens, reference_tokens
from server_harness import ServerProcess, open_request, read_until
from test_executor import pid_alive
from test_tensor_parallel import _shm_segments, _worker_ranks

from trillm.engine.llm import LLM
from trillm.sampling_params import SamplingParams

PROMPTS = ["Hello there, how", "The capital of France is", "1 2 3 1 2 3 1 2 3 1 2"]
MAX_TOKENS = 8
LIMITS = {"max_model_len": 128, "kv_cache_memory": "8MiB"}
# n-gram drafts: the last stage broadcasts a variable number of tokens per request.
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
            held[stage] = dict(model.named_parameters())
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
    assert others(set(held[1])) == others(read[1]) == {
        "model.embed_tokens.weight", "model.norm.weight"
    }  # fmt: skip


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


def test_tp2_x_pp2_matches_pp1(llama, pp1_tokens):
    """4 ranks: two stages of two tensor-parallel ranks each (slow on 2 cores: few tokens)."""
    got = generate(llama, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert got == pp1_tokens


def test_what_pp_cannot_do_is_refused_by_name(llama):
    with pytest.raises(ValueError, match="pipeline_parallel_size=4 is more stages than"):
        LLM(llama, pipeline_parallel_size=4, **LIMITS)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 with enable_lora"):
        LLM(llama, pipeline_parallel_size=2, enable_lora=True, **LIMITS)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 with a pooling runner"):
        LLM(llama, pipeline_parallel_size=2, runner="pooling", **LIMITS)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 with nnodes > 1"):
        LLM(llama, pipeline_parallel_size=2, tensor_parallel_size=2, nnodes=2, **LIMITS)
    draft = {"method": "draft_model", "model": llama, "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2 with a draft model \("):
        LLM(llama, pipeline_parallel_size=2, speculative_config=draft, **LIMITS)
    with pytest.raises(ValueError, match="pipeline_parallel_size > 1 needs .*'mp'"):
        LLM(llama, pipeline_parallel_size=2, distributed_executor_backend="uni", **LIMITS)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an integer >= 1"):
        LLM(llama, pipeline_parallel_size=0, **LIMITS)


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


def test_killed_stage1_rank_fails_requests_then_the_server_exits_clean(server):
    """The last stage's rank killed mid-generation: the stream ends with an error event, the
    other request with a 503, /health answers 503, the process exits 1 and leaves neither
    stage 0's worker nor a shared-memory segment behind."""
    ranks = _worker_ranks(server.proc.pid)
    assert sorted(ranks) == [0, 1]
    segments = _shm_segments(server.proc.pid)
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
