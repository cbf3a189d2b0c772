"""``--mm-processor-cache-gb``: an image sent again skips the image processor (counted), a
key is the pixels and the processor keywords, the byte budget evicts the least recently used,
0 disables the cache, and the output is the same with or without it (and equal to
transformers'). ``--skip-mm-profiling`` is accepted and said in the log."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from llava_reference import hf_llava_greedy, image

from trillm import LLM, SamplingParams
from trillm.config import EngineArgs
from trillm.engine.mm_processor_cache import ProcessorCache, item_key

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = "Describe <image> now"


class CountingProcessor:
    """The image processor, its calls counted."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.calls = 0

    def __call__(self, *args: object, **kwargs: object) -> object:
        self.calls += 1
        return self.inner(*args, **kwargs)  # type: ignore[operator]

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def llava_path(tmp_path_factory):
    from trillm.testing.tiny_llava import build_tiny_llava

    return str(build_tiny_llava(tmp_path_factory.mktemp("tiny-llava")))


def counted_llm(path: str, **kwargs: object) -> tuple[LLM, CountingProcessor]:
    llm = LLM(
        path,
        max_model_len=128,
        kv_cache_memory="4MiB",
        distributed_executor_backend="uni",
        **kwargs,
    )
    processor = llm.engine.preprocessor.multimodal
    counting = CountingProcessor(processor.image_processor)
    processor._image_processor = counting
    return llm, counting


def run(llm: LLM, img: object, **kwargs: object) -> tuple[list[int], list[int]]:
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": img}, **kwargs}
    out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    return list(out.prompt_token_ids), list(out.outputs[0].token_ids)


def test_a_repeated_image_is_processed_once_and_answers_the_same(llava_path):
    llm, counting = counted_llm(llava_path)
    try:
        cache = llm.engine.preprocessor.multimodal.cache
        first = run(llm, image(0))
        again = run(llm, image(0))  # another PIL object, the same pixels
        assert counting.calls == 1 and (cache.queries, cache.hits) == (2, 1)
        assert first == again == hf_llava_greedy(llava_path, PROMPT, [image(0)], n=6)
        run(llm, image(1))  # other pixels: processed
        assert counting.calls == 2
        plain = run(llm, image(0), mm_processor_kwargs={"do_normalize": False})
        assert counting.calls == 3  # other keywords: another entry, another output
        assert plain[1] == hf_llava_greedy(llava_path, PROMPT, [image(0)], 6, do_normalize=False)[1]
        run(llm, image(0), mm_processor_kwargs={"do_normalize": False})
        assert counting.calls == 3 and (cache.queries, cache.hits) == (5, 2)
    finally:
        llm.shutdown()


def test_zero_gib_disables_the_cache_and_the_output_is_unchanged(llava_path):
    llm, counting = counted_llm(llava_path, mm_processor_cache_gb=0)
    try:
        assert llm.engine.preprocessor.multimodal.cache is None
        outs = [run(llm, image(0)) for _ in range(2)]
        assert counting.calls == 2
        assert outs[0] == outs[1] == hf_llava_greedy(llava_path, PROMPT, [image(0)], n=6)
    finally:
        llm.shutdown()


def values(n: int, fill: float) -> np.ndarray:
    return np.full(n, fill, np.float32)  # n * 4 bytes


def test_the_byte_budget_evicts_the_least_recently_used():
    cache = ProcessorCache(capacity_bytes=1000)
    for key in "abc":
        cache.put(key, values(75, 1.0))  # 300 bytes each
    assert cache.get("a") is not None  # a is now the most recently used
    cache.put("d", values(75, 2.0))  # 1200 > 1000: b goes
    assert cache.get("b") is None and len(cache) == 3 and cache.size_bytes == 900
    assert cache.get("c") is not None and cache.get("d") is not None
    cache.put("huge", values(300, 3.0))  # over the whole budget: not kept, nothing evicted
    assert cache.get("huge") is None and len(cache) == 3
    assert (cache.queries, cache.hits) == (5, 3)
    kept = cache.get("a")
    assert kept is not None and not kept.flags.writeable  # hits share one array


def test_keys_are_pixels_and_keywords():
    pixels = np.asarray(image(0))
    assert item_key(pixels, {"a": 1, "b": (2, 3)}) == item_key(pixels.copy(), {"b": (2, 3), "a": 1})
    assert item_key(pixels, {}) != item_key(pixels, {"do_normalize": False})
    assert item_key(pixels, {}) != item_key(np.asarray(image(1)), {})
    # same bytes, another shape: another image
    assert item_key(pixels, {}) != item_key(pixels.reshape(pixels.shape[1], -1, 3), {})


def test_bad_budgets_are_refused_by_name():
    assert EngineArgs().mm_processor_cache_gb == 4.0  # vLLM's default
    for bad in (-1, float("nan"), float("inf"), "4", True):
        with pytest.raises(ValueError, match="mm_processor_cache_gb must be"):
            EngineArgs(mm_processor_cache_gb=bad)


def test_skip_mm_profiling_is_accepted_and_said_in_the_log(caplog):
    with caplog.at_level(logging.INFO, logger="trillm.config.engine_checks"):
        EngineArgs(skip_mm_profiling=True)
    assert "skip_mm_profiling: trillm runs no memory-profiling pass at start" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trillm.config.engine_checks"):
        EngineArgs()
    assert "skip_mm_profiling" not in caplog.text
