"""Tiny DeepSeek-V3 checkpoints with a multi-token-prediction layer (``model.layers.{L}``), which
transformers neither writes nor reads: built here from a second random V3's last (MoE) layer.

``with_mtp_layer``: a random MTP layer (its own norms, ``eh_proj``, embeddings and head, or the
target's). ``agreeing_pair``: a target whose layers add ``scale`` of their output (0: a bigram
model, logits from the token alone) and an MTP layer that predicts that bigram (its decoder
layer adds nothing, ``eh_proj`` passes the embedding through, the target's norm and head), so
its drafts are right as often as the target is nearly a bigram model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from trillm.testing.tiny_deepseek import build_tiny_deepseek

CASE = "v3"  # q-LoRA, noaux_tc routing with a correction bias, YaRN, interleaved rope


def _layers(folder: Path) -> int:
    return int(json.loads((folder / "config.json").read_text())["num_hidden_layers"])


def _save(weights: dict[str, torch.Tensor], folder: Path) -> None:
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _donor_layer(root: Path, last: int, to: int) -> dict[str, torch.Tensor]:
    """A second random V3's last layer, renamed to layer ``to``."""
    donor = build_tiny_deepseek(CASE, root / "donor", seed=1)
    prefix = f"model.layers.{last}."
    return {
        f"model.layers.{to}." + k.removeprefix(prefix): v
        for k, v in load_file(str(donor / "model.safetensors")).items()
        if k.startswith(prefix)
    }


def with_mtp_layer(target: Path, out: Path, *, own_embed_and_head: bool = True) -> Path:
    """A copy of ``target`` with a random MTP layer."""
    shutil.copytree(target, out)
    weights = load_file(str(out / "model.safetensors"))
    n = _layers(out)
    weights.update(_donor_layer(out.parent / f"{out.name}-donor", n - 1, n))
    gen = torch.Generator().manual_seed(2)
    h, vocab = weights["model.norm.weight"].shape[0], weights["lm_head.weight"].shape[0]
    p = f"model.layers.{n}."
    for name in ("enorm", "hnorm", "shared_head.norm"):
        weights[p + name + ".weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    weights[p + "eh_proj.weight"] = 0.2 * torch.randn(h, 2 * h, generator=gen)
    if own_embed_and_head:
        weights[p + "embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
        weights[p + "shared_head.head.weight"] = 0.2 * torch.randn(vocab, h, generator=gen)
    _save(weights, out)
    return out


def agreeing_pair(target: Path, out: Path, scale: float) -> Path:
    """A copy of ``target`` damped by ``scale``, with an MTP layer that predicts its bigram."""
    shutil.copytree(target, out)
    weights = load_file(str(out / "model.safetensors"))
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * scale
    n = _layers(out)
    mtp = _donor_layer(out.parent / f"{out.name}-donor", n - 1, n)
    for name in mtp:  # the decoder layer adds nothing to h'
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            mtp[name] = torch.zeros_like(mtp[name])
    weights.update(mtp)
    h = weights["model.norm.weight"].shape[0]
    p = f"model.layers.{n}."
    weights[p + "enorm.weight"] = torch.ones(h)
    weights[p + "hnorm.weight"] = torch.ones(h)
    weights[p + "eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    weights[p + "shared_head.norm.weight"] = weights["model.norm.weight"].clone()
    _save(weights, out)  # no embed_tokens / shared_head.head: the target's are used
    return out
