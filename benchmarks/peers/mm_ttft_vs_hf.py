"""Time to first token of a one-image chat request: ``trillm serve`` over HTTP against
transformers in process (the folder's ``LlavaProcessor``, then ``generate`` of one token), on
the same random LLaVA checkpoint and the same image each round.

Each round takes a new image (so neither side's caches hold it: trillm's processed-image and
prefix caches key on the pixels) and measures both sides back to back, alternating which goes
first; the result is the per-round ratio's median. trillm's figure is the whole request (HTTP,
base64 and image decoding, the image processor, the vision tower, the prefill, one token);
transformers' is its processor call and ``generate(max_new_tokens=1)``, nothing over a wire.

    python benchmarks/peers/mm_ttft_vs_hf.py --rounds 7 --out benchmarks/peers/results/X.json
    python benchmarks/peers/mm_ttft_vs_hf.py --model ~/.cache/trillm-bench/llava-clip336-llama3.2-1b \
        --dtype float32 --max-model-len 1024 --kv-cache-memory 256MiB --rounds 5

(the second folder comes from ``benchmarks/peers/make_llava_1b.py``). ``--dtype`` loads both
sides in that dtype; each round records the 1-minute load average, since another job may be
loading the machine: compare the two sides within a round, not runs with each other.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.common import machine_info, set_threads, trillm_server, write_json  # noqa: E402

QUESTION = "What is in this picture?"


def image(seed: int, width: int, height: int) -> Any:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def data_url(img: Any) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def trillm_ms(url: str, img: Any | None) -> float:
    """One request for one token, from sending to the answer, in ms (``img`` None: the
    question alone, the server's own share without an image)."""
    import httpx

    content: list[dict[str, Any]] = [{"type": "text", "text": QUESTION}]
    if img is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": data_url(img)}})
    body = {
        "model": "llava",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 1,
        "temperature": 0.0,
    }
    start = time.perf_counter()
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=1800)
    elapsed = (time.perf_counter() - start) * 1e3
    response.raise_for_status()
    return elapsed


class HF:
    """transformers' LLaVA and processor on the folder, as a user would run them."""

    def __init__(self, folder: str, dtype: str) -> None:
        import torch
        from transformers import LlavaForConditionalGeneration, LlavaProcessor

        torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
        self.model = LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch_dtype)
        self.model.eval()
        self.processor = LlavaProcessor.from_pretrained(folder)
        messages = [{"role": "user", "content": "<image>\n" + QUESTION}]
        self.text = self.processor.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )

    def ms(self, img: Any) -> float:
        import torch

        start = time.perf_counter()
        inputs = self.processor(images=[img], text=self.text, return_tensors="pt")
        with torch.inference_mode():
            self.model.generate(**inputs, max_new_tokens=1, do_sample=False)
        return (time.perf_counter() - start) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a LLaVA folder (default: the tiny test one)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--image-size", default="640x480", help="WIDTHxHEIGHT of each image")
    p.add_argument(
        "--dtype", default="auto", help="both sides: auto (the checkpoint's), float32, ..."
    )
    p.add_argument("--max-model-len", default="512")
    p.add_argument("--kv-cache-memory", default="64MiB")
    p.add_argument("--server-log", type=Path, default=None, help="trillm serve's output")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    set_threads(args.threads)
    width, height = (int(x) for x in args.image_size.split("x"))
    folder = args.model
    if folder is None:
        from trillm.testing.tiny_llava import build_tiny_llava

        folder = str(build_tiny_llava(tempfile.mkdtemp(prefix="tiny-llava-")))
    hf = HF(folder, args.dtype)
    serve = ["--served-model-name", "llava", "--max-model-len", args.max_model_len]
    serve += ["--dtype", args.dtype, "--kv-cache-memory", args.kv_cache_memory]
    with trillm_server(folder, serve, timeout_s=1800, log_path=args.server_log) as (url, _):
        trillm_ms(url, image(10_000, width, height))  # warm-up: first-use costs, both sides
        hf.ms(image(10_001, width, height))
        rows = []
        for r in range(args.rounds):
            img = image(r, width, height)
            if r % 2 == 0:
                ours, theirs = trillm_ms(url, img), hf.ms(img)
            else:
                theirs, ours = hf.ms(img), trillm_ms(url, img)
            text = trillm_ms(url, None)
            rows.append(
                {
                    "round": r,
                    "trillm_ms": ours,
                    "hf_ms": theirs,
                    "ratio": theirs / ours,
                    "trillm_text_only_ms": text,
                    "load_1m": os.getloadavg()[0],
                }
            )
            print(
                f"round {r}: trillm {ours:.1f} ms (text only {text:.1f}), transformers "
                f"{theirs:.1f} ms, load {rows[-1]['load_1m']:.2f}",
                flush=True,  # rounds of a large model take minutes: show them as they end
            )
    result = {
        "command": "python benchmarks/peers/mm_ttft_vs_hf.py " + " ".join(sys.argv[1:]),
        "model": args.model or "trillm.testing.tiny_llava (CLIP 32 px, 3 layers; Llama 2 layers)",
        "image": f"{width}x{height} random RGB PNG, a new one each round",
        "threads": args.threads,
        "dtype": args.dtype,
        "rounds": rows,
        "median_trillm_ms": statistics.median(r["trillm_ms"] for r in rows),
        "median_hf_ms": statistics.median(r["hf_ms"] for r in rows),
        "median_trillm_text_only_ms": statistics.median(r["trillm_text_only_ms"] for r in rows),
        "median_ratio_hf_over_trillm": statistics.median(r["ratio"] for r in rows),
        "machine": machine_info(),
    }
    print(
        f"median TTFT: trillm {result['median_trillm_ms']:.1f} ms, transformers "
        f"{result['median_hf_ms']:.1f} ms; transformers / trillm "
        f"{result['median_ratio_hf_over_trillm']:.2f}x (per-round median)"
    )
    write_json(args.out, result)


if __name__ == "__main__":
    main()
