"""``--dataset-name random-mm`` (vLLM's): random text prompts, as ``random`` builds them, each
with random images, sent as ``image_url`` data-URL parts of a chat message after the text
(so the chat endpoint only: ``--backend openai-chat``).

vLLM's flags and defaults: ``--random-mm-base-items-per-request`` (1) items a request, drawn
within ``--random-mm-num-mm-items-range-ratio`` (0.0) of it and clamped to the sum of
``--random-mm-limit-mm-per-prompt`` ('{"image": 255, "video": 0}'); each item's size from
``--random-mm-bucket-config`` ('{(256, 256, 1): 0.5, (720, 1280, 1): 0.5, (720, 1280, 16):
0.0}': (height, width, frames) -> probability; one frame is an image, more a video). When a
modality reaches its limit its buckets leave the draw and the others' probabilities are
renormalised. Videos (buckets of more than one frame with a probability above 0) and audio
are refused: the benchmark does not send videos yet.
"""

from __future__ import annotations

import ast
import base64
import io
import json
from typing import Any

import numpy as np

from trillm.bench.datasets import BenchRequest, DatasetError, TokenizerLike, build_random
from trillm.bench.serve_flags import DEFAULT_BUCKETS

Bucket = tuple[int, int, int]  # (height, width, frames)
MAX_SIDE = 4096  # the server's pixel budget is 4096 x 4096: a larger image is a 400 there


def parse_limits(text: str) -> dict[str, int]:
    """``--random-mm-limit-mm-per-prompt``: a JSON object of modality -> count >= 0."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise DatasetError(f"--random-mm-limit-mm-per-prompt is not valid JSON: {e}") from None
    ok = isinstance(value, dict) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value.values()
    )
    if not ok:
        raise DatasetError(
            "--random-mm-limit-mm-per-prompt must be an object of counts >= 0, e.g. "
            f"'{{\"image\": 2}}', got {text!r}."
        )
    unknown = sorted(set(value) - {"image", "video", "audio"})
    if unknown:
        raise DatasetError(f"--random-mm-limit-mm-per-prompt: unknown modality {unknown[0]!r}.")
    return dict(value)


def parse_buckets(text: str) -> dict[Bucket, float]:
    """``--random-mm-bucket-config``: a Python dict literal of (height, width, frames) ->
    probability (vLLM's form); the probabilities are normalised to sum to 1."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise DatasetError(
            f"--random-mm-bucket-config must be a dict like {DEFAULT_BUCKETS}, got {text!r}."
        ) from None
    if not isinstance(value, dict) or not value:
        raise DatasetError(f"--random-mm-bucket-config must be a non-empty dict, got {text!r}.")
    buckets: dict[Bucket, float] = {}
    for key, p in value.items():
        if not (
            isinstance(key, tuple) and len(key) == 3 and all(isinstance(x, int) for x in key)
        ) or not (isinstance(p, int | float) and p >= 0):
            raise DatasetError(
                f"--random-mm-bucket-config: {key!r}: {p!r} is not (height, width, frames): "
                "probability >= 0."
            )
        buckets[key] = float(p)
    total = sum(buckets.values())
    if total <= 0:
        raise DatasetError("--random-mm-bucket-config: the probabilities sum to 0.")
    return {k: p / total for k, p in buckets.items()}


def check_buckets(buckets: dict[Bucket, float]) -> None:
    """Images only (frames 1), of sides within [1, MAX_SIDE]."""
    for (height, width, frames), p in buckets.items():
        if p > 0 and frames != 1:
            raise DatasetError(
                f"--random-mm-bucket-config: ({height}, {width}, {frames}) is a video bucket; "
                "the benchmark's video requests are not implemented yet (give it probability 0)."
            )
        if p > 0 and not (0 < height <= MAX_SIDE and 0 < width <= MAX_SIDE):
            raise DatasetError(
                f"--random-mm-bucket-config: ({height}, {width}, {frames}): sides must be in "
                f"[1, {MAX_SIDE}]."
            )


def modality(bucket: Bucket) -> str:
    return "image" if bucket[2] == 1 else "video"


def item_counts(
    rng: np.random.Generator, n: int, base: int, ratio: float, limits: dict[str, int]
) -> np.ndarray:
    """Items per request: uniform in [floor(base(1-r)), ceil(base(1+r))], at most the sum of
    the limits (vLLM's rule)."""
    if base < 0:
        raise DatasetError(f"--random-mm-base-items-per-request must be >= 0, got {base}.")
    if not 0.0 <= ratio <= 1.0:
        raise DatasetError(f"--random-mm-num-mm-items-range-ratio must be in [0, 1], got {ratio}.")
    low = int(np.floor(base * (1 - ratio)))
    high = int(np.ceil(base * (1 + ratio)))
    return np.minimum(rng.integers(low, high + 1, size=n), sum(limits.values()))


def draw_buckets(
    rng: np.random.Generator, count: int, buckets: dict[Bucket, float], limits: dict[str, int]
) -> list[Bucket]:
    """``count`` item sizes; a modality at its limit leaves the draw (the rest renormalised)."""
    used = {m: 0 for m in limits}
    out: list[Bucket] = []
    for _ in range(count):
        open_ = [
            (b, p)
            for b, p in buckets.items()
            if p > 0 and used.get(modality(b), 0) < limits.get(modality(b), 0)
        ]
        if not open_:
            break
        probs = np.array([p for _, p in open_])
        bucket = open_[int(rng.choice(len(open_), p=probs / probs.sum()))][0]
        used[modality(bucket)] += 1
        out.append(bucket)
    return out


def image_part(rng: np.random.Generator, height: int, width: int) -> dict[str, Any]:
    """A random RGB image as a JPEG data-URL ``image_url`` part (vLLM's encoding)."""
    from PIL import Image

    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG")
    url = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


class _PlainText:
    """The tokenizer, its special tokens never decoded into a prompt: a random text holding
    a model's image placeholder would ask for an image the request does not carry."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        special = getattr(tokenizer, "special_ids", None)
        self.special = special() if special else set(tokenizer.all_special_ids)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode([i for i in ids if i not in self.special]))


def build_random_mm(args: Any, tokenizer: TokenizerLike | None, chat: bool) -> list[BenchRequest]:
    """The random prompts (``--random-input-len`` ...) with their images."""
    if not chat:
        raise DatasetError(
            "--dataset-name random-mm sends images in chat messages: use --backend openai-chat "
            "(or --endpoint /v1/chat/completions)."
        )
    limits = parse_limits(args.random_mm_limit_mm_per_prompt)
    buckets = parse_buckets(args.random_mm_bucket_config)
    check_buckets(buckets)
    texts = build_random(
        args.num_prompts,
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        args.random_prefix_len,
        seed=args.seed,
        tokenizer=None if tokenizer is None else _PlainText(tokenizer),
        as_text=True,
    )
    rng = np.random.default_rng(args.seed + 1)  # its own stream: the texts equal random's
    counts = item_counts(
        rng,
        len(texts),
        args.random_mm_base_items_per_request,
        args.random_mm_num_mm_items_range_ratio,
        limits,
    )
    out = []
    for req, count in zip(texts, counts, strict=True):
        sizes = draw_buckets(rng, int(count), buckets, limits)
        parts = tuple(image_part(rng, h, w) for h, w, _ in sizes)
        out.append(BenchRequest(req.prompt, req.prompt_len, req.expected_output_len, parts))
    return out
