"""The step's token budget left unset (``max_num_batched_tokens``) takes vLLM's CPU default for
what made the engine (trillm/config/batch_defaults.py): ``trillm.LLM`` 4,096 as vLLM's LLM
class, ``trillm serve`` 2,048 as vLLM's OpenAI server, an engine opened directly 2,048; a value
given wins everywhere."""

from __future__ import annotations

import httpx
import pytest
from shared_servers import FAKE_256, FAKE_256_GROUP

from trillm import LLM
from trillm.config import EngineArgs
from trillm.config.batch_defaults import UsageContext
from trillm.engine.config_builder import build_config
from trillm.executor.abstract import FAKE_RUNNER

# The server is shared with the other modules of its group (tests/support/shared_servers.py).
pytestmark = pytest.mark.xdist_group(FAKE_256_GROUP)

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
