"""LLaVA (CLIP tower + projector + Llama) through the Python API: the expanded prompt equals
transformers' processor's, greedy tokens equal transformers' ``generate`` with the same pixel
values (one image, two images, mixed with text-only requests, prefill chunked across the
image span), the encoder runs once per item, the prefix cache never shares blocks across
images, and bad image input is refused by name."""

from __future__ import annotations

import io

import pytest
import trio
from image_server import ImageServer
from llava_reference import chat_text, data_url, image, png
from llava_reference import hf_llava_greedy as hf_greedy
from PIL import Image

from trillm import LLM, SamplingParams
from trillm.engine.preprocess import InvalidRequestError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = "Describe <image> now"  # 6 text tokens, 16 image tokens, 2 text tokens
BUDGET = 16  # max_num_batched_tokens: the 24-token prompt is prefilled in two chunks


@pytest.fixture(scope="module")
def llava_path(tmp_path_factory):
    from trillm.testing.tiny_llava import build_tiny_llava

    return str(build_tiny_llava(tmp_path_factory.mktemp("tiny-llava")))


@pytest.fixture(scope="module")
def llm(llava_path):
    engine = LLM(
        llava_path,
        max_model_len=256,
        kv_cache_memory="8MiB",
        max_num_batched_tokens=BUDGET,
        limit_mm_per_prompt={"image": 2},
        distributed_executor_backend="uni",
    )
    yield engine
    engine.shutdown()


def encoder_calls(engine: LLM) -> int:
    return engine.engine.cores[0].executor.runner.mm.encoder_calls


def test_image_prompt_equals_transformers_processor_and_generate(llm, llava_path):
    img = image(0)
    out = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": img}}, GREEDY)[0]
    ids, tokens = hf_greedy(llava_path, PROMPT, [img])
    assert out.prompt_token_ids == ids and ids.count(4096) == 16
    assert out.outputs[0].token_ids == tokens
    assert out.prompt == PROMPT


def test_two_images_in_one_prompt(llm, llava_path):
    text = "<image> first, then <image> second"
    imgs = [image(1), image(2, (32, 64))]
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": imgs}}, GREEDY)[0]
    ids, tokens = hf_greedy(llava_path, text, imgs)
    assert out.prompt_token_ids == ids and out.outputs[0].token_ids == tokens


def test_a_batch_mixing_image_and_text_requests(llm, llava_path):
    prompts = [
        {"prompt": PROMPT, "multi_modal_data": {"image": image(3)}},
        "The license grants",
        {"prompt": "Look: <image>", "multi_modal_data": {"image": [image(4)]}},
    ]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    refs = [
        hf_greedy(llava_path, PROMPT, [image(3)]),
        hf_greedy(llava_path, "The license grants", []),
        hf_greedy(llava_path, "Look: <image>", [image(4)]),
    ]
    assert [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs] == refs


def test_the_trio_api_takes_the_same_dict_and_chat_parts(llava_path):
    # The engine's mm_processor_kwargs reach the image processor; a request's own win.
    from trillm import open_engine

    img = image(13)
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": [img]}}
    parts = [
        {"type": "image_url", "image_url": {"url": data_url(png(img))}},
        {"type": "text", "text": "What is this?"},
    ]

    async def last(stream):
        async with stream as outputs:
            return [out async for out in outputs][-1]

    async def main():
        async with open_engine(
            llava_path,
            max_model_len=256,
            kv_cache_memory="8MiB",
            distributed_executor_backend="uni",
            mm_processor_kwargs={"do_normalize": False},
        ) as engine:
            messages = [{"role": "user", "content": parts}]
            kwargs = {"do_normalize": True}
            return [
                await last(engine.generate(prompt, GREEDY)),
                await last(engine.chat(messages, GREEDY, mm_processor_kwargs=kwargs)),
            ]

    raw, chat = trio.run(main)
    assert (raw.prompt_token_ids, raw.outputs[0].token_ids) == hf_greedy(
        llava_path, PROMPT, [img], do_normalize=False
    )
    reference = hf_greedy(llava_path, chat_text(llava_path, "<image>\nWhat is this?"), [img])
    assert (chat.prompt_token_ids, chat.outputs[0].token_ids) == reference


def test_llm_chat_takes_image_url_and_image_pil_parts(llm, llava_path):
    a, b = image(20), image(21, (64, 32))
    with ImageServer(png(b)) as server:  # http(s): any host without allowed_media_domains
        for second in [
            {"type": "image_pil", "image_pil": b},
            {"type": "image_url", "image_url": {"url": server.url("/redirect/2")}},
        ]:
            parts = [
                {"type": "image_url", "image_url": {"url": data_url(png(a))}},
                {"type": "text", "text": "and"},
                second,
            ]
            out = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)[0]
            text = chat_text(llava_path, "<image>\nand\n<image>")
            assert (out.prompt_token_ids, out.outputs[0].token_ids) == hf_greedy(
                llava_path, text, [a, b]
            )


def test_llm_chat_mm_processor_kwargs_and_refusals(llm, llava_path):
    img = image(22)
    parts = [{"type": "image_pil", "image_pil": img}, {"type": "text", "text": "Say"}]
    messages = [{"role": "user", "content": parts}]
    kwargs = {"do_normalize": False, "resample": 2}
    out = llm.chat(messages, GREEDY, use_tqdm=False, mm_processor_kwargs=kwargs)[0]
    text = chat_text(llava_path, "<image>\nSay")
    assert out.outputs[0].token_ids == hf_greedy(llava_path, text, [img], **kwargs)[1]
    for kwargs, words in [
        ({"bogus": 1, "do_normalize": True}, "'bogus' not taken by this model's image processor"),
        ({"return_tensors": "pt"}, "'return_tensors' not taken"),
        ({"crop_size": {"height": 64, "width": 64}}, r"sizes are whole numbers in \[1, 32\]"),
        ({"do_center_crop": False, "size": {"height": 16, "width": 16}}, "tower takes 32x32"),
        ({"resample": 99}, "the image processor refused them: Unknown resampling filter"),
        ({"do_normalize": "yes"}, "the image processor refused them"),
    ]:
        with pytest.raises(ValueError, match=words):
            llm.chat(messages, GREEDY, use_tqdm=False, mm_processor_kwargs=kwargs)
    for url, words in [
        ("file:///etc/hostname", "need --allowed-local-media-path \\(allowed_local_media_path"),
        ("ftp://example.com/a.png", "must be a data: URL"),
    ]:
        part = {"type": "image_url", "image_url": {"url": url}}
        with pytest.raises(ValueError, match=words):
            llm.chat([{"role": "user", "content": [part]}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="'bogus' not taken"):  # a prompt dict's, no image
        llm.generate({"prompt": "no image", "mm_processor_kwargs": {"bogus": 1}}, GREEDY)
    from trillm.config import EngineArgs

    with pytest.raises(ValueError, match="allowed_local_media_path '/no/such/dir' is not a dir"):
        EngineArgs(allowed_local_media_path="/no/such/dir")
    with pytest.raises(ValueError, match="allowed_media_domains must be a list of host names"):
        EngineArgs(allowed_media_domains="example.com")


def test_chunked_prefill_encodes_each_image_once(llm, llava_path):
    # The prompt's 24 tokens take two steps of BUDGET tokens; the image span (positions 6-21)
    # crosses the boundary: both chunks take their rows from one encoder call.
    img = image(5)
    before = encoder_calls(llm)
    out = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": img}}, GREEDY)[0]
    assert encoder_calls(llm) == before + 1
    assert out.outputs[0].token_ids == hf_greedy(llava_path, PROMPT, [img])[1]
    # Two requests holding the same image at once share one encoding.
    before = encoder_calls(llm)
    both = {"prompt": "Twice <image>", "multi_modal_data": {"image": image(6)}}
    outs = llm.generate([both, both], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert encoder_calls(llm) == before + 1


def test_prefix_cache_keys_include_the_image(llm):
    text = "A long enough text for one whole block of tokens, then <image> and more"
    first = llm.generate({"prompt": text, "multi_modal_data": {"image": image(7)}}, GREEDY)[0]
    other = llm.generate({"prompt": text, "multi_modal_data": {"image": image(8)}}, GREEDY)[0]
    same = llm.generate({"prompt": text, "multi_modal_data": {"image": image(7)}}, GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert other.num_cached_tokens == 0  # same text, another image: nothing shared
    assert same.num_cached_tokens >= 16  # same text and image: its full blocks
    assert same.outputs[0].token_ids == first.outputs[0].token_ids


def test_bad_image_input_is_refused_by_name(llm):
    truncated = Image.open(io.BytesIO(png(image(9))[:200]))  # a header, then too little data
    cases = [
        ({"image": [image(0)] * 3}, "at most 2 per prompt"),
        ({"image": "not an image"}, "is not an image"),
        ({"image": truncated}, "cannot be decoded"),
        ({"video": [image(0)]}, "takes no video inputs"),
        ({"image": [image(0), image(1)]}, "2 image(s)"),  # one placeholder, two images
        ({"image": image(0, (4020, 20))}, "an aspect ratio over 200"),  # resizing: 3.2 GB
    ]
    for data, words in cases:
        with pytest.raises(InvalidRequestError, match=None) as info:
            llm.generate({"prompt": PROMPT, "multi_modal_data": data}, GREEDY)
        assert words in str(info.value), (words, str(info.value))
    processor = llm.engine.preprocessor.multimodal
    processor.max_pixels = 100
    try:
        with pytest.raises(InvalidRequestError, match="more than the limit of 100"):
            llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": image(0)}}, GREEDY)
    finally:
        processor.max_pixels = 4096 * 4096
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens"):
        params = SamplingParams(max_tokens=2, truncate_prompt_tokens=4)
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": image(0)}}, params)
    # the engine still serves
    assert len(llm.generate("still here", GREEDY)[0].outputs[0].token_ids) == 8


def test_text_models_and_disabled_images_refuse_image_input(tiny_model_factory, llava_path):
    from transformers import AutoTokenizer

    from trillm.config import EngineArgs
    from trillm.engine.config_builder import build_config
    from trillm.engine.preprocess import Preprocessor

    text_model = tiny_model_factory("llama")
    with pytest.raises(ValueError, match="LlamaForCausalLM takes no image inputs"):
        build_config(EngineArgs(text_model, limit_mm_per_prompt={"image": 1}))
    for path, kwargs, words in [
        (text_model, {}, "LlamaForCausalLM takes no image"),
        (llava_path, {"limit_mm_per_prompt": {"image": 0}}, "image inputs are off"),
    ]:
        config = build_config(EngineArgs(path, **kwargs))
        pre = Preprocessor(config, AutoTokenizer.from_pretrained(path), num_blocks=64)
        prompt = {"prompt": "x <image>", "multi_modal_data": {"image": image(0)}}
        with pytest.raises(InvalidRequestError, match=words):
            trio.run(pre.prepare, prompt, SamplingParams(max_tokens=2))
    assert build_config(EngineArgs(llava_path)).limit_mm_per_prompt == {"image": 1}
    pp2 = build_config(EngineArgs(llava_path, pipeline_parallel_size=2))  # the tower on stage 0
    assert pp2.parallel.pipeline_parallel_size == 2
    with pytest.raises(ValueError, match="convert='embed' is not supported yet"):
        build_config(EngineArgs(llava_path, convert="embed"))
    with pytest.raises(ValueError, match="'bogus' not taken by this model's image processor"):
        build_config(EngineArgs(llava_path, mm_processor_kwargs='{"bogus": 1}'))
    with pytest.raises(ValueError, match="mm_processor_kwargs: LlamaForCausalLM takes no"):
        build_config(EngineArgs(text_model, mm_processor_kwargs={"do_normalize": False}))


def test_limit_mm_per_prompt_values():
    from trillm.config import EngineArgs

    assert EngineArgs(limit_mm_per_prompt='{"image": 3}').limit_mm_per_prompt == {"image": 3}
    for bad, words in [
        ({"video": True}, "integer >= 0"),
        ({"image": -1}, "integer >= 0"),
        ({"smell": 1}, "unknown modality"),
        ([1], "must be an object"),
    ]:
        with pytest.raises(ValueError, match=words):
            EngineArgs(limit_mm_per_prompt=bad)
    assert EngineArgs(limit_mm_per_prompt={"audio": 0}).limit_mm_per_prompt == {"audio": 0}


def test_llama_32_vision_is_refused_naming_the_architecture(tmp_path):
    # Its cross-attention layers (text attending to the vision states) are not implemented.
    import json

    config = {
        "architectures": ["MllamaForConditionalGeneration"],
        "model_type": "mllama",
        "text_config": {"model_type": "mllama_text_model", "cross_attention_layers": [1]},
        "vision_config": {"model_type": "mllama_vision_model"},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    from trillm.config import EngineArgs
    from trillm.engine.config_builder import build_config

    with pytest.raises(ValueError) as info:
        build_config(EngineArgs(str(tmp_path)))
    assert str(info.value).startswith(
        "Model architecture 'MllamaForConditionalGeneration' is not supported (Llama 3.2 "
        "Vision: its cross-attention layers (text attending to the vision encoder's states) "
        "are not implemented); supported architectures: "
    )
