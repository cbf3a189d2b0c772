"""transformers' Qwen2-Audio as the reference for the audio tests: ``Qwen2AudioProcessor`` (the
folder's Whisper feature extractor and tokenizer) expands the prompt and computes the
features, the model's greedy continuation (EOS ignored) and its log-probabilities over the
whole sequence; and the test clips: tones as float arrays and as WAV files of any width."""

from __future__ import annotations

import base64
import io
import wave
from functools import cache
from typing import Any

import numpy as np

AUDIO = "<|audio_bos|><|AUDIO|><|audio_eos|>"
RATE = 16000


@cache
def hf_parts(path: str) -> tuple[Any, Any]:
    from transformers import (
        AutoTokenizer,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    model = Qwen2AudioForConditionalGeneration.from_pretrained(path)
    model.eval()
    model.generation_config.eos_token_id = None  # references run to max_new_tokens
    processor = Qwen2AudioProcessor(
        feature_extractor=WhisperFeatureExtractor.from_pretrained(path),
        tokenizer=AutoTokenizer.from_pretrained(path),
    )
    return model, processor


def hf_inputs(path: str, text: str, clips: list[np.ndarray]) -> dict[str, Any]:
    """The processor's outputs (clips at 16 kHz): each ``<|AUDIO|>`` expanded."""
    _, processor = hf_parts(path)
    if not clips:
        return dict(processor.tokenizer(text, add_special_tokens=False, return_tensors="pt"))
    return dict(processor(text=text, audio=clips, sampling_rate=RATE, return_tensors="pt"))


def hf_greedy(
    path: str, text: str, clips: list[np.ndarray], n: int = 8
) -> tuple[list[int], list[int], Any]:
    """(the expanded prompt ids, the greedy continuation of ``n`` tokens, the log-softmax of
    every row of prompt + continuation [P + n, V], row i scoring token i + 1)."""
    import torch

    model, _ = hf_parts(path)
    enc = hf_inputs(path, text, clips)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=0)
        ids = enc["input_ids"][0].tolist()
        tokens = out[0, len(ids) :].tolist()
        assert len(tokens) == n, "the reference must not stop at EOS"
        whole = {**enc, "input_ids": out, "attention_mask": torch.ones_like(out)}
        logprobs = torch.log_softmax(model(**whole).logits[0].float(), -1)
    return ids, tokens, logprobs


def tone(seed: int, seconds: float, rate: int = RATE) -> np.ndarray:
    """A few random sines and some noise, float32 in [-1, 1]."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    freqs, phases = rng.uniform(100, 3000, 3), rng.uniform(0, 6.3, 3)
    wave_ = sum(np.sin(2 * np.pi * f * t + p) for f, p in zip(freqs, phases, strict=True))
    return (0.25 * wave_ + 0.05 * rng.standard_normal(len(t))).astype(np.float32)


def wav_bytes(samples: np.ndarray, rate: int = RATE, width: int = 2, channels: int = 1) -> bytes:
    """``samples`` (float, [-1, 1]) as a PCM WAV file of ``width`` bytes per sample, the mono
    signal on every channel."""
    scale = 2 ** (8 * width - 1)
    ints = np.clip(np.round(samples * scale), -scale, scale - 1).astype(np.int64)
    if width == 1:
        raw = (ints + 128).astype(np.uint8).tobytes()
    else:
        little = ints.astype("<i8").view(np.uint8).reshape(-1, 8)[:, :width]
        raw = little.tobytes()
    frames = np.repeat(np.frombuffer(raw, np.uint8).reshape(-1, width), channels, axis=0)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(channels)
        f.setsampwidth(width)
        f.setframerate(rate)
        f.writeframes(frames.tobytes())
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def max_logprob_diff(output: Any, ids: list[int], logprobs: Any) -> float:
    """The largest |difference| between a trillm output's prompt and sample log-probabilities
    and the reference's rows."""
    tokens = output.outputs[0].token_ids
    seq = ids + tokens
    ours = [entry[seq[i]].logprob for i, entry in enumerate(output.prompt_logprobs) if i]
    ours += [entry[t].logprob for entry, t in zip(output.outputs[0].logprobs, tokens)]
    ref = [float(logprobs[i - 1, seq[i]]) for i in range(1, len(seq))]
    assert len(ours) == len(ref)
    return max(abs(a - b) for a, b in zip(ours, ref, strict=True))
