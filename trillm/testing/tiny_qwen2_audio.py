"""A tiny random Qwen2-Audio checkpoint (Whisper-style audio encoder + projector + Qwen2
decoder) with its processor files: the shipped tokenizer plus Qwen2-Audio's audio tokens, and
a Whisper feature extractor in ``preprocessor_config.json``, as a hub folder has them. The
encoder's window is one second (``chunk_length`` 1, 100 mel frames, 50 source positions), so
a full-length clip is 25 audio tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trillm.testing.tiny_models import BASE, DEFAULT_MODEL_DIR, write_generation_config

AUDIO_TOKENS = ("<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>")
SAMPLING_RATE = 16000
CHUNK_SECONDS = 1
NUM_MEL_BINS = 16
AUDIO: dict[str, Any] = dict(
    num_mel_bins=NUM_MEL_BINS,
    encoder_layers=2,
    encoder_attention_heads=4,
    encoder_ffn_dim=64,
    d_model=32,
    max_source_positions=CHUNK_SECONDS * SAMPLING_RATE // 160 // 2,
)
# Qwen2-Audio's processor's default template (the hub's Instruct folder has one like it)
CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'audio' %}{% set audio_count.value = audio_count.value + 1 %}"
    "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_qwen2_audio(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write the checkpoint, tokenizer and feature extractor config to ``out_dir``."""
    import torch
    from transformers import (
        AutoTokenizer,
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        WhisperFeatureExtractor,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    tok.add_special_tokens({"additional_special_tokens": list(AUDIO_TOKENS)})
    text = {**BASE, "model_type": "qwen2", "vocab_size": 4104}
    config = Qwen2AudioConfig(
        audio_config={**AUDIO, "model_type": "qwen2_audio_encoder"},
        text_config=text,
        audio_token_index=tok.convert_tokens_to_ids("<|AUDIO|>"),
    )
    torch.manual_seed(seed)
    Qwen2AudioForConditionalGeneration(config).save_pretrained(out, safe_serialization=True)
    features = WhisperFeatureExtractor(
        feature_size=NUM_MEL_BINS, sampling_rate=SAMPLING_RATE, chunk_length=CHUNK_SECONDS
    )
    features.save_pretrained(out)  # preprocessor_config.json
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    write_generation_config(out)
    return out
