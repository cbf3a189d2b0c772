"""vLLM's SharedStorageConnector (--kv-transfer-config): a producer engine saves its prompts'
KV blocks to a folder, a consumer engine loads them instead of computing them. The consumer's
greedy tokens equal transformers' and its logprobs the plain engine's; a damaged file, or one
written for another cache layout, is recomputed."""

from __future__ import annotations

import logging
import os

import pytest
from hf_reference import hf_greedy
from kv_connectors import BLOCK, aligned, kv_engine, max_logprob_diff, shared_storage_kv

from trillm import LLM, SamplingParams
from trillm.kv_transfer.config import parse_kv_transfer_config
from trillm.kv_transfer.storage import HEADER_READ_BYTES

LENGTHS = (40, 17, 70, 9)  # 2, 1, 4 and 0 whole blocks before the last prompt token
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)


def _prompts() -> list[dict]:
    return [{"prompt_token_ids": list(range(5 + i, 5 + i + n))} for i, n in enumerate(LENGTHS)]


def _run(engine: LLM, params: SamplingParams = PARAMS) -> list:
    try:
        return engine.generate(_prompts(), params, use_tqdm=False)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def stored(tiny_model_factory, tmp_path_factory):
    """(model path, folder the producer filled, the plain engine's outputs)."""
    path = tiny_model_factory("qwen2")
    folder = str(tmp_path_factory.mktemp("kv-store"))
    plain = _run(kv_engine(path))
    _run(
        kv_engine(path, kv_transfer_config=shared_storage_kv("kv_producer", folder)),
        SamplingParams(max_tokens=1),
    )
    return path, folder, plain


def test_the_producer_writes_one_file_per_prompt_with_a_whole_block(stored):
    _, folder, _ = stored
    assert len(os.listdir(folder)) == sum(1 for n in LENGTHS if aligned(n) > 0)


@pytest.mark.parametrize("chunk", [None, 7])
def test_the_consumer_loads_the_prompts_and_matches(stored, chunk):
    path, folder, plain = stored
    extra = {} if chunk is None else {"long_prefill_token_threshold": chunk}
    outs = _run(
        kv_engine(path, kv_transfer_config=shared_storage_kv("kv_consumer", folder), **extra)
    )
    for prompt, out, ref in zip(_prompts(), outs, plain, strict=True):
        ids = prompt["prompt_token_ids"]
        assert out.outputs[0].token_ids == hf_greedy(path, ids, PARAMS.max_tokens)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        # the loaded tokens count as cached, as in vLLM: only the rest was computed
        assert out.num_cached_tokens == aligned(len(ids))
    assert max_logprob_diff(outs, plain) < 1e-4


def test_a_truncated_file_is_recomputed(stored, tmp_path):
    path, folder, plain = stored
    damaged = str(tmp_path / "store")
    os.mkdir(damaged)
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as src:
            data = src.read()
        with open(os.path.join(damaged, name), "wb") as dst:
            dst.write(data[: len(data) - 1] if name == sorted(os.listdir(folder))[0] else data)
    outs = _run(kv_engine(path, kv_transfer_config=shared_storage_kv("kv_consumer", damaged)))
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in plain]
    cached = sorted(o.num_cached_tokens for o in outs)
    expected = sorted(aligned(n) for n in LENGTHS)
    assert sum(cached) < sum(expected)  # one prompt found no usable file
    assert max_logprob_diff(outs, plain) < 1e-4


def test_another_cache_layout_finds_no_file(stored):
    path, folder, plain = stored
    outs = _run(
        LLM(
            path,
            max_model_len=256,
            kv_cache_memory="8MiB",
            block_size=2 * BLOCK,
            distributed_executor_backend="uni",
            kv_transfer_config=shared_storage_kv("kv_consumer", folder),
        )
    )
    assert [o.num_cached_tokens for o in outs] == [0] * len(LENGTHS)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in plain]


def test_a_payload_damaged_after_the_lookup_is_recomputed(stored, tmp_path, caplog):
    """vLLM's kv_load_failure_policy "recompute": the scheduler's lookup reads the header
    alone, so a payload damaged in place (same size) fails in the worker's digest check; that
    request's tokens are computed instead, never taken from blocks it did not get."""
    path, folder, plain = stored
    damaged = str(tmp_path / "store")
    os.mkdir(damaged)
    first = f'"num_tokens": {aligned(LENGTHS[0])},'.encode()  # the 40-token prompt's file
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as src:
            data = bytearray(src.read())
        if first in data[:HEADER_READ_BYTES]:
            data[-1] ^= 0xFF
        with open(os.path.join(damaged, name), "wb") as dst:
            dst.write(bytes(data))
    with caplog.at_level(logging.WARNING, logger="trillm.kv_transfer"):
        outs = _run(kv_engine(path, kv_transfer_config=shared_storage_kv("kv_consumer", damaged)))
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in plain]
    assert [o.num_cached_tokens for o in outs] == [0, *(aligned(n) for n in LENGTHS[1:])]
    assert max_logprob_diff(outs, plain) < 1e-4
    assert "1 load failures so far" in caplog.text


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"},
            "'LMCacheConnectorV1' is not implemented",
        ),
        (
            {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
            "'NixlConnector' is not implemented",
        ),
        ({"kv_connector": "Mine", "kv_role": "kv_both"}, "kv_connector must be"),
        ({"kv_connector": "SharedStorageConnector", "kv_role": "both"}, "kv_role must be one of"),
        (
            {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both", "kv_port": 1},
            "kv_port: read by",
        ),
        (
            {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both", "color": 1},
            "unknown key 'color'",
        ),
        (
            {
                "kv_connector": "SharedStorageConnector",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "fail",
            },
            "only 'recompute'",
        ),
        (
            {
                "kv_connector": "SharedStorageConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"x": 1},
            },
            "shared_storage_path and max_local_disk_size only, not x",
        ),
        ("SharedStorageConnector", "must be a JSON object"),
    ],
)
def test_what_the_connector_cannot_take_is_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message):
        parse_kv_transfer_config(config)


def test_vllms_defaults_and_policy_are_taken():
    config = parse_kv_transfer_config(
        {
            "kv_connector": "SharedStorageConnector",
            "kv_role": "kv_consumer",
            "kv_port": 14579,
            "kv_load_failure_policy": "recompute",
            "engine_id": "decode-0",
        }
    )
    assert config is not None and config.shared_storage_path == "/tmp"
    assert config.is_consumer and not config.is_producer
