"""The 2-layer tiny models every parallel layout is checked on (one per family; GPT-NeoX and
Qwen2 with random biases), their prompts and limits, and ``served_matches_uni``: a parallel
``trillm serve`` against the one-rank engine."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import httpx
import torch
from parallel_reference import limit_flags, reference_tokens
from safetensors.torch import load_file, save_file
from server_harness import ServerProcess

from trillm.testing.tiny_models import ARCHES

PROMPTS = ["Hello there, how", "The capital of France is", "1 2 3 4 5"]
MAX_TOKENS = 8
LIMITS = {"max_model_len": 64, "kv_cache_memory": "4MiB"}

OVERRIDES: dict[str, dict[str, Any]] = {  # beyond num_hidden_layers=2
    "gemma2": {"initializer_range": 0.05},
    "gemma3": {"initializer_range": 0.02},
    "olmo2": {"num_key_value_heads": 1},
}


# Families whose checkpoints get random biases (transformers initialises them to zero), so that
# a row-parallel bias added on every rank instead of once would change the tokens.
BIASED = ("gpt_neox", "qwen2")


def biased_models(tiny_model_factory, tmp_path_factory):
    """``make(arch) -> path``: the family's 2-layer tiny checkpoint (random biases where BIASED)."""
    biased: dict[str, str] = {}  # arch -> the copy with random biases (the factory's is shared)

    def make(arch: str) -> str:
        overrides = {"num_hidden_layers": 2, **OVERRIDES.get(arch, {})}
        path = tiny_model_factory(arch, **overrides)
        if arch not in BIASED:
            return path
        if arch not in biased:
            copy = tmp_path_factory.mktemp(f"biased-{arch}")
            shutil.copytree(path, copy, dirs_exist_ok=True)
            with_random_biases(copy)
            biased[arch] = str(copy)
        return biased[arch]

    return make


def with_random_biases(folder: Path) -> None:
    """Every projection bias of the checkpoint in ``folder`` drawn at random (norms keep theirs)."""
    (file,) = folder.glob("*.safetensors")
    weights = load_file(file)
    gen = torch.Generator().manual_seed(0)
    for name, tensor in weights.items():
        if name.endswith(".bias") and "norm" not in name:
            weights[name] = 0.2 * torch.randn(tensor.shape, generator=gen)  # [out]
    save_file(weights, file, metadata={"format": "pt"})


TWO_PROMPTS = PROMPTS[:2]
ARCHITECTURES = sorted(set(ARCHES) - {"llama"})  # Llama: see the table above


def served_tokens(server: ServerProcess) -> list[list[int]]:
    """Greedy tokens of both prompts, from one request."""
    body = {
        "prompt": TWO_PROMPTS,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = httpx.post(server.base_url + "/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    return [c["token_ids"] for c in choices]


def served_matches_uni(path: str, parallel_flags: list[str], log: Path) -> None:
    """``trillm serve path *parallel_flags`` answers TWO_PROMPTS with the uni engine's tokens."""
    expected = reference_tokens(path, TWO_PROMPTS, MAX_TOKENS, **LIMITS)
    # A reference that only repeats one token per prompt could not tell a wrong shard apart.
    assert all(len(set(t)) > 1 for t in expected), expected
    server = ServerProcess([path, *parallel_flags, *limit_flags(LIMITS)], log).start()
    try:
        assert served_tokens(server) == expected, server.log()
    finally:
        server.stop()
