"""An MXFP4 gpt-oss checkpoint made from an unquantized one, in the layout transformers saves
(``integrations/mxfp4.py``): each expert tensor ``[E, in, out]`` becomes ``<name>_blocks``
``[E, out, in / 32, 16]`` uint8 (two e2m1 codes a byte, low nibble first) and ``<name>_scales``
``[E, out, in / 32]`` uint8 (e8m0, bias 127), and config.json gets the quantization_config the
hub's gpt-oss checkpoints carry."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

# e2m1 magnitudes by code (codes 8-15: the same, negative)
_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
EXPERT_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, in, out]`` -> (blocks [E, out, in/32, 16], scales [E, out, in/32]): each group's
    scale the power of two that brings its largest value under 6, values rounded to the
    nearest e2m1 code."""
    rows = weight.float().transpose(1, 2)  # [E, out, in]
    groups = rows.reshape(*rows.shape[:2], -1, 32)  # [E, out, G, 32]
    amax = groups.abs().amax(-1).clamp(min=2.0**-100)  # [E, out, G]
    exponent = torch.ceil(torch.log2(amax / 6.0)).to(torch.int32)
    scaled = groups / torch.exp2(exponent.float())[..., None]
    codes = (scaled.abs()[..., None] - _MAGNITUDES).abs().argmin(-1)  # [E, out, G, 32]
    codes = codes + 8 * (scaled < 0)
    pairs = codes.to(torch.uint8).reshape(*codes.shape[:-1], 16, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


def write_mxfp4_copy(source: str | Path, target: Path) -> Path:
    """A copy of the gpt-oss folder ``source`` whose expert weights are MXFP4."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    weights = load_file(target / "model.safetensors")
    for name in [n for n in weights if n.endswith(EXPERT_TENSORS)]:
        blocks, scales = quantize(weights.pop(name))
        weights[f"{name}_blocks"], weights[f"{name}_scales"] = blocks, scales
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIG
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target
