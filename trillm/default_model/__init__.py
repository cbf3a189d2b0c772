"""The embedded default model: what ``trillm serve`` runs when no MODEL is given.

The package ships it whole: the project's BPE tokenizer (trillm/testing/tokenizer_builder.py),
a chat template, and the weights of a 2.4M-parameter Llama the project trained on the King
James Bible (public domain, from Debian's ``bible-kjv`` package) with
``python -m trillm.testing.train_default_model --minutes 70 --threads 1`` (3,282 steps of
16 x 128 tokens, training loss 2.1), so its output reads like text. Should the weights be
missing (a trimmed install), seeded random weights of the same architecture are built on first
use in the user's cache directory instead, so a fresh machine with no network still serves.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
NAME = "trillm-default"
VERSION = "v1"  # bump when the architecture or seed below changes
ARCH = "llama"
CONFIG: dict[str, Any] = dict(
    hidden_size=192,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)
SEED = 1234


def cache_dir() -> Path:
    root = os.environ.get("TRILLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "trillm"
    )
    return Path(root)


def shipped_weights() -> bool:
    return (HERE / "model.safetensors").exists() and (HERE / "config.json").exists()


def ensure_default_model() -> Path:
    """The folder of the default model, building it on first use (atomic, race-free)."""
    if shipped_weights():
        return HERE
    target = cache_dir() / f"{NAME}-{VERSION}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    from trillm.testing.tiny_models import build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=target.parent))
    try:
        build_tiny_model(ARCH, tmp, seed=SEED, **CONFIG)
        try:
            os.rename(tmp, target)  # another process may have won the race: keep theirs
        except OSError:
            pass
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
