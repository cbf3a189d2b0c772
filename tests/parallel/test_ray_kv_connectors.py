"""The KV connectors and the offload tier on the Ray executor's ranks
(``distributed_executor_backend="ray"``), each rank a Ray actor, against the multiprocessing
executor's ranks: a TP=2 shared-storage producer writes the same files, byte for byte, and a
TP=2 consumer loads them (a rank's damaged share recomputed on both); the offload tier with
TP=2 loads an evicted prefix back with the same tokens, cached counts and bytes; a P2P TP=2
prefill instance on Ray actors serves ("GET") or pushes ("PUT") every rank's share. Greedy tokens equal the one-rank engine without a
connector. Skipped where Ray is not installed."""

from __future__ import annotations

import os

import pytest
from kv_connectors import (
    aligned,
    consecutive_free_ports,
    generate_with_ids,
    kv_engine,
    max_logprob_diff,
    p2p_ids,
    p2p_kv,
    run_rounds,
    shared_storage_kv,
)
from ray_marks import RAY_TESTS

from trillm import LLM, SamplingParams

LENGTHS = (40, 70, 9)  # 2, 4 and 0 whole blocks before the last prompt token
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
MOVED = sum(aligned(n) for n in LENGTHS)

pytestmark = [*RAY_TESTS, pytest.mark.usefixtures("one_torch_thread")]


def _prompts(first: int = 5) -> list[dict]:
    return [
        {"prompt_token_ids": list(range(first + i, first + i + n))} for i, n in enumerate(LENGTHS)
    ]


def _tokens(outs: list) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def _generate(engine: LLM, prompts: list[dict], ids: list[str] | None = None, params=PARAMS):
    """``prompts``' outputs (with these request ids when given: P2P reads its addresses there)."""
    if ids is None:
        return engine.generate(prompts, params, use_tqdm=False)
    return generate_with_ids(engine, prompts, ids, params)


def _ran(engine: LLM, prompts: list[dict], ids: list[str] | None = None, params=PARAMS):
    """(outputs, stats) of one batch, the engine shut down after."""
    try:
        return _generate(engine, prompts, ids, params), engine.engine.get_stats()
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def plain(tiny_model_factory):
    """(model path, the one-rank engine's outputs of ``_prompts()`` without a connector)."""
    path = tiny_model_factory("qwen2")
    return path, _ran(kv_engine(path), _prompts())[0]


def _folder(path: str, folder: str, backend: str) -> dict[str, bytes]:
    """A TP=2 producer on ``backend`` fills ``folder`` -> its files' names and bytes."""
    kv = shared_storage_kv("kv_producer", folder)
    engine = kv_engine(path, 2, 1, kv_transfer_config=kv, distributed_executor_backend=backend)
    _ran(engine, _prompts(), params=SamplingParams(max_tokens=1))
    files = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            files[name] = f.read()
    return files


def test_shared_storage_tp2_on_ray_actors_writes_mps_files_and_loads_them(
    plain, ray_cluster, tmp_path
):
    path, reference = plain
    on_mp = _folder(path, str(tmp_path / "mp"), "mp")
    on_ray = _folder(path, str(tmp_path / "ray"), "ray")
    assert len(on_ray) == 2 * sum(1 for n in LENGTHS if aligned(n))  # a file per rank
    assert on_ray == on_mp
    # rank 1's share of the first prompt damaged in place (header and size intact): rank 1's
    # worker finds it so, both ranks leave that prompt out and compute it
    first = next(n for n, b in on_ray.items() if n.endswith(".r1.kv") and b'"num_tokens": 32,' in b)
    with open(tmp_path / "ray" / first, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(bytes([on_ray[first][-1] ^ 0xFF]))
    kv = shared_storage_kv("kv_consumer", str(tmp_path / "ray"))
    consumer = kv_engine(path, 2, 1, kv_transfer_config=kv, distributed_executor_backend="ray")
    outs, stats = _ran(consumer, _prompts())
    assert _tokens(outs) == _tokens(reference)
    assert max_logprob_diff(outs, reference) < 1e-3
    assert [o.num_cached_tokens for o in outs] == [0, aligned(LENGTHS[1]), 0]
    assert stats.external_prefix_cache_hits == aligned(LENGTHS[1])
    assert stats.prompt_tokens_by_source["external_kv_transfer"] == aligned(LENGTHS[1])


# the offload tier: a cache of 20 blocks, which a 200-token prompt empties of an earlier one
A = list(range(10, 110))  # 100 tokens: 6 whole blocks before its last token
A2 = A[:70] + list(range(900, 925))  # A's first 4 blocks, then its own tokens
ROUNDS = ([A], [list(range(200, 400)), list(range(400, 560))], [A, A2])


def _offload_run(path: str, backend: str, tp: int = 2) -> tuple[list, list[int], object]:
    """(greedy tokens, cached prompt tokens, stats) of ROUNDS on a 0.01 GiB tier."""
    engine = LLM(
        path,
        max_model_len=256,
        num_gpu_blocks_override=20,
        block_size=16,
        tensor_parallel_size=tp,
        distributed_executor_backend=backend,
        kv_offloading_size=0.01,
    )
    return run_rounds(engine, ROUNDS, PARAMS)


def test_the_offload_tier_on_ray_actors_loads_as_on_mp_ranks(plain, ray_cluster):
    path, _ = plain
    tokens, cached, stats = _offload_run(path, "ray")
    mp_tokens, mp_cached, mp_stats = _offload_run(path, "mp")
    one_tokens, _, _ = _offload_run(path, "uni", tp=1)
    assert tokens == mp_tokens == one_tokens
    assert cached == mp_cached and cached[3:] == [96, 64]  # A's blocks came from the tier
    assert stats.prompt_tokens_by_source["external_kv_transfer"] == 96 + 64
    assert stats.kv_offload is not None and mp_stats.kv_offload is not None
    for kind in ("loads", "stores"):  # the same bytes moved, in as many operations
        got, mp = getattr(stats.kv_offload, kind), getattr(mp_stats.kv_offload, kind)
        assert (got.bytes, got.count) == (mp.bytes, mp.count) and got.bytes > 0
    assert stats.kv_offload.loads.seconds > 0  # each actor timed its copies


@pytest.mark.parametrize(("send_type", "decode_backend"), [("GET", "ray"), ("PUT", "mp")])
def test_p2p_tp2_from_ray_actors_moves_every_ranks_share(
    plain, ray_cluster, send_type, decode_backend
):
    """A TP=2 prefill instance on Ray actors: actor r serves ("GET", to a decode instance on
    Ray actors, whose actor r loads share r) or pushes ("PUT", to one on mp ranks) its share
    on port + r; every whole block loaded, the one-rank engine's tokens."""
    path, reference = plain
    prefill, decode = consecutive_free_ports(2), consecutive_free_ports(2)
    ids = p2p_ids(prefill, decode, send_type, len(LENGTHS))
    engines = [
        kv_engine(
            path,
            2,
            1,
            kv_transfer_config=p2p_kv(role, send_type, prefill, decode),
            distributed_executor_backend=backend,
        )
        for role, backend in (("kv_consumer", decode_backend), ("kv_producer", "ray"))
    ]
    consumer, producer = engines
    try:
        _generate(producer, _prompts(), ids, SamplingParams(max_tokens=1))
        outs, stats = _generate(consumer, _prompts(), ids), consumer.engine.get_stats()
    finally:
        for engine in engines:
            engine.shutdown()
    assert _tokens(outs) == _tokens(reference)
    assert max_logprob_diff(outs, reference) < 1e-3
    assert [o.num_cached_tokens for o in outs] == [aligned(n) for n in LENGTHS]
    assert stats.external_prefix_cache_hits == MOVED
    assert stats.prompt_tokens_by_source["external_kv_transfer"] == MOVED
