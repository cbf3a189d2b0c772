"""transformers' LLaVA as the reference for the image tests: seeded test images, and the
processor's expanded prompt with the model's greedy continuation (EOS ignored, as
``ignore_eos``)."""

from __future__ import annotations

import base64
import io
from functools import cache

import numpy as np
from PIL import Image


def image(seed: int, size: tuple[int, int] = (50, 40)) -> Image.Image:
    """A random RGB image of ``size`` (width, height)."""
    pixels = np.random.RandomState(seed).rand(size[1], size[0], 3) * 255
    return Image.fromarray(pixels.astype("uint8"))


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    """A small PNG whose header claims ``width`` x ``height`` pixels (a decompression bomb's
    shape: the size is read before any pixel is decoded)."""
    import struct
    import zlib

    data = bytearray(png(image(0, (8, 8))))
    data[16:24] = struct.pack(">II", width, height)  # IHDR's width and height
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))  # its CRC
    return bytes(data)


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@cache
def _hf(path: str):
    from transformers import LlavaForConditionalGeneration, LlavaProcessor

    model = LlavaForConditionalGeneration.from_pretrained(path).eval()
    model.generation_config.eos_token_id = None  # references run to max_new_tokens
    return model, LlavaProcessor.from_pretrained(path)


def hf_llava_greedy(
    path: str, text: str, images: list[Image.Image], n: int = 8, **processor_kwargs: object
) -> tuple[list[int], list[int]]:
    """(transformers' expanded prompt ids, its greedy continuation of ``n`` tokens);
    ``processor_kwargs`` reach the image processor (as ``mm_processor_kwargs``)."""
    import torch

    model, processor = _hf(path)
    enc = processor(images=images or None, text=text, return_tensors="pt", **processor_kwargs)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=0)
    ids = enc["input_ids"][0].tolist()
    tokens = out[0, len(ids) :].tolist()
    assert len(tokens) == n, "the reference must not stop at EOS"
    return ids, tokens


def chat_text(path: str, content: str) -> str:
    """One user message rendered by the model's chat template (the generation prompt added):
    what trillm renders for a chat whose image parts became ``<image>``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": content}]
    return str(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
