"""A tiny GGUF file from a tiny Hugging Face checkpoint (``tiny_models.build_tiny_model``), the
way llama.cpp's converter lays it out, and the same weights dequantized as an HF folder.

``write_tiny_gguf(hf_dir, out_dir, types)`` quantizes each 2-D weight in the GGML type that
``types`` gives its GGUF name (``attn_q``, ``ffn_down``, ``token_embd``, ...; F32 when absent;
a layer's own name such as ``blk.1.attn_v`` first, as llama.cpp's mixed formats vary by layer),
permutes a llama model's q/k rows as llama.cpp does, stores the tokenizer (a byte-level BPE:
``gpt2`` in GGUF terms) and chat template in the metadata, and writes ``out_dir/model.gguf``
and ``out_dir/dequantized/`` (config, tokenizer, and the weights after quantize-dequantize in
Hugging Face's order): what trillm and transformers must reproduce from the GGUF.

The gguf package cannot quantize to the K-quants (Q2_K .. Q6_K): a tensor of such a type gets
random blocks instead (``random_kquant_blocks``: every bit pattern is a valid block, the fp16
super-block scales chosen to keep the values small), and the checkpoint's weights become their
values as the gguf package dequantizes them. Rows must be whole blocks of 256 values.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

ARCH_NAMES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf: str) -> str:
    base, _, kind = hf.rpartition(".")
    if base in _TOP:
        return f"{_TOP[base]}.{kind}"
    _, _, layer, rest = base.split(".", 3)  # model.layers.N.<rest>
    return f"blk.{layer}.{_GGUF_NAMES[rest]}.{kind}"


def permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for its rotary layout."""
    n = rows.shape[0]
    return (
        rows.reshape(heads, 2, n // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
    )


# K-quant type -> (block bytes, offsets of its fp16 d / dmin, their magnitude): d * largest
# scale * largest quant stays near 0.1-0.5, small weights like a trained model's
_KQUANT_FIELDS = {
    "Q2_K": (84, (80, 82), 2e-3),
    "Q3_K": (110, (108,), 7e-4),
    "Q4_K": (144, (0, 2), 1e-4),
    "Q5_K": (176, (0, 2), 5e-5),
    "Q6_K": (210, (208,), 3e-5),
}


def random_kquant_blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """[rows, cols / 256 * block bytes] uint8: random blocks of a K-quant type."""
    size, offsets, scale = _KQUANT_FIELDS[type_name]
    if cols % 256:
        raise ValueError(f"{type_name} rows are whole blocks of 256 values, not {cols}.")
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
    for offset in offsets:
        d = (scale * rng.uniform(0.5, 1.0, len(blocks))).astype(np.float16)
        blocks[:, offset : offset + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def write_tiny_gguf(hf_dir: str | Path, out_dir: str | Path, types: dict[str, str]) -> Path:
    import gguf
    import torch
    from safetensors.torch import load_file, save_file

    hf_dir, out = Path(hf_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((hf_dir / "config.json").read_text())
    arch = ARCH_NAMES[config["architectures"][0]]
    state = load_file(str(hf_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(str(out / "model.gguf"), arch)
    _write_config(writer, config)
    _write_tokenizer(writer, hf_dir, config)
    dequantized: dict[str, torch.Tensor] = {}
    for hf, tensor in state.items():
        name = gguf_name(hf)
        values = tensor.to(torch.float32).numpy()
        base = name.rpartition(".")[0]  # blk.N.attn_v: one layer's tensor, before attn_v's
        kind = gguf.GGMLQuantizationType[types.get(base, types.get(name.split(".")[-2], "F32"))]
        if values.ndim == 2 and kind.name in _KQUANT_FIELDS:
            rows, cols = values.shape
            raw = random_kquant_blocks(kind.name, rows, cols, seed=len(dequantized))
            values = gguf.quants.dequantize(raw, kind).astype(np.float32)
        elif values.ndim == 2 and kind != gguf.GGMLQuantizationType.F32:
            raw = gguf.quants.quantize(values, kind)  # [N, bytes], rows in HF order
            values = gguf.quants.dequantize(raw, kind).astype(np.float32)
        else:
            raw, kind = values, gguf.GGMLQuantizationType.F32
        dequantized[hf] = torch.from_numpy(np.ascontiguousarray(values))
        if arch == "llama" and name.split(".")[-2] in ("attn_q", "attn_k"):
            heads = config["num_attention_heads" if "attn_q" in name else "num_key_value_heads"]
            raw = permute(raw, heads)
        writer.add_tensor(name, np.ascontiguousarray(raw), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    folder = out / "dequantized"
    shutil.copytree(hf_dir, folder, dirs_exist_ok=True)
    save_file(dequantized, str(folder / "model.safetensors"))
    return out / "model.gguf"


def _write_config(writer: Any, config: dict[str, Any]) -> None:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    from trillm.model_executor.model_config import parse_rope

    theta, scaling = parse_rope(config)
    writer.add_rope_freq_base(theta)  # transformers-5 rope_parameters too
    if scaling is not None and scaling["rope_type"] == "llama3":  # as llama.cpp's converter
        import gguf

        from trillm.model_executor.gguf_loader import ROPE_FREQS, llama3_factors

        factors = llama3_factors(scaling, theta, head_dim).astype(np.float32)
        writer.add_tensor(ROPE_FREQS, factors, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])


def _write_tokenizer(writer: Any, hf_dir: Path, config: dict[str, Any]) -> None:
    import gguf

    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    special = {t["id"] for t in tok["added_tokens"] if t.get("special")}
    for t in tok["added_tokens"]:
        vocab[t["content"]] = t["id"]
    tokens = [""] * config["vocab_size"]
    for text, i in vocab.items():
        tokens[i] = text
    types = [
        gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
        for i in range(len(tokens))
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config.get("pad_token_id") or 0)
    writer.add_add_bos_token(False)
    tok_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    template_file = hf_dir / "chat_template.jinja"
    template = (
        template_file.read_text() if template_file.is_file() else tok_config.get("chat_template")
    )
    if template:
        writer.add_chat_template(template)
