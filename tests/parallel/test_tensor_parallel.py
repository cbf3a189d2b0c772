"""Tensor parallelism (issue 14): TP=2 gives TP=1's greedy tokens, through the Python API and
over HTTP, and a rank that dies or stops answering takes the engine down cleanly.

One model covers the sharding cases: a Llama with one KV head (replicated on both ranks, each
with half the query heads), biases on every projection (the row-parallel biases of o_proj and
down_proj must be added once), 4099 vocabulary rows (the last rank's shard is padded) and
tied embeddings (the vocabulary shard is the head's too). The TP=1 reference runs in-process
("uni"). The two ranks share this machine's cores (each worker takes cores // 2 threads).
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import torch
import trio
from parallel_reference import (
    LIMITS,
    MAX_TOKENS,
    PROMPTS,
    SHARDED_LLAMA,
    greedy,
    http_greedy_tokens,
    reference_tokens,
)
from scheduler_driver import Driver
from server_harness import ServerProcess, open_request, read_until
from worker_processes import pid_alive, shm_exists, shm_segments, worker_ranks

from trillm.engine.llm import LLM
from trillm.errors import EngineDeadError
from trillm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llama(tiny_model_factory) -> str:
    return tiny_model_factory("llama", **SHARDED_LLAMA)


@pytest.fixture(scope="module")
def tp1_tokens(llama) -> list[list[int]]:
    return reference_tokens(llama)


# ---------------------------------------------------------------- sharded loading


def test_each_rank_reads_only_its_slice_of_each_tensor(llama):
    """``iterate_weights`` with a rank's shapes: q/k/v rows, o_proj columns, vocabulary rows
    (padded on the last rank), the row-parallel bias on rank 0 only; every rank's slices are
    the matching parts of the whole tensors, and together smaller than them."""
    from safetensors.torch import load_file

    from trillm.config import EngineArgs
    from trillm.distributed.sharding import RankShapes
    from trillm.model_executor.loader import iterate_weights, safetensors_files
    from trillm.model_executor.model_config import load_model_config

    cfg = load_model_config(EngineArgs(llama))
    whole = load_file(safetensors_files(llama)[0])
    layer = "model.layers.0."
    for rank in (0, 1):
        shapes = RankShapes.of(cfg, rank, 2)
        part = dict(iterate_weights(llama, shard=(cfg, shapes)))
        half_q = cfg.num_attention_heads // 2 * cfg.head_dim
        q = slice(rank * half_q, (rank + 1) * half_q)
        assert torch.equal(
            part[layer + "self_attn.q_proj.weight"], whole[layer + "self_attn.q_proj.weight"][q]
        )
        assert torch.equal(
            part[layer + "self_attn.k_proj.weight"], whole[layer + "self_attn.k_proj.weight"]
        )  # 1 KV head: replicated
        assert torch.equal(
            part[layer + "self_attn.o_proj.weight"], whole[layer + "self_attn.o_proj.weight"][:, q]
        )
        bias = part[layer + "mlp.down_proj.bias"]
        assert torch.equal(
            bias, whole[layer + "mlp.down_proj.bias"] if rank == 0 else torch.zeros_like(bias)
        )
        emb = part["model.embed_tokens.weight"]  # 4099 rows -> 2050 per rank
        assert emb.shape[0] == 2050
        rows = whole["model.embed_tokens.weight"][rank * 2050 : (rank + 1) * 2050]
        assert torch.equal(emb[: len(rows)], rows) and not emb[len(rows) :].any()
        assert sum(t.numel() for t in part.values()) < 0.6 * sum(t.numel() for t in whole.values())


# ---------------------------------------------------------------- the Python API


def test_python_api_tp2_matches_tp1(llama, tp1_tokens):
    """Greedy tokens equal TP=1's. Seeded and unseeded sampled requests ride in the same
    batch: every rank samples, and the executor fails the engine if any rank's tokens differ
    from rank 0's, so their finishing shows the ranks stayed in step."""
    sampled = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, n=2, ignore_eos=True),
    ]
    with LLM(llama, tensor_parallel_size=2, **LIMITS) as llm:
        outs = llm.generate(PROMPTS + PROMPTS[:2], [greedy()] * 3 + sampled, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:3]] == tp1_tokens
    assert [len(c.token_ids) for o in outs[3:] for c in o.outputs] == [MAX_TOKENS] * 3


@pytest.mark.parametrize("pp", [1, 2])
def test_draft_model_on_the_output_rank_with_tp2(llama, tp1_tokens, pp):
    """A draft model (the target's copy) is built whole on the output rank only (the last
    stage's first tensor-parallel rank), beside its shard of the target; every rank verifies
    the drafts the next step carries. Greedy tokens equal TP=1's without a draft, >= 90% of
    the drafts are accepted (the sharded target's sums differ from the whole draft's only in
    order), and a seeded sampled request finishes (the executor fails the engine if the
    ranks' verified tokens differ). With pp=2: TP=2 x PP=2, four ranks."""
    draft = {"method": "draft_model", "model": llama, "num_speculative_tokens": 2}
    seeded = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=7, ignore_eos=True)
    with LLM(
        llama, tensor_parallel_size=2, pipeline_parallel_size=pp, speculative_config=draft, **LIMITS
    ) as llm:
        outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        spec = llm.engine.get_stats().spec_decoding  # the greedy requests' (a sampled
        # request's one-hot drafts are accepted with the target's probability, < 1)
        (sampled,) = llm.generate(PROMPTS[:1], seeded, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == tp1_tokens
    assert len(sampled.outputs[0].token_ids) == MAX_TOKENS
    assert spec.num_draft_tokens >= 6, spec
    assert spec.num_accepted_tokens >= 0.9 * spec.num_draft_tokens, spec


def test_tp_size_the_model_cannot_split_is_refused(llama):
    # 4 query heads do not split over 3 ranks; refused before any worker starts.
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide"):
        LLM(llama, tensor_parallel_size=3, **LIMITS)


# ---------------------------------------------------------------- HTTP, then a killed rank


@pytest.fixture(scope="module")
def server(llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("tp-server") / "server.log"
    srv = ServerProcess(
        [
            llama,
            "--tensor-parallel-size",
            "2",
            "--max-model-len",
            "256",
            "--kv-cache-memory",
            "16MiB",
        ],
        log,
    ).start()
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


def test_http_tp2_matches_tp1_token_for_token(server, tp1_tokens):
    assert http_greedy_tokens(server.base_url) == tp1_tokens


def test_killed_rank1_fails_requests_then_the_server_exits_clean(server):
    """Rank 1 killed mid-generation: the stream ends with an error event, the other request
    with a 503, /health answers 503, the process exits 1 and leaves neither rank 0's worker
    nor a shared-memory segment behind."""
    ranks = worker_ranks(server.proc.pid)
    assert sorted(ranks) == [0, 1]
    segments = shm_segments(server.proc.pid)
    assert segments
    body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True}
    streamed = open_request(server, "/v1/completions", {**body, "stream": True})
    read_until(streamed, b"data: {")
    plain = open_request(server, "/v1/completions", body)
    time.sleep(0.2)
    os.kill(ranks[1], signal.SIGKILL)
    tail = read_until(streamed, b"[DONE]")
    assert b"ServiceUnavailableError" in tail and b"rank 1" in tail
    assert read_until(plain, b"}}").startswith(b"HTTP/1.1 503")
    try:
        assert httpx.get(server.url + "/health", timeout=5).status_code == 503
    except httpx.ConnectError:
        pass  # already past the grace period and gone
    assert server.proc.wait(timeout=30) == 1, server.log()
    assert not pid_alive(ranks[0]) and not pid_alive(ranks[1])
    assert not any(os.path.exists(s) for s in segments)


# ---------------------------------------------------------------- a rank that stops answering


def test_stuck_rank_times_out_the_collective_and_is_named(llama):
    """Rank 1 stopped (SIGSTOP) before a step: rank 0 waits in the first all-reduce until the
    group's timeout, reports it and exits; the executor names rank 1 as the one that stopped
    answering, kills it and unlinks the rings."""
    from trillm.config import EngineArgs
    from trillm.engine.config_builder import build_config
    from trillm.executor.abstract import DEFAULT_RUNNER
    from trillm.executor.factory import open_executor

    config = build_config(
        EngineArgs(llama, tensor_parallel_size=2, distributed_timeout_seconds=3, **LIMITS)
    )

    async def main():
        async with open_executor(config, DEFAULT_RUNNER) as ex:
            names, procs = ex.segment_names, list(ex.processes)
            os.kill(procs[1].pid, signal.SIGSTOP)
            await ex.execute_model(Driver({"a": 5}).step())
            with trio.fail_after(60), pytest.raises(EngineDeadError) as info:
                await ex.sample_tokens(None)
            assert not any(shm_exists(n) for n in names)
        return str(info.value), procs

    message, procs = trio.run(main)
    assert "rank(s) [1] stopped answering; rank(s) [0] waited 3 s" in message, message
    assert "all_reduce" in message
    assert procs[1].returncode == -signal.SIGKILL
    assert not any(pid_alive(p.pid) for p in procs)


def test_the_rendezvous_port_is_held_from_its_pick_until_rank_0_serves_it(
    llama, tp1_tokens, monkeypatch
):
    """The executor binds the rendezvous port and rank 0 inherits the listening socket: no
    other program can take the port between its pick and rank 0's store (a port picked, closed
    and bound again later once lost that race under a busy test run: EADDRINUSE at startup).
    Here a second socket tries to take the port the moment it is picked, and fails; the
    engine starts anyway and gives TP=1's tokens."""
    import errno
    import socket

    from trillm.executor import multiproc

    picked, refused = [], []
    real = multiproc.rendezvous_listener

    def listener_then_thief() -> socket.socket:
        sock = real()
        port = sock.getsockname()[1]
        picked.append(port)
        with socket.socket() as thief:
            try:
                thief.bind(("127.0.0.1", port))
            except OSError as exc:
                refused.append(exc.errno)
        return sock

    monkeypatch.setattr(multiproc, "rendezvous_listener", listener_then_thief)
    with LLM(llama, tensor_parallel_size=2, **LIMITS) as llm:
        outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert len(picked) == 1 and refused == [errno.EADDRINUSE]
    assert [o.outputs[0].token_ids for o in outs] == tp1_tokens
