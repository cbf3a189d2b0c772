"""A multimodal Llama 4 checkpoint (``Llama4ForConditionalGeneration``: the language model
under ``text_config`` / ``language_model.*``, a vision model and projector beside it) on text
prompts: greedy tokens and logprobs equal transformers' ``Llama4ForConditionalGeneration`` on
prompts of different lengths, batched, whole and in 7-token prefill chunks; its vision tensors
are loaded (images: ``test_llama4_vision.py``; under TP / PP:
``tests/parallel/test_llama4_vision_parallel.py``); videos and what the config asks that trillm
does not run are refused by name.
"""

from __future__ import annotations

import pytest
import torch
from runner_harness import (
    check_logprobs,
    load_runner,
    make_runner,
    random_prompts,
    run_requests,
    transformers_greedy,
)

from trillm.config import EngineArgs
from trillm.engine.config_builder import build_config
from trillm.model_executor import llama4_config
from trillm.model_executor.layers.linear import loaded_parameters
from trillm.testing.tiny_llama4 import build_tiny_llama4_conditional

MAX_NEW = 8
PROMPT_LENS = [3, 29, 12, 41]  # across 0, 2 and 3 of the 12-token attention chunks
ARCH = "Llama4ForConditionalGeneration"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import transformers

    path = build_tiny_llama4_conditional(tmp_path_factory.mktemp("llama4_mm"))
    hf = transformers.Llama4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    return path, hf.eval()


@pytest.mark.parametrize("chunk", [None, 7], ids=["whole", "chunk7"])
def test_text_greedy_and_logprobs_match_transformers(model, chunk):
    path, hf = model
    runner = make_runner(path)
    assert runner.model.__class__.__name__ == ARCH
    prompts = random_prompts(PROMPT_LENS)
    reqs = run_requests(runner, prompts, MAX_NEW, chunk=chunk, logprobs=2, prompt_logprobs=2)
    assert [r.output for r in reqs] == [transformers_greedy(hf, p, MAX_NEW)[0] for p in prompts]
    check_logprobs(hf, reqs, MAX_NEW, k_prompt=2, k=2)  # within 1e-4


def test_the_vision_tensors_are_loaded(model):
    path, hf = model
    params = dict(loaded_parameters(load_runner(path).model))  # packed weights read back
    for name in (
        "vision_model.patch_embedding.linear.weight",
        "multi_modal_projector.linear_1.weight",
    ):
        assert torch.equal(params[name], hf.state_dict()[name])


def test_video_inputs_are_refused_naming_the_model(model):
    with pytest.raises(ValueError, match=rf"\['video'\]=1: {ARCH} takes no video"):
        build_config(EngineArgs(str(model[0]), limit_mm_per_prompt={"video": 1}))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"text_config": {"model_type": "llama"}}, "'llama' language model is not supported"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings=true at the top level"),
    ],
)
def test_config_fields_it_cannot_run_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        llama4_config.conditional_text_config({"text_config": {}, **fields})


def test_the_text_config_is_read_as_llama4_text():
    hf = {"text_config": {"num_hidden_layers": 2, "hidden_size": 64}, "dtype": "bfloat16"}
    text = llama4_config.prepare(llama4_config.conditional_text_config(hf), ARCH)
    assert text["dtype"] == "bfloat16" and text["moe_layers"] == [0, 1]
