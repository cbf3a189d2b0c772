"""vLLM's ``--max-cpu-loras``: adapters kept read in CPU memory beyond the ``max_loras`` slots.

With one slot and room for two in CPU memory, an adapter whose slot another took comes back
from memory: its files can be gone and its output is unchanged. With the default (as many as
slots) it is read from disk again, so the same run fails naming the missing files.
"""

from __future__ import annotations

import shutil

import pytest

from trillm import LLM, LoRARequest, SamplingParams
from trillm.testing.lora_adapters import build_peft_adapter

ENGINE = dict(max_model_len=128, kv_cache_memory="8MiB", distributed_executor_backend="uni")
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def setup(tiny_model_factory, tmp_path):
    model = tiny_model_factory("qwen2")
    first = build_peft_adapter(model, tmp_path / "a", seed=1)
    second = build_peft_adapter(model, tmp_path / "b", seed=2)
    return model, LoRARequest("a", 1, str(first)), LoRARequest("b", 2, str(second))


def _tokens(llm: LLM, lora: LoRARequest) -> list[int]:
    out = llm.generate(["In the beginning"], PARAMS, use_tqdm=False, lora_request=lora)
    return list(out[0].outputs[0].token_ids)


def _a_b_then_a_without_its_files(llm: LLM, a: LoRARequest, b: LoRARequest) -> tuple:
    """a's tokens, then a's again after b took the only slot and a's files were deleted."""
    first = _tokens(llm, a)
    assert _tokens(llm, b) != first  # b takes the only slot
    shutil.rmtree(a.lora_path)
    return first, _tokens(llm, a)


def test_an_adapter_kept_in_cpu_memory_comes_back_without_its_files(setup):
    model, a, b = setup
    with LLM(model, enable_lora=True, max_loras=1, max_cpu_loras=2, **ENGINE) as llm:
        first, again = _a_b_then_a_without_its_files(llm, a, b)
    assert again == first and len(first) == 6


def test_by_default_it_is_read_from_disk_again(setup, caplog):
    model, a, b = setup
    with LLM(model, enable_lora=True, max_loras=1, **ENGINE) as llm:
        _, again = _a_b_then_a_without_its_files(llm, a, b)
    assert again == []  # the request alone is aborted: the worker could not read the adapter
    assert "cannot read adapter_config.json" in caplog.text


def test_fewer_than_max_loras_is_refused(setup):
    model, _, _ = setup
    with pytest.raises(ValueError, match=r"max_cpu_loras must be an integer >= max_loras \(2\)"):
        LLM(model, enable_lora=True, max_loras=2, max_cpu_loras=1, **ENGINE)
