"""The embedded default model: what ``trillm serve`` runs when no MODEL is given.

The package ships it whole: the project's BPE tokenizer (trillm/testing/tokenizer_builder.py),
a chat template, and the weights of a 2.4M-parameter Llama the project trained on the King
James Bible (public domain, from Debian's ``bible-kjv`` package) with
``python -m trillm.testing.train_default_model --minutes 70 --threads 1`` (3,282 steps of
16 x 128 tokens, training loss 2.1), so its output reads like text. An install without the
weights (a trimmed wheel) is refused with a clear error rather than served with random ones;
the package imports nothing from ``trillm.testing``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# The architecture trillm.testing.train_default_model trains (config.json has it all).
CONFIG: dict[str, Any] = dict(
    hidden_size=192,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)


def shipped_weights() -> bool:
    return (HERE / "model.safetensors").exists() and (HERE / "config.json").exists()


class DefaultModelMissingError(FileNotFoundError):
    """The package was installed without the default model's files."""


def ensure_default_model() -> Path:
    """The folder of the embedded default model."""
    if not shipped_weights():
        raise DefaultModelMissingError(
            f"The embedded default model is missing from this install ({HERE} has no "
            "model.safetensors / config.json): reinstall trillm, or pass a MODEL folder."
        )
    return HERE
