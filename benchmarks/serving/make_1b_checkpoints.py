"""Random-weight bf16 checkpoints in the exact shapes of Llama-3.2-1B and Qwen3-1.7B, for speed
figures at the sizes people run (issue 38). Built once outside the repository; a folder whose
``model.safetensors`` exists is skipped, so the script is idempotent.

    python benchmarks/serving/make_1b_checkpoints.py [--out ~/.cache/trillm-bench] [--models llama-3.2-1b]

The configs are the published ones (written here: no hub on these machines) except the
token ids: the tokenizer is SmolLM2-135M's (vocab 49,152) padded with reserved special tokens
``<|reserved_N|>`` to the model's vocabulary, so any sampled id detokenizes, and bos / eos are
that tokenizer's. Weights are N(0, 0.02) (norms 1): fine for speed, meaningless text; run
with ``ignore_eos`` to fix the lengths.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer

SMOLLM2 = Path("~/.cache/trillm-eagle/smollm2-135m-instruct").expanduser()
BOS, EOS = 1, 2  # SmolLM2's <|im_start|> / <|im_end|>

LLAMA_3_2_1B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}

QWEN3_1_7B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

MODELS = {"llama-3.2-1b": LLAMA_3_2_1B, "qwen3-1.7b": QWEN3_1_7B}


def layer_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """One decoder layer's tensors (HF names after ``model.layers.N.``) and their shapes."""
    h, d, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    if cfg["model_type"] == "qwen3":  # per-head q / k RMSNorm
        shapes["self_attn.q_norm.weight"] = (d,)
        shapes["self_attn.k_norm.weight"] = (d,)
    return shapes


def random_weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def tensor(shape: tuple[int, ...]) -> torch.Tensor:
        if len(shape) == 1:  # norm weights
            return torch.ones(shape, dtype=torch.bfloat16)
        return (torch.randn(shape, generator=g) * cfg["initializer_range"]).to(torch.bfloat16)

    out = {"model.embed_tokens.weight": tensor((cfg["vocab_size"], cfg["hidden_size"]))}
    out["model.norm.weight"] = tensor((cfg["hidden_size"],))
    for i in range(cfg["num_hidden_layers"]):
        for name, shape in layer_shapes(cfg).items():
            out[f"model.layers.{i}.{name}"] = tensor(shape)
    return out  # tied embeddings: no lm_head.weight


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    tok = Tokenizer.from_file(str(SMOLLM2 / "tokenizer.json"))
    base = tok.get_vocab_size(with_added_tokens=True)
    pads = [AddedToken(f"<|reserved_{i}|>", special=True) for i in range(vocab_size - base)]
    tok.add_special_tokens(pads)
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    tok.save(str(folder / "tokenizer.json"))
    tok_cfg = json.loads((SMOLLM2 / "tokenizer_config.json").read_text())
    tok_cfg.pop("added_tokens_decoder", None)  # tokenizer.json holds them, padding included
    tok_cfg["model_max_length"] = 131072
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    shutil.copy(SMOLLM2 / "chat_template.jinja", folder / "chat_template.jinja")


def build(name: str, out: Path, seed: int) -> Path:
    folder = out / name
    if (folder / "model.safetensors").exists():
        print(f"{folder}: exists, skipped")
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(MODELS[name], bos_token_id=BOS, eos_token_id=EOS)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS, "eos_token_id": EOS})
    )
    write_tokenizer(folder, cfg["vocab_size"])
    weights = random_weights(cfg, seed)
    n = sum(t.numel() for t in weights.values())
    tmp = folder / "model.safetensors.tmp"
    save_file(weights, str(tmp), metadata={"format": "pt"})
    tmp.rename(folder / "model.safetensors")  # last: its presence means the folder is complete
    print(f"{folder}: {n / 1e9:.3f} B parameters, {n * 2 / 1e9:.2f} GB bf16")
    return folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("~/.cache/trillm-bench"))
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for name in args.models:
        build(name, args.out.expanduser(), args.seed)


if __name__ == "__main__":
    sys.exit(main())
