"""The scheduler's limits as vLLM resolves and checks them at startup
(trillm/config/batch_defaults.py, scheduler_checks.py): a default follows the other value given (the batch left
unset is at most the step budget, the budget left unset at most ``max_num_seqs`` x
``max_model_len``); a budget below ``max_num_seqs``, a ``long_prefill_token_threshold`` below 0
or above ``max_model_len``, and budgets without room for speculative decoding's slots are
refused naming the values, and so are vLLM's bounds of ``stream_interval``,
``gpu_memory_utilization`` and ``scheduling_policy``: by ``EngineArgs`` and ``trillm serve``'s
flags as soon as they are given, by the engine once the model's length is known."""

from __future__ import annotations

import logging

import pytest
from server_harness import run_trillm

from trillm import LLM
from trillm.config import EngineArgs
from trillm.config.batch_defaults import UsageContext
from trillm.engine.config_builder import build_config
from trillm.executor.abstract import FAKE_RUNNER

SERVER = UsageContext.OPENAI_API_SERVER
SMALL = {"max_model_len": 256, "kv_cache_memory": "16MiB", "distributed_executor_backend": "uni"}
BELOW = r"max_num_batched_tokens \(16\) must be greater than or equal to max_num_seqs \(32\)"


def _limits(usage: UsageContext = SERVER, **kwargs) -> tuple[int, int]:
    s = build_config(EngineArgs(**kwargs), usage).scheduler
    return s.max_num_batched_tokens, s.max_num_seqs


@pytest.mark.parametrize(
    ("usage", "given", "limits"),
    [
        (SERVER, {}, (2048, 128)),  # vLLM's defaults start
        (UsageContext.LLM_CLASS, {"max_model_len": 256}, (4096, 256)),
        (SERVER, {"max_num_batched_tokens": 16}, (16, 16)),  # the batch follows the budget
        (SERVER, {"max_num_batched_tokens": 500}, (500, 128)),
        (SERVER, {"max_num_seqs": 4, "max_model_len": 256}, (1024, 4)),  # the budget follows
        (SERVER, {"max_num_seqs": 16, "max_model_len": 256}, (2048, 16)),
        (SERVER, {"max_num_batched_tokens": 16, "max_num_seqs": 16}, (16, 16)),  # equal: fine
    ],
)
def test_a_default_follows_the_value_given_as_in_vllm(usage, given, limits):
    assert _limits(usage, **given) == limits


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"max_num_batched_tokens": 16, "max_num_seqs": 32}, BELOW),
        ({"max_num_batched_tokens": 0}, r"max_num_batched_tokens \(--max-num-batched-tokens\)"),
        ({"max_num_seqs": 0}, r"max_num_seqs \(--max-num-seqs\) must be an integer >= 1"),
        ({"long_prefill_token_threshold": -1}, r"long_prefill_token_threshold .* >= 0"),
        ({"stream_interval": 0}, r"stream_interval \(--stream-interval\) must be an integer >= 1"),
        ({"gpu_memory_utilization": 0}, r"gpu_memory_utilization .* in \(0, 1\], got 0"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization .* in \(0, 1\], got 1.5"),
        ({"scheduling_policy": "lifo"}, r"scheduling_policy .* fcfs, priority, got 'lifo'"),
    ],
)
def test_engine_args_refuse_the_values_given_before_anything_loads(given, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**given)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        # the budget left to its default (the server's 2,048) is below the batch given
        (
            {"max_num_seqs": 4096},
            r"max_num_batched_tokens \(2048\) must be greater than or equal to max_num_seqs "
            r"\(4096\)",
        ),
        (
            {"long_prefill_token_threshold": 257, "max_model_len": 256},
            r"long_prefill_token_threshold \(257\) cannot be greater than max_model_len \(256\)",
        ),
        (
            {  # LoRA with speculative decoding: room for every request's drafts and bonus
                "enable_lora": True,
                "speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
                "max_num_batched_tokens": 31,
                "max_num_seqs": 8,
            },
            r"max_num_batched_tokens \(31\) is less than max_num_seqs \(8\) x "
            r"\(num_speculative_tokens \(3\) \+ 1\) = 32",
        ),
        (
            {
                "speculative_config": {
                    "method": "draft_model",
                    "model": "/nonexistent/draft",
                    "num_speculative_tokens": 2,
                },
                "max_num_batched_tokens": 1,
                "max_num_seqs": 1,
            },
            r"max_num_batched_tokens \(1\) leaves no room for speculative_config's draft_model",
        ),
    ],
)
def test_the_engine_refuses_the_resolved_limits_vllm_refuses(given, message):
    with pytest.raises(ValueError, match=message):
        build_config(EngineArgs(**given), SERVER)


def test_lora_with_speculative_decoding_starts_with_room_for_the_drafts():
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    given = {"max_num_batched_tokens": 32, "max_num_seqs": 8, "speculative_config": spec}
    assert _limits(enable_lora=True, **given) == (32, 8)
    assert _limits(**{**given, "max_num_batched_tokens": 8}) == (8, 8)  # no LoRA: no such rule


def test_a_budget_no_batch_can_fill_is_logged_as_vllm_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="trillm.config.batch_defaults"):
        _limits(max_num_batched_tokens=1024, max_num_seqs=2, max_model_len=256)
    assert "max_num_batched_tokens (1024) exceeds max_num_seqs x max_model_len (2 x 256)" in (
        caplog.text
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trillm.config.batch_defaults"):
        _limits(max_num_batched_tokens=512, max_num_seqs=2, max_model_len=256)
    assert "exceeds" not in caplog.text


def test_the_llm_class_refuses_and_follows_as_the_engine_does():
    with pytest.raises(ValueError, match=BELOW):
        LLM(None, runner=FAKE_RUNNER, max_num_batched_tokens=16, max_num_seqs=32, **SMALL)
    engine = LLM(None, runner=FAKE_RUNNER, max_num_batched_tokens=16, **SMALL)
    try:
        scheduler = engine.engine.config.scheduler
        assert (scheduler.max_num_batched_tokens, scheduler.max_num_seqs) == (16, 16)
        outs = engine.generate(["a b c d e f g h i j k l m n o p q r s t"] * 3)
        assert len(outs) == 3 and all(o.outputs[0].token_ids for o in outs)
    finally:
        engine.shutdown()


def test_serve_refuses_the_flags_by_name(tmp_path):
    """Both given: an argparse error (exit 2) before the model is read; the budget left to its
    default: the engine's refusal, and the server never comes up."""
    given = run_trillm(
        ["serve", "--max-num-batched-tokens", "16", "--max-num-seqs", "32"], tmp_path / "a.log"
    )
    assert given.returncode == 2, given.output
    assert "trillm serve: error: max_num_batched_tokens (16) must be greater" in given.output
    assert "--max-num-seqs" in given.output and "Traceback" not in given.output
    fraction = run_trillm(["serve", "--gpu-memory-utilization", "1.5"], tmp_path / "c.log")
    assert fraction.returncode == 2, fraction.output
    assert "error: gpu_memory_utilization (--gpu-memory-utilization)" in fraction.output
    resolved = run_trillm(
        ["serve", "--max-num-seqs", "4096", "--kv-cache-memory", "16MiB", "--port", "0"],
        tmp_path / "b.log",
        timeout=120,
    )
    assert resolved.returncode != 0, resolved.output
    assert "max_num_batched_tokens (2048) must be greater than or equal to max_num_seqs (4096)" in (
        resolved.output
    )
    assert "engine ready" not in resolved.output
