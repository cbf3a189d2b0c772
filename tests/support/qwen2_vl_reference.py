"""transformers' Qwen2-VL / Qwen2.5-VL as the reference for the image tests: the processor's
expanded prompt (``Qwen2VLProcessor``'s rule, applied here: transformers' processor class
cannot be built without torchvision's video processor), the model's greedy continuation (EOS
ignored) and its log-probabilities over the whole sequence (M-RoPE positions from
``mm_token_type_ids``, as the processor returns them)."""

from __future__ import annotations

from functools import cache
from typing import Any

IMAGE_PAD = "<|image_pad|>"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


@cache
def hf_parts(path: str) -> tuple[Any, Any, Any]:
    from transformers import AutoConfig, AutoTokenizer
    from transformers import Qwen2_5_VLForConditionalGeneration as V25
    from transformers import Qwen2VLForConditionalGeneration as V2
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    arch = AutoConfig.from_pretrained(path).architectures[0]
    model = (V2 if arch == "Qwen2VLForConditionalGeneration" else V25).from_pretrained(path)
    model.eval()
    model.generation_config.eos_token_id = None  # references run to max_new_tokens
    images = Qwen2VLImageProcessorPil.from_pretrained(path)
    return model, AutoTokenizer.from_pretrained(path), images


def hf_inputs(path: str, text: str, images: list[Any], **kwargs: Any) -> dict[str, Any]:
    """The processor's outputs: each ``<|image_pad|>`` expanded to its image's merged patches."""
    import torch

    _, tok, processor = hf_parts(path)
    enc: dict[str, Any] = {}
    if images:
        enc = dict(processor(images=images, return_tensors="pt", **kwargs))
        merged = enc["image_grid_thw"].prod(-1) // processor.merge_size**2
        pieces = text.split(IMAGE_PAD)
        assert len(pieces) == len(images) + 1
        text = pieces[0] + "".join(IMAGE_PAD * int(n) + p for n, p in zip(merged, pieces[1:]))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    enc["input_ids"] = torch.tensor([ids])
    pad = tok.convert_tokens_to_ids(IMAGE_PAD)
    enc["mm_token_type_ids"] = (enc["input_ids"] == pad).int()
    return enc


def hf_greedy(
    path: str, text: str, images: list[Any], n: int = 8, **kwargs: Any
) -> tuple[list[int], list[int], Any]:
    """(the expanded prompt ids, the greedy continuation of ``n`` tokens, the log-softmax of
    every row of prompt + continuation [P + n, V], row i scoring token i + 1)."""
    import torch

    model, _, _ = hf_parts(path)
    enc = hf_inputs(path, text, images, **kwargs)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=0)
        ids = enc["input_ids"][0].tolist()
        tokens = out[0, len(ids) :].tolist()
        assert len(tokens) == n, "the reference must not stop at EOS"
        whole = {**enc, "input_ids": out, "mm_token_type_ids": None}
        pad = enc["mm_token_type_ids"]
        whole["mm_token_type_ids"] = torch.cat([pad, torch.zeros(1, n, dtype=pad.dtype)], 1)
        logprobs = torch.log_softmax(model(**whole).logits[0].float(), -1)
    return ids, tokens, logprobs


def max_logprob_diff(output: Any, ids: list[int], logprobs: Any) -> float:
    """The largest |difference| between a trillm output's prompt and sample log-probabilities
    (of the prompt's and the sampled tokens) and the reference's rows."""
    tokens = output.outputs[0].token_ids
    seq = ids + tokens
    ours = [entry[seq[i]].logprob for i, entry in enumerate(output.prompt_logprobs) if i]
    ours += [entry[t].logprob for entry, t in zip(output.outputs[0].logprobs, tokens)]
    ref = [float(logprobs[i - 1, seq[i]]) for i in range(1, len(seq))]
    assert len(ours) == len(ref)
    return max(abs(a - b) for a, b in zip(ours, ref, strict=True))
