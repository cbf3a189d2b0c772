"""Qwen2-Audio config.json: the Qwen2 decoder's fields under ``text_config``, the audio
encoder's under ``audio_config``, the placeholder ``audio_token_index``; what trillm cannot
run is refused by name. Torch-free: the frontend reads it."""

from __future__ import annotations

from typing import Any

QWEN2_AUDIO_ARCHITECTURE = "Qwen2AudioForConditionalGeneration"
# transformers' Qwen2AudioConfig default placeholder id (<|AUDIO|>)
DEFAULT_AUDIO_TOKEN_INDEX = 151646
_TEXT_MODELS = ("qwen2",)
_AUDIO_MODELS = ("qwen2_audio_encoder",)
_SHARED_KEYS = ("dtype", "torch_dtype")
# Frames after a clip's last one that the encoder's edge convolutions read (kept in its item)
CONTEXT_FRAMES = 2


def audio_positions(frames: int) -> int:
    """Encoder positions (after the stride-2 convolution) of a clip of ``frames`` frames."""
    return (frames - 1) // 2 + 1


def audio_tokens(frames: int) -> int:
    """``<|AUDIO|>`` tokens of a clip of ``frames`` mel frames (transformers' processor's
    count: the average pooling halves the positions)."""
    return (audio_positions(frames) - 2) // 2 + 1


def is_qwen2_audio(mm_config: dict[str, Any]) -> bool:
    return "audio_config" in mm_config


def audio_token_id(mm_config: dict[str, Any]) -> int:
    return int(
        mm_config.get(
            "audio_token_index", mm_config.get("audio_token_id", DEFAULT_AUDIO_TOKEN_INDEX)
        )
    )


def qwen2_audio_text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config (with the checkpoint's dtype); another language model or audio
    encoder is refused."""
    text = dict(hf.get("text_config") or {})
    audio = hf.get("audio_config")
    if not isinstance(audio, dict):
        raise ValueError(f"{QWEN2_AUDIO_ARCHITECTURE}: config.json has no audio_config.")
    for what, kind, known in (
        ("language model", text.get("model_type", "qwen2"), _TEXT_MODELS),
        ("audio encoder", audio.get("model_type", "qwen2_audio_encoder"), _AUDIO_MODELS),
    ):
        if kind not in known:
            raise ValueError(
                f"{QWEN2_AUDIO_ARCHITECTURE} with a {kind!r} {what} is not supported; "
                f"supported: {', '.join(known)}."
            )
    if text.get("use_sliding_window"):
        raise ValueError(f"{QWEN2_AUDIO_ARCHITECTURE}: use_sliding_window is not supported yet.")
    text["sliding_window"] = None  # what transformers' Qwen2 sets without use_sliding_window
    for key in _SHARED_KEYS:
        if key in hf and key not in text:
            text[key] = hf[key]
    return text
