"""LLaVA under the scheduler's encoder budget and encoder cache (core/encoder_cache.py): with
max_num_batched_tokens = one image's 16 tokens, each step encodes at most one image and the
cache holds one image's rows, so prompts wait at their images' starts for later steps, an
image is kept after its request ends and evicted by the next, and an evicted image needed
again (a later request, a preempted one) is encoded again; greedy tokens and log-probs still
equal transformers'."""

from __future__ import annotations

import pytest
import torch
from llava_reference import image

from trillm import LLM, SamplingParams
from trillm.core.encoder_cache import EncoderCache

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
IMAGE_TOKENS = 16  # the tiny tower's patches: the budget holds one image
PROMPTS = [
    ("Describe <image> now", [image(0)]),
    ("<image> a <image> b", [image(1), image(2, (64, 32))]),
    ("The license grants", []),
    ("Look: <image>", [image(3)]),
]


class CutLog(EncoderCache):
    """Counts the chunks the encoder budget or cache cut short."""

    cuts = 0

    def cut(self, req_id: str, num_computed: int, n: int) -> int:
        kept = super().cut(req_id, num_computed, n)
        self.cuts += kept < n
        return kept


@pytest.fixture(scope="module")
def llava_path(tmp_path_factory):
    from trillm.testing.tiny_llava import build_tiny_llava

    return str(build_tiny_llava(tmp_path_factory.mktemp("tiny-llava-budget")))


def open_llm(path: str, **kwargs: object) -> LLM:
    return LLM(
        path,
        max_num_batched_tokens=IMAGE_TOKENS,
        limit_mm_per_prompt={"image": 2},
        distributed_executor_backend="uni",
        **{"kv_cache_memory": "4MiB", "max_model_len": 128, **kwargs},
    )


def hf_reference(path: str, text: str, images: list, n: int = 6):
    """transformers' greedy tokens and their log-probs."""
    from transformers import LlavaForConditionalGeneration, LlavaProcessor

    model = LlavaForConditionalGeneration.from_pretrained(path).eval()
    enc = LlavaProcessor.from_pretrained(path)(
        images=images or None, text=text, return_tensors="pt"
    )
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, enc["input_ids"].shape[1] :].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, tokens)]
    return tokens, logprobs


def generate(llm: LLM, prompts: list) -> list[tuple[list[int], list[float]]]:
    requests = [
        {"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text
        for text, imgs in prompts
    ]
    outs = llm.generate(requests, GREEDY, use_tqdm=False)
    return [
        (
            list(o.outputs[0].token_ids),
            [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)],
        )
        for o in outs
    ]


def max_diff(ours, refs) -> float:
    assert [o[0] for o in ours] == [r[0] for r in refs]
    return max(abs(a - b) for o, r in zip(ours, refs) for a, b in zip(o[1], r[1]))


def encoder_calls(llm: LLM) -> int:
    return llm.engine.cores[0].executor.runner.mm.encoder_calls


def with_cut_log(llm: LLM) -> CutLog:
    scheduler = llm.engine.cores[0].scheduler
    derived = scheduler.encoder_cache  # vLLM's sizes: max_num_batched_tokens both
    assert (derived.cache_size, derived.compute_budget) == (IMAGE_TOKENS, IMAGE_TOKENS)
    scheduler.encoder_cache = log = CutLog(IMAGE_TOKENS, IMAGE_TOKENS)
    return log


def test_images_wait_for_the_encoder_budget_and_equal_transformers(llava_path):
    with open_llm(llava_path) as llm:
        log = with_cut_log(llm)
        ours = generate(llm, PROMPTS)
        calls = encoder_calls(llm)
    refs = [hf_reference(llava_path, text, imgs) for text, imgs in PROMPTS]
    diff = max_diff(ours, refs)
    assert diff < 1e-4, diff
    assert log.cuts > 0  # chunks ended at an image's start, the image in a later step
    assert calls == 4  # each image once: none was evicted while a request needed it
    print(f"max |logprob diff| vs transformers: {diff:.2e}, chunks cut: {log.cuts}")


def test_a_cache_of_one_image_keeps_it_until_another_needs_the_rows(llava_path):
    x, y = PROMPTS[0], PROMPTS[3]
    with open_llm(llava_path) as llm:
        first = generate(llm, [x])
        assert encoder_calls(llm) == 1
        again = generate(llm, [x])
        assert encoder_calls(llm) == 1  # kept after its request ended
        generate(llm, [y])  # y's rows evict x
        last = generate(llm, [x])
        assert encoder_calls(llm) == 3  # x encoded again
    assert max_diff(again, first) < 1e-5 and max_diff(last, first) < 1e-5


def test_preempted_requests_encode_evicted_images_again_and_stay_exact(llava_path):
    # a KV cache of 4 blocks of 16 tokens: the four image requests (19 to 38 tokens + 6)
    # cannot all grow, the newest are preempted and recomputed (no prefix cache to skip the
    # image), their images encoded again when the one-image cache let them go meanwhile
    prompts = [*PROMPTS[:2], ("A <image> b", [image(5)]), PROMPTS[3]]
    small = {"kv_cache_memory": None, "num_gpu_blocks_override": 4, "max_model_len": 64}
    with open_llm(llava_path, enable_prefix_caching=False, **small) as llm:
        held = watch_cached_rows(llm)
        ours = generate(llm, prompts)
        preemptions = llm.engine.cores[0].scheduler.num_preemptions
        calls = encoder_calls(llm)
    refs = [hf_reference(llava_path, text, imgs) for text, imgs in prompts]
    diff = max_diff(ours, refs)
    assert diff < 1e-4, diff
    assert preemptions > 0 and calls > 5, (preemptions, calls)  # 5 images
    assert max(held) == IMAGE_TOKENS  # the worker's cache never held two images' rows
    print(f"preemptions {preemptions}, encoder calls {calls} for 5 images, diff {diff:.2e}")


def watch_cached_rows(llm: LLM) -> list[int]:
    """The rows the worker's encoder cache holds after each step's encoding."""
    mm = llm.engine.cores[0].executor.runner.mm
    encode_chunk, held = mm.encode_chunk, [0]

    def watched(slot: int, first: int, count: int) -> None:
        encode_chunk(slot, first, count)
        held.append(sum(rows.shape[0] for rows in mm._cache.values()))

    mm.encode_chunk = watched
    return held
