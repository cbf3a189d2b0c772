"""The step's token budget and the batch's size left unset (``max_num_batched_tokens``,
``max_num_seqs``) take vLLM's defaults for what made the engine and where it runs
(trillm/config/batch_defaults.py): on CPU ``trillm.LLM`` 4,096 / 256 as vLLM's LLM class,
``trillm serve`` 2,048 / 128 as vLLM's OpenAI server, an engine opened directly 2,048 / 128,
the CPU ones times the world size; vLLM's GPU table by the device's memory; a value given wins
everywhere."""

from __future__ import annotations

import httpx
import pytest
from shared_servers import FAKE_256, FAKE_256_GROUP

from trillm import LLM
from trillm.config import EngineArgs
from trillm.config.batch_defaults import GIB, BatchLimits, Device, UsageContext, batch_limits
from trillm.engine.config_builder import build_config
from trillm.executor.abstract import FAKE_RUNNER

# The server is shared with the other modules of its group (tests/support/shared_servers.py).
pytestmark = pytest.mark.xdist_group(FAKE_256_GROUP)

LEN = 8192  # max_model_len: the defaults' caps (max_num_seqs x it) never bind
SMALL = {"max_model_len": 256, "kv_cache_memory": "16MiB", "distributed_executor_backend": "uni"}


@pytest.mark.parametrize(
    ("usage", "default"),
    [
        (UsageContext.LLM_CLASS, 4096),
        (UsageContext.OPENAI_API_SERVER, 2048),
        (UsageContext.ENGINE_CONTEXT, 2048),
    ],
)
def test_the_default_follows_what_made_the_engine_and_a_given_value_wins(usage, default):
    assert build_config(EngineArgs(), usage).scheduler.max_num_batched_tokens == default
    given = build_config(EngineArgs(max_num_batched_tokens=512), usage)
    assert given.scheduler.max_num_batched_tokens == 512
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        build_config(EngineArgs(max_num_batched_tokens=0), usage)  # refused, not defaulted


@pytest.mark.parametrize(
    ("usage", "seqs"),
    [
        (UsageContext.LLM_CLASS, 256),
        (UsageContext.OPENAI_API_SERVER, 128),
        (UsageContext.ENGINE_CONTEXT, 128),
    ],
)
def test_the_batch_size_default_follows_what_made_the_engine(usage, seqs):
    assert build_config(EngineArgs(), usage).scheduler.max_num_seqs == seqs
    assert build_config(EngineArgs(max_num_seqs=7), usage).scheduler.max_num_seqs == 7
    with pytest.raises(ValueError, match="max_num_seqs"):
        build_config(EngineArgs(max_num_seqs=0), usage)


def test_cpu_defaults_scale_with_the_world_size():
    two = build_config(EngineArgs(tensor_parallel_size=2), UsageContext.OPENAI_API_SERVER)
    assert (two.scheduler.max_num_batched_tokens, two.scheduler.max_num_seqs) == (4096, 256)
    four = Device("cpu", world_size=4)
    assert batch_limits(None, None, UsageContext.LLM_CLASS, four, LEN) == BatchLimits(16384, 1024)
    assert batch_limits(100, 3, UsageContext.LLM_CLASS, four, LEN) == BatchLimits(100, 3)


@pytest.mark.parametrize(
    ("device", "llm", "server"),
    [
        (Device("cuda", 1, 80 * GIB, "NVIDIA H100 80GB HBM3"), (16384, 1024), (8192, 1024)),
        (Device("cuda", 2, 141 * GIB, "NVIDIA H200"), (16384, 1024), (8192, 1024)),
        (Device("cuda", 1, 80 * GIB, "NVIDIA A100-SXM4-80GB"), (8192, 256), (2048, 256)),
        (Device("cuda", 1, 24 * GIB, "NVIDIA L4"), (8192, 256), (2048, 256)),
        (Device("cuda"), (8192, 256), (2048, 256)),  # the GPU unreadable
    ],
)
def test_gpu_defaults_follow_vllms_table(device, llm, server):
    assert batch_limits(None, None, UsageContext.LLM_CLASS, device, LEN) == BatchLimits(*llm)
    assert batch_limits(None, None, UsageContext.OPENAI_API_SERVER, device, LEN) == BatchLimits(
        *server
    )
    other = batch_limits(None, None, UsageContext.ENGINE_CONTEXT, device, LEN)
    assert other == BatchLimits(2048, 128)


@pytest.mark.parametrize(
    ("given", "budget"), [({}, 4096), ({"max_num_batched_tokens": 1024}, 1024)]
)
def test_the_llm_class_takes_vllms_offline_budget(given, budget):
    engine = LLM(None, runner=FAKE_RUNNER, **given, **SMALL)
    try:
        assert engine.engine.config.scheduler.max_num_batched_tokens == budget
    finally:
        engine.shutdown()


def test_the_server_keeps_vllms_server_budget(shared_server):
    """``vllm:iteration_tokens_total``'s buckets end at the step budget: 2,048."""
    srv = shared_server(FAKE_256)
    page = httpx.get(srv.url + "/metrics", headers=srv.headers(), timeout=30).text
    buckets = [line for line in page.splitlines() if "iteration_tokens_total_bucket" in line]
    assert any('le="2048.0"' in line for line in buckets), buckets
    assert not any('le="4096.0"' in line for line in buckets)
