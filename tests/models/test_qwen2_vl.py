"""Qwen2-VL and Qwen2.5-VL (vision tower + M-RoPE decoder) through the Python API: the expanded
prompt equals transformers' processor's, greedy tokens and prompt / sample log-probabilities
equal transformers' on a batch mixing image and text-only requests (two images of different
sizes in one prompt, prefill chunked across the image spans), a preempted image request
resumes with the same positions, M-RoPE positions equal ``get_rope_index``'s, and what the
models cannot run is refused by name."""

from __future__ import annotations

import pytest
from engine_waves import concurrent_requests
from llava_reference import image
from qwen2_vl_reference import IMAGE, hf_greedy, hf_inputs, max_logprob_diff

from trillm import LLM, SamplingParams
from trillm.engine.preprocess import InvalidRequestError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SCORED = SamplingParams(
    temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1, prompt_logprobs=1
)
BUDGET = 16  # max_num_batched_tokens: each image's 24-30 placeholders span two or more chunks
CASES = [  # (prompt, images): 50x40 pixels -> 30 tokens, 64x24 -> 24 tokens
    (f"Describe {IMAGE} now", [image(0)]),
    ("The license grants", []),
    (f"{IMAGE} first, then {IMAGE} second", [image(1), image(2, (64, 24))]),
]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    from trillm.testing.tiny_qwen2_vl import build_tiny_qwen2_vl

    root = tmp_path_factory.mktemp("tiny-qwen2-vl")
    return {v: str(build_tiny_qwen2_vl(root / v, version=v)) for v in ("2", "2.5")}


@pytest.fixture(scope="module", params=["2", "2.5"])
def model(request, paths):
    engine = LLM(
        paths[request.param],
        max_model_len=256,
        kv_cache_memory="8MiB",
        max_num_batched_tokens=BUDGET,
        limit_mm_per_prompt={"image": 2},
        distributed_executor_backend="uni",
    )
    yield paths[request.param], engine
    engine.shutdown()


def encoder_calls(engine: LLM) -> int:
    return engine.engine.cores[0].executor.runner.mm.encoder_calls


def as_prompt(text: str, images: list) -> object:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def test_mixed_batch_equals_transformers_tokens_and_logprobs(model):
    path, llm = model
    before = encoder_calls(llm)
    outs = llm.generate([as_prompt(t, i) for t, i in CASES], SCORED, use_tqdm=False)
    assert encoder_calls(llm) == before + 3  # once per image, however many chunks
    for (text, images), out in zip(CASES, outs, strict=True):
        ids, tokens, logprobs = hf_greedy(path, text, images)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == tokens
        assert max_logprob_diff(out, ids, logprobs) < 1e-4
    assert outs[0].prompt_token_ids.count(4098) == 30  # <|image_pad|> x merged patches
    assert outs[2].prompt_token_ids.count(4098) == 30 + 24


def test_chat_image_parts_take_the_vision_span(model):
    path, llm = model
    img = image(3, (40, 56))
    parts = [{"type": "image_pil", "image_pil": img}, {"type": "text", "text": "What?"}]
    out = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)[0]
    # the parts joined as trillm joins them (a newline), then the folder's chat template
    text = f"<|im_start|>user\n{IMAGE}\nWhat?<|im_end|>\n<|im_start|>assistant\n"
    ids, tokens, _ = hf_greedy(path, text, [img])
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == (ids, tokens)


def test_mm_processor_kwargs_pixel_budget(model):
    path, llm = model
    img = image(4, (64, 64))
    for kwargs, hf_kwargs in [
        ({"max_pixels": 32 * 32}, {"size": {"shortest_edge": 256, "longest_edge": 1024}}),
        ({"min_pixels": 80 * 80}, {"size": {"shortest_edge": 6400, "longest_edge": 4096}}),
    ]:
        prompt = {**as_prompt(f"See {IMAGE}", [img]), "mm_processor_kwargs": kwargs}
        out = llm.generate(prompt, GREEDY)[0]
        ids, tokens, _ = hf_greedy(path, f"See {IMAGE}", [img], **hf_kwargs)
        assert (out.prompt_token_ids, out.outputs[0].token_ids) == (ids, tokens)
    for kwargs, words in [
        ({"patch_size": 8}, "'patch_size' is the vision tower's own"),
        ({"max_pixels": 10**12}, "whole numbers in [1, 16777216]"),
        ({"size": {"longest_edge": -1}}, "whole numbers in [1, 16777216]"),
    ]:
        prompt = {**as_prompt(f"See {IMAGE}", [img]), "mm_processor_kwargs": kwargs}
        with pytest.raises(InvalidRequestError) as info:
            llm.generate(prompt, GREEDY)
        assert words in str(info.value)


def test_preempted_image_requests_resume_with_their_positions(paths):
    path = paths["2"]
    cases = [CASES[0], CASES[2], (f"Then {IMAGE}", [image(5, (32, 48))]), CASES[1]]
    expected = [hf_greedy(path, t, i, n=24)[1] for t, i in cases]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    got, stats = concurrent_requests(
        path,
        [as_prompt(*case) for case in cases],
        params,
        max_model_len=128,
        block_size=16,
        num_gpu_blocks_override=8,  # 4 requests need 17 blocks: forces preemption
        max_num_batched_tokens=32,
        limit_mm_per_prompt={"image": 2},
        distributed_executor_backend="uni",
    )
    assert got == expected
    assert stats.num_preemptions > 0, "the small KV cache should have forced preemption"


def test_mrope_positions_equal_get_rope_index(paths):
    # Any run of a request's tokens (a chunk starting mid-image, decode tokens) gets the
    # positions transformers computes for the whole sequence, and its decode-time delta.
    import numpy as np
    from qwen2_vl_reference import hf_parts

    from trillm.messages import MultiModalItem
    from trillm.worker.mrope_positions import mrope_positions

    path = paths["2"]
    text, images = CASES[2]
    enc = hf_inputs(path, text, images)
    hf_model = hf_parts(path)[0]
    ref, delta = hf_model.model.get_rope_index(
        enc["input_ids"], enc["mm_token_type_ids"], enc["image_grid_thw"]
    )
    ids = enc["input_ids"][0].tolist()
    items, start = [], 0
    for grid in enc["image_grid_thw"].tolist():
        offset = ids.index(4098, start)
        length = grid[0] * grid[1] * grid[2] // 4
        items.append(MultiModalItem("image", "h", offset, length, b"", [*grid, 96]))
        start = offset + length
    n = len(ids)
    for lo, hi in [(0, n), (9, 30), (n - 3, n)]:
        got = mrope_positions(items, np.arange(lo, hi), 2)
        assert got.tolist() == ref[:, 0, lo:hi].tolist()
    decode = np.arange(n, n + 4)  # each row the index plus transformers' rope_deltas
    assert mrope_positions(items, decode, 2).tolist() == [list(decode + int(delta))] * 3


def test_the_hubs_flat_config_layout_loads_the_same_model(paths, tmp_path):
    # Hub folders keep the decoder's fields at the top level, M-RoPE as rope_scaling's
    # {"type": "mrope"}, and the rope_theta transformers defaults to 1e6 when absent.
    import json
    import shutil

    folder = tmp_path / "flat"
    shutil.copytree(paths["2"], folder)
    data = json.loads((folder / "config.json").read_text())
    text = data.pop("text_config")
    rope = text.pop("rope_parameters")
    text["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    (folder / "config.json").write_text(json.dumps({**data, **text}))
    llm = LLM(str(folder), kv_cache_memory="8MiB", distributed_executor_backend="uni")
    try:
        assert llm.engine.config.model.rope_theta == 1e6
        text, images = CASES[0]
        out = llm.generate(as_prompt(text, images), GREEDY)[0]
    finally:
        llm.shutdown()
    assert out.outputs[0].token_ids == hf_greedy(str(folder), text, images)[1]


def test_config_fields_trillm_cannot_run_are_refused(paths, tmp_path):
    import json
    import shutil

    from trillm.config import EngineArgs
    from trillm.engine.config_builder import build_config

    config = build_config(EngineArgs(paths["2"]))
    assert config.model.hf_config["rope_parameters"]["mrope_section"] == [2, 3, 3]
    assert config.limit_mm_per_prompt == {"image": 1, "video": 1}
    for change, words in [
        ({"use_sliding_window": True}, "use_sliding_window is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope_type 'yarn'"),
        ({"rope_parameters": {"rope_type": "default", "mrope_section": [2, 2]}}, "mrope_section"),
    ]:
        folder = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        shutil.copytree(paths["2"], folder)
        data = json.loads((folder / "config.json").read_text())
        data["text_config"].update(change)
        (folder / "config.json").write_text(json.dumps(data))
        with pytest.raises(ValueError, match=words):
            LLM(str(folder), kv_cache_memory="8MiB", distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="'merge_size' is the vision tower's own"):
        kwargs = {"kv_cache_memory": "8MiB", "distributed_executor_backend": "uni"}
        LLM(paths["2"], mm_processor_kwargs={"merge_size": 1}, **kwargs)
    with pytest.raises(InvalidRequestError, match="takes no audio inputs"):
        llm = LLM(paths["2.5"], kv_cache_memory="8MiB", distributed_executor_backend="uni")
        try:
            llm.generate({"prompt": "x", "multi_modal_data": {"audio": [image(0)]}}, GREEDY)
        finally:
            llm.shutdown()
