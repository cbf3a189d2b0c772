"""Llama 4 with images (``Llama4ForConditionalGeneration``'s vision model, pixel-shuffle adapter
and projector) through the Python API: the image processing equals transformers'
``Llama4ImageProcessor`` (digests recorded where torchvision loads), each ``<|image|>`` expands
as ``Llama4Processor`` expands it (tiles, separators, the global tile), and greedy tokens and
prompt / sample log-probabilities equal transformers' on a batch mixing a tiled image, two
images and a text-only request with prefill chunked across the image spans; preempted image
requests resume; what the model cannot run is refused by name."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from llama4_reference import IMAGE, PROCESSOR_DIGESTS, hf_greedy
from llava_reference import chat_text, image
from mm_engine import (
    GREEDY,
    SCORED,
    UNI,
    as_prompt,
    batch_logprob_diff,
    check_preempted_resume,
    encoder_calls,
    module_llm,
)

from trillm import LLM
from trillm.engine.llama4_inputs import Llama4ImageProcessing
from trillm.engine.preprocess import InvalidRequestError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BUDGET = 16  # max_num_batched_tokens: a tiled image's 27-token span crosses two chunks
PATCH_ID, TILE_X_ID, TILE_Y_ID = 4099, 4100, 4101
CASES = [
    (f"Describe {IMAGE} now", [image(0, (50, 40))]),  # 2x2 tiles and the global tile
    ("The license grants", []),
    (f"{IMAGE} first, then {IMAGE} second", [image(1, (32, 32)), image(2, (33, 31))]),
]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from trillm.testing.tiny_llama4 import build_tiny_llama4_conditional

    return str(build_tiny_llama4_conditional(tmp_path_factory.mktemp("tiny-llama4-vision")))


@pytest.fixture(scope="module")
def llm(path):
    yield from module_llm(
        path, max_model_len=256, max_num_batched_tokens=BUDGET, limit_mm_per_prompt={"image": 2}
    )


@pytest.mark.parametrize("key", list(PROCESSOR_DIGESTS), ids=str)
def test_processing_equals_transformers_image_processor(key):
    tile, max_patches, size = key
    ratio, digest = PROCESSOR_DIGESTS[key]
    out = Llama4ImageProcessing(tile, max_patches=max_patches)(image(3, size))
    values = np.asarray(out["pixel_values"], dtype=np.float32)
    assert out["aspect_ratio"] == ratio
    assert len(values) == ratio[0] * ratio[1] + (ratio[0] * ratio[1] > 1)
    assert hashlib.sha256(values.tobytes()).hexdigest()[:16] == digest


def test_mixed_batch_equals_transformers_tokens_and_logprobs(llm, path):
    before = encoder_calls(llm)
    outs = llm.generate([as_prompt(t, i) for t, i in CASES], SCORED, use_tqdm=False)
    assert encoder_calls(llm) == before + 3  # once per image, however many chunks
    assert batch_logprob_diff(path, CASES, outs, hf_greedy) < 1e-4
    tiled = outs[0].prompt_token_ids
    # 4 tiles and the global one of 4 patches; a column separator in each of 2 rows, 2 rows
    assert [tiled.count(t) for t in (PATCH_ID, TILE_X_ID, TILE_Y_ID)] == [20, 2, 2]


def test_chat_image_parts_become_the_image_token(llm, path):
    img = image(4, (64, 40))
    parts = [{"type": "image_pil", "image_pil": img}, {"type": "text", "text": "What?"}]
    out = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)[0]
    ids, tokens, _ = hf_greedy(path, chat_text(path, f"{IMAGE}\nWhat?"), [img])
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == (ids, tokens)


def test_mm_processor_kwargs(llm, path):
    img = image(5, (96, 40))  # 1x3 tiles by default, one tile with max_patches 1
    prompt = {**as_prompt(f"See {IMAGE}", [img]), "mm_processor_kwargs": {"max_patches": 1}}
    out = llm.generate(prompt, GREEDY)[0]
    assert out.prompt_token_ids.count(PATCH_ID) == 4
    for kwargs, match in [
        ({"size": {"height": 16, "width": 16}}, "'size' not taken"),
        ({"max_patches": 0}, r"max_patches'\] must be a whole number in \[1, 64\]"),
    ]:
        prompt = {**as_prompt(f"See {IMAGE}", [img]), "mm_processor_kwargs": kwargs}
        with pytest.raises(InvalidRequestError, match=match):
            llm.generate(prompt, GREEDY)


def test_preempted_image_requests_resume(path):
    cases = [CASES[0], CASES[2], CASES[1], (f"Wide {IMAGE}", [image(6, (100, 30))])]
    check_preempted_resume(
        path,
        cases,
        [as_prompt(*case) for case in cases],
        hf_greedy,
        max_model_len=128,
        num_gpu_blocks_override=8,  # 4 requests of 30-60 tokens need 15 blocks: preemption
        max_num_batched_tokens=64,
        limit_mm_per_prompt={"image": 2},
    )


def _copy_with(path: str, tmp_path: Path, name: str, **fields: object) -> str:
    folder = tmp_path / "copy"
    shutil.copytree(path, folder)
    data = json.loads((folder / name).read_text())
    (folder / name).write_text(json.dumps({**data, **fields}))
    return str(folder)


@pytest.mark.parametrize(
    ("name", "fields", "match"),
    [
        ("preprocessor_config.json", {"resample": 3}, "resample 3 is not supported"),
        ("preprocessor_config.json", {"size": {"height": 16, "width": 16}}, "not the vision"),
        ("preprocessor_config.json", {"do_pad": True}, "image processor's do_pad not supported"),
        ("processor_config.json", {"patch_size": 14}, "patch_size 14 is not the vision tower's 8"),
    ],
)
def test_processor_configs_it_cannot_run_are_refused_at_load(path, tmp_path, name, fields, match):
    folder = _copy_with(path, tmp_path, name, **fields)
    with pytest.raises(ValueError, match=match):
        LLM(folder, max_model_len=256, limit_mm_per_prompt={"image": 1}, **UNI)
