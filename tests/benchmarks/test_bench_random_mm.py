"""``trillm bench serve --dataset-name random-mm`` (vLLM's dataset and ``--random-mm-*``
flags): the random prompts with random JPEG images of the bucket sizes, as many per request as
the base and ratio draw within the limits; video buckets and bad values refused by name; and a
run against a tiny LLaVA server where every request (and the probe) carries its images."""

from __future__ import annotations

import argparse
import base64
import io

import httpx
import numpy as np
import pytest
from bench_stub import load, run_bench
from PIL import Image
from server_harness import ServerProcess, metric_value

from trillm.bench import mm_dataset, serve_flags
from trillm.bench.datasets import DatasetError

NAME = "tiny-llava"


@pytest.fixture(scope="module")
def llava_path(tmp_path_factory):
    from trillm.testing.tiny_llava import build_tiny_llava

    return str(build_tiny_llava(tmp_path_factory.mktemp("tiny-llava-bench")))


@pytest.fixture(scope="module")
def tokenizer(llava_path):
    from trillm.bench.datasets import BenchTokenizer

    return BenchTokenizer(llava_path)  # what --tokenizer PATH gives


def dataset_args(**overrides: object) -> argparse.Namespace:
    base = dict(
        num_prompts=6,
        random_input_len=8,
        random_output_len=4,
        random_range_ratio=0.0,
        random_prefix_len=0,
        seed=0,
        random_mm_base_items_per_request=1,
        random_mm_num_mm_items_range_ratio=0.0,
        random_mm_limit_mm_per_prompt=serve_flags.DEFAULT_LIMITS,
        random_mm_bucket_config="{(24, 40, 1): 0.5, (36, 20, 1): 0.5, (720, 1280, 16): 0.0}",
    )
    return argparse.Namespace(**{**base, **overrides})


def sizes(part: dict) -> tuple[int, int]:
    """(height, width) of an image_url data-URL part's JPEG."""
    url = part["image_url"]["url"]
    assert url.startswith("data:image/jpeg;base64,")
    with Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))) as img:
        return img.height, img.width


def test_requests_carry_images_of_the_bucket_sizes(tokenizer):
    reqs = mm_dataset.build_random_mm(dataset_args(), tokenizer, chat=True)
    assert len(reqs) == 6 and all(len(r.mm_content) == 1 for r in reqs)
    seen = {sizes(r.mm_content[0]) for r in reqs}
    assert seen <= {(24, 40), (36, 20)} and len(seen) == 2
    content = reqs[0].content()
    assert content[0] == {"type": "text", "text": reqs[0].prompt} and content[1:] == [
        reqs[0].mm_content[0]
    ]
    assert all(r.prompt_len == len(tokenizer.encode(r.prompt)) for r in reqs)


def test_texts_never_hold_a_special_token(tokenizer):
    # random's ids span the whole vocabulary, <image> (the last id) included: a prompt holding
    # it would ask for an image it does not carry (the server's 400)
    from trillm.bench.datasets import build_random

    texts = build_random(300, 32, 4, seed=0, tokenizer=tokenizer, as_text=True)
    assert any("<image>" in t.prompt for t in texts)
    args = dataset_args(num_prompts=300, random_input_len=32)
    reqs = mm_dataset.build_random_mm(args, tokenizer, chat=True)
    assert not any("<image>" in r.prompt for r in reqs)


def test_items_per_request_follow_the_base_ratio_and_limits(tokenizer):
    args = dataset_args(
        num_prompts=40,
        random_mm_base_items_per_request=2,
        random_mm_num_mm_items_range_ratio=0.5,
        random_mm_limit_mm_per_prompt='{"image": 2}',
    )
    counts = [len(r.mm_content) for r in mm_dataset.build_random_mm(args, tokenizer, chat=True)]
    assert set(counts) == {1, 2}  # drawn in [1, 3], clamped to the limit of 2
    rng = np.random.default_rng(0)
    drawn = mm_dataset.item_counts(rng, 400, 2, 0.5, {"image": 9})
    assert set(drawn.tolist()) == {1, 2, 3}
    none = dataset_args(random_mm_limit_mm_per_prompt='{"image": 0}')
    assert all(not r.mm_content for r in mm_dataset.build_random_mm(none, tokenizer, True))


@pytest.mark.parametrize(
    "overrides,words",
    [
        ({"random_mm_bucket_config": "{(64, 64, 8): 1.0}"}, "video bucket"),
        ({"random_mm_bucket_config": "{(64, 64): 1.0}"}, "is not (height, width, frames)"),
        ({"random_mm_bucket_config": "not a dict"}, "must be a dict like"),
        ({"random_mm_bucket_config": "{(64, 64, 1): 0.0}"}, "sum to 0"),
        ({"random_mm_bucket_config": "{(8192, 64, 1): 1.0}"}, "sides must be in"),
        ({"random_mm_limit_mm_per_prompt": "{bad"}, "not valid JSON"),
        ({"random_mm_limit_mm_per_prompt": '{"image": -1}'}, "counts >= 0"),
        ({"random_mm_limit_mm_per_prompt": '{"smell": 1}'}, "unknown modality 'smell'"),
        ({"random_mm_num_mm_items_range_ratio": 1.5}, "in [0, 1]"),
        ({"random_mm_base_items_per_request": -1}, "must be >= 0"),
    ],
)
def test_bad_values_are_refused_by_name(tokenizer, overrides, words):
    with pytest.raises(DatasetError) as info:
        mm_dataset.build_random_mm(dataset_args(**overrides), tokenizer, chat=True)
    assert words in str(info.value)


def test_the_completions_endpoint_is_refused(tokenizer):
    with pytest.raises(DatasetError, match="use --backend openai-chat"):
        mm_dataset.build_random_mm(dataset_args(), tokenizer, chat=False)


def test_a_run_against_a_llava_server(llava_path, tmp_path):
    args = [llava_path, "--served-model-name", NAME, "--max-model-len", "128"]
    args += ["--kv-cache-memory", "4MiB", "--distributed-executor-backend", "uni"]
    args += ["--limit-mm-per-prompt", '{"image": 2}']
    srv = ServerProcess(args, tmp_path / "server.log").start()
    try:
        flags = (
            f"--backend openai-chat --base-url {srv.url} --endpoint /v1/chat/completions "
            f"--model {NAME} --tokenizer {llava_path} --dataset-name random-mm "
            "--num-prompts 4 --random-input-len 8 --random-output-len 3 --ignore-eos "
            f"--random-mm-base-items-per-request 2 --result-dir {tmp_path} "
            "--result-filename r.json --save-result --disable-tqdm"
        ).split()
        proc = run_bench(
            flags
            + ["--random-mm-limit-mm-per-prompt", '{"image": 2, "video": 0}']
            + ["--random-mm-bucket-config", "{(24, 40, 1): 0.5, (36, 20, 1): 0.5}"]
        )
        assert proc.returncode == 0, proc.output + srv.log()
        result = load(tmp_path / "r.json")
        assert (result["completed"], result["failed"]) == (4, 0)
        assert result["total_output_tokens"] == 4 * 3
        text = httpx.get(srv.url + "/metrics", timeout=10).text
        assert metric_value(text, "vllm:mm_cache_queries_total") == 2 * (4 + 1)  # + the probe
    finally:
        assert srv.stop() == 0, srv.log()
