"""Gemma 3 with images (SigLIP tower + projector + Gemma 3 decoder whose image tokens attend to
each other both ways) through the Python API: the expanded prompt equals Gemma 3's processor's,
greedy tokens and prompt / sample log-probabilities equal transformers' on a batch mixing image
and text-only requests (two images in one prompt, a step budget that chunks the prefill right
before the image spans, the sliding window narrower than an image), a preempted image request
resumes the same, and what the model cannot run is refused by name."""

from __future__ import annotations

import pytest
from gemma3_reference import IMAGE, hf_greedy
from llava_reference import image
from mm_engine import (
    GREEDY,
    SCORED,
    as_prompt,
    batch_logprob_diff,
    check_preempted_resume,
    encoder_calls,
    module_llm,
)
from qwen2_vl_reference import max_logprob_diff

from trillm import LLM, SamplingParams
from trillm.engine.preprocess import InvalidRequestError
from trillm.testing.tiny_gemma3 import TOKENS_PER_IMAGE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# max_num_batched_tokens: an image's 16 soft tokens fit a step, its boi/eoi and the text around
# it do not (chunks end right before a span, and a span starts a chunk)
BUDGET = 20
CASES = [
    (f"Describe {IMAGE} now", [image(0)]),
    ("The license grants", []),
    (f"{IMAGE} first, then {IMAGE} second", [image(1), image(2, (64, 24))]),
]
SOFT_TOKEN = 4098
ENGINE = dict(kv_cache_memory="8MiB", limit_mm_per_prompt={"image": 2})


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from trillm.testing.tiny_gemma3 import build_tiny_gemma3

    return str(build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3")))


@pytest.fixture(scope="module")
def llm(path):
    yield from module_llm(path, max_model_len=256, max_num_batched_tokens=BUDGET, **ENGINE)


def test_mixed_batch_equals_transformers_tokens_and_logprobs(path, llm):
    assert llm.engine.cores[0].scheduler.keep_mm_spans_whole  # either twin keeps the rule
    before = encoder_calls(llm)
    outs = llm.generate([as_prompt(t, i) for t, i in CASES], SCORED, use_tqdm=False)
    assert encoder_calls(llm) == before + 3  # once per image
    # the prompt ids: "\n\n" boi soft x 16 eoi "\n\n" around each image, as the processor
    assert batch_logprob_diff(path, CASES, outs, hf_greedy) < 1e-4
    assert outs[2].prompt_token_ids.count(SOFT_TOKEN) == 2 * TOKENS_PER_IMAGE


def test_one_image_alone_in_one_step_equals_transformers(path):
    # No chunking at all: the fast paths of a step without image rows are not taken
    llm = LLM(path, max_model_len=256, distributed_executor_backend="uni", **ENGINE)
    try:
        text, images = CASES[2]
        out = llm.generate(as_prompt(text, images), SCORED)[0]
    finally:
        llm.shutdown()
    ids, tokens, logprobs = hf_greedy(path, text, images)
    assert out.outputs[0].token_ids == tokens
    assert max_logprob_diff(out, ids, logprobs) < 1e-4


def test_the_eager_backend_equals_transformers_too(path):
    llm = LLM(
        path,
        attention_backend="eager",
        max_num_batched_tokens=BUDGET,
        distributed_executor_backend="uni",
        **ENGINE,
    )
    try:
        outs = llm.generate([as_prompt(t, i) for t, i in CASES], SCORED, use_tqdm=False)
    finally:
        llm.shutdown()
    assert batch_logprob_diff(path, CASES, outs, hf_greedy) < 1e-4


def test_preempted_image_requests_resume_the_same(path):
    cases = [CASES[0], CASES[2], (f"Then {IMAGE}", [image(5, (32, 48))]), CASES[1]]
    check_preempted_resume(
        path,
        cases,
        [as_prompt(*case) for case in cases],
        hf_greedy,
        max_model_len=128,
        num_gpu_blocks_override=8,  # 4 requests need 16 blocks: forces preemption
        max_num_batched_tokens=32,
        limit_mm_per_prompt={"image": 2},
    )


def test_pan_and_scan_is_refused_by_name(llm):
    prompt = {**as_prompt(*CASES[0]), "mm_processor_kwargs": {"do_pan_and_scan": True}}
    with pytest.raises(InvalidRequestError, match="do_pan_and_scan"):
        llm.generate(prompt, GREEDY)
    # off, as by default: the same as no kwargs
    prompt = {**as_prompt(*CASES[0]), "mm_processor_kwargs": {"do_pan_and_scan": False}}
    plain = llm.generate(as_prompt(*CASES[0]), GREEDY)[0].outputs[0].token_ids
    assert llm.generate(prompt, GREEDY)[0].outputs[0].token_ids == plain


def test_what_the_model_cannot_run_is_refused(path, tmp_path):
    import json
    import shutil

    kwargs = dict(distributed_executor_backend="uni", **ENGINE)
    with pytest.raises(ValueError, match="max_num_batched_tokens=12 is less than an image's 16"):
        LLM(path, max_num_batched_tokens=12, **kwargs)
    with pytest.raises(ValueError, match="bidirectional attention among an image's tokens"):
        LLM(path, attention_backend="triton", **kwargs)
    for change, words in [
        ({"mm_tokens_per_image": 15}, "mm_tokens_per_image 15 must be a square"),
        ({"vision_config": {"model_type": "clip_vision_model"}}, "'clip_vision_model' vision"),
    ]:
        folder = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        shutil.copytree(path, folder)
        data = json.loads((folder / "config.json").read_text())
        data.update(change)
        (folder / "config.json").write_text(json.dumps(data))
        with pytest.raises(ValueError, match=words):
            LLM(str(folder), **kwargs)


def test_chat_parts_reach_the_template_as_a_list(path, llm):
    from transformers import AutoTokenizer

    img = image(3, (40, 56))
    parts = [{"type": "image_pil", "image_pil": img}, {"type": "text", "text": "What?"}]
    out = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)[0]
    # the template loops over the content (auto: the "openai" format), as transformers' renders
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}]
    tok = AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids, tokens, _ = hf_greedy(path, text, [img])
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == (ids, tokens)


def test_the_string_content_format_joins_the_parts(path):
    from transformers import AutoTokenizer

    img = image(3, (40, 56))
    parts = [{"type": "image_pil", "image_pil": img}, {"type": "text", "text": "What?"}]
    llm = LLM(
        path,
        chat_template_content_format="string",
        distributed_executor_backend="uni",
        **ENGINE,
    )
    try:
        out = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    chat = [{"role": "user", "content": f"{IMAGE}\nWhat?"}]  # the parts' text joined
    tok = AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert out.prompt_token_ids == hf_greedy(path, text, [img])[0]


def test_a_token_prompt_gets_the_newlines_tokens_around_the_image(path, llm):
    from transformers import AutoTokenizer

    text, images = CASES[0]  # (its newlines merge with no neighbour: the same ids either way)
    ids = AutoTokenizer.from_pretrained(path)(text, add_special_tokens=False)["input_ids"]
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}
    out = llm.generate(prompt, GREEDY)[0]
    expected, tokens, _ = hf_greedy(path, text, images)
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == (expected, tokens)


def test_a_prefix_cache_hit_inside_an_image_computes_its_rest_both_ways(path, llm):
    # The cache's first block ends inside the image (tokens 8..23 of "Describe" + image): the
    # second request takes it and computes the image's rest in one chunk, its tokens still
    # seeing the cached ones of the image and each other
    text, images = CASES[0]
    ids, tokens, logprobs = hf_greedy(path, text, images)
    assert ids.index(SOFT_TOKEN) < 16 < ids.index(SOFT_TOKEN) + TOKENS_PER_IMAGE
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    llm.generate(as_prompt(text, images), GREEDY)
    out = llm.generate(as_prompt(text, images), params)[0]
    assert out.num_cached_tokens == 16
    assert out.outputs[0].token_ids == tokens
    seq = ids + tokens
    for i, entry in enumerate(out.outputs[0].logprobs):  # row len(ids) - 1 + i scores token i
        ref = float(logprobs[len(ids) - 1 + i, seq[len(ids) + i]])
        assert abs(entry[seq[len(ids) + i]].logprob - ref) < 1e-4


def test_a_hub_config_with_transformers_defaults_left_out_loads_the_same_model(path, tmp_path):
    # Hub folders' text_config omits what equals Gemma3TextConfig's defaults and keeps
    # transformers 4's rope keys (rope_scaling, rope_theta, rope_local_base_freq)
    import json
    import shutil

    folder = tmp_path / "hub"
    shutil.copytree(path, folder)
    data = json.loads((folder / "config.json").read_text())
    text = data["text_config"]
    for key in ("hidden_activation", "rms_norm_eps", "final_logit_softcapping", "layer_types"):
        text.pop(key)
    rope = text.pop("rope_parameters")
    text["rope_scaling"] = {"type": "linear", "factor": rope["full_attention"]["factor"]}
    text["rope_theta"] = rope["full_attention"]["rope_theta"]
    assert rope["sliding_attention"]["rope_theta"] == 10000.0  # the default: left out
    (folder / "config.json").write_text(json.dumps(data))
    llm = LLM(str(folder), distributed_executor_backend="uni", **ENGINE)
    try:
        out = llm.generate(as_prompt(*CASES[2]), GREEDY)[0]
    finally:
        llm.shutdown()
    assert out.outputs[0].token_ids == hf_greedy(path, *CASES[2])[1]
