"""LLaVA's images under tensor parallelism: the vision tower and projector are whole on every
rank (each rank encodes an image itself, the same rows; the language model is sharded and its
vocabulary-parallel embedding is whole after its reduce, so the image rows overwrite the same
positions everywhere). TP=2 gives TP=1's greedy tokens and log-probs, and transformers' tokens,
for a batch mixing image and text-only requests with prefill chunked across image spans."""

from __future__ import annotations

import pytest
import torch
from llava_reference import hf_llava_greedy, image

from trillm.engine.llm import LLM
from trillm.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
PROMPTS = [
    {"prompt": "Describe <image> now", "multi_modal_data": {"image": image(0)}},
    "The license grants",
    {
        "prompt": "<image> a <image> b",
        "multi_modal_data": {"image": [image(1), image(2, (64, 32))]},
    },
]


@pytest.fixture(scope="module")
def llava_path(tmp_path_factory):
    from trillm.testing.tiny_llava import build_tiny_llava

    return str(build_tiny_llava(tmp_path_factory.mktemp("tiny-llava-tp")))


def run(path: str, **kwargs: object) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt ids, greedy tokens, their log-probs) of each prompt."""
    with LLM(
        path,
        max_model_len=128,
        kv_cache_memory="4MiB",
        max_num_batched_tokens=16,  # the image prompts' spans cross chunk boundaries
        limit_mm_per_prompt={"image": 2},
        **kwargs,
    ) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [
        (
            list(o.prompt_token_ids),
            list(o.outputs[0].token_ids),
            [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)],
        )
        for o in outs
    ]


def test_each_rank_reads_the_vision_side_whole(llava_path):
    from safetensors.torch import load_file

    from trillm.config import EngineArgs
    from trillm.distributed.sharding import RankShapes
    from trillm.engine.config_builder import build_config
    from trillm.model_executor.loader import iterate_weights, safetensors_files

    cfg = build_config(EngineArgs(llava_path, tensor_parallel_size=2)).model
    whole = {k: v for f in safetensors_files(llava_path) for k, v in load_file(f).items()}
    rank1 = dict(iterate_weights(llava_path, shard=(cfg, RankShapes.of(cfg, 1, 2))))
    vision = [k for k in whole if "vision_tower." in k or "multi_modal_projector." in k]
    assert any(k.endswith("self_attn.q_proj.weight") for k in vision)  # Llama-like names too
    assert all(torch.equal(rank1[k], whole[k]) for k in vision)
    text_q = next(k for k in whole if "language_model" in k and k.endswith("q_proj.weight"))
    assert rank1[text_q].shape[0] * 2 == whole[text_q].shape[0]  # the text side is sharded


def test_tp2_equals_tp1_and_transformers_with_images(llava_path):
    one = run(llava_path, distributed_executor_backend="uni")
    two = run(llava_path, tensor_parallel_size=2)
    assert [r[:2] for r in two] == [r[:2] for r in one]
    diff = max(abs(a - b) for r1, r2 in zip(one, two) for a, b in zip(r1[2], r2[2]))
    assert diff < 1e-4, diff
    reference = hf_llava_greedy(llava_path, "Describe <image> now", [image(0)], n=6)
    assert two[0][:2] == (reference[0], reference[1])
    print(f"max |logprob diff| TP=2 vs TP=1: {diff:.2e}")
