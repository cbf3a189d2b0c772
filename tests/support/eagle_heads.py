"""Tiny EAGLE / EAGLE-3 heads for a tiny Llama target, written in the published formats.

EAGLE (``yuhuili/EAGLE-LLaMA3-Instruct-8B``): ``pytorch_model.bin`` with ``fc``, ``layers.0.*``
(no ``input_layernorm``) and a copy of the target's ``embed_tokens``; config.json is a
``LlamaForCausalLM`` one. EAGLE-3 (``LlamaForCausalLMEagle3``): model.safetensors with
``midlayer.*`` (q/k/v 2H wide, ``hidden_norm``), ``fc`` [H, 3H], ``norm``, its own ``lm_head``
over a smaller vocabulary and ``d2t`` / ``t2d``; no embeddings (the target's are shared).

Both are built to agree with a target that is a bigram model (``damped_target`` 0: its o_proj
and down_proj are zero, so its hidden state at p is norm(embed(token p)) and its next token a
function of the last one): the EAGLE head's stream is fc's copy of embed(token p + 1), whose
argmax under the shared lm_head is the target's next token; the EAGLE-3 head's attention
looks only at its own row (q = k = a large bias, RoPE with theta 2: every other distance
scores far lower) and carries norm(embed(token p + 1)) through V and o_proj to its lm_head,
the target's rows over the tokens the target can produce (its residual, hidden_norm's output,
is made small by that norm's weight). On a damped target the same heads
are rough guesses: some drafts accepted, some rejected.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

HEADS, HEAD_DIM = 4, 16  # the heads' attention: 4 x 16 = the target's width 64


def _target(folder: str) -> tuple[dict, dict[str, torch.Tensor]]:
    cfg = json.loads((Path(folder) / "config.json").read_text())
    return cfg, load_file(str(Path(folder) / "model.safetensors"))


def damped_target(folder: str, out: Path, scale: float) -> str:
    """A copy of ``folder`` whose layers add ``scale`` times their output to the residual
    stream (0: a bigram model; small: mostly one)."""
    shutil.copytree(folder, out)
    _, weights = _target(folder)
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * scale
    save_file(weights, str(out / "model.safetensors"))
    return str(out)


def _head_config(target: dict, **fields) -> dict:
    return {
        "model_type": "llama",
        "vocab_size": target["vocab_size"],
        "hidden_size": target["hidden_size"],
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        **fields,
    }


def _layer(
    prefix: str, width: int, h: int, gen: torch.Generator, agree: bool
) -> dict[str, torch.Tensor]:
    """Random q/k/v and gate/up over ``width`` inputs; o_proj and down_proj zero where the
    head is to agree (its layer adds nothing), else random too."""

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.2

    out = torch.zeros if agree else rand
    return {
        f"{prefix}.self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, width),
        f"{prefix}.self_attn.k_proj.weight": rand(HEADS * HEAD_DIM, width),
        f"{prefix}.self_attn.v_proj.weight": rand(HEADS * HEAD_DIM, width),
        f"{prefix}.self_attn.o_proj.weight": out(h, HEADS * HEAD_DIM),
        f"{prefix}.mlp.gate_proj.weight": rand(96, h),
        f"{prefix}.mlp.up_proj.weight": rand(96, h),
        f"{prefix}.mlp.down_proj.weight": out(h, 96),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(h) if agree else 1 + rand(h),
    }


def _more_layers(
    weights: dict[str, torch.Tensor], layers: int, h: int, gen: torch.Generator, bias: bool
) -> None:
    """Random plain Llama layers 1 .. layers - 1 after the head's first (``bias``: the
    config's attention_bias, on q/k/v and o)."""
    for i in range(1, layers):
        weights.update(_layer(f"layers.{i}", h, h, gen, agree=False))
        weights[f"layers.{i}.input_layernorm.weight"] = 1 + torch.randn(h, generator=gen) * 0.2
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj") if bias else ():
            weights[f"layers.{i}.self_attn.{proj}.bias"] = torch.randn(h, generator=gen) * 0.2


def eagle_head(
    target_folder: str, out: Path, agree: bool = True, layers: int = 1, para_norms: bool = False
) -> str:
    """An EAGLE head whose output is embed(token p + 1) (fc = [I, 0], the layer adds 0), or
    with ``agree=False`` a random one (``layers`` deep; HASS's norms with ``para_norms``)."""
    target, tw = _target(target_folder)
    h = target["hidden_size"]
    out.mkdir(parents=True)
    gen = torch.Generator().manual_seed(1)
    weights = _layer("layers.0", h, h, gen, agree)
    weights["fc.weight"] = (
        torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
        if agree
        else torch.randn(h, 2 * h, generator=gen) * 0.2
    )
    weights["embed_tokens.weight"] = tw["model.embed_tokens.weight"].clone()
    _more_layers(weights, layers, h, gen, bias=False)
    for name in ("embedding_layernorm", "hidden_states_layernorm") if para_norms else ():
        weights[f"{name}.weight"] = 1 + torch.randn(h, generator=gen) * 0.2
    torch.save(weights, out / "pytorch_model.bin")
    cfg = _head_config(
        target,
        architectures=["LlamaForCausalLM"],
        bias=False,
        num_hidden_layers=layers,
        add_para_norm=para_norms,
    )
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def _reachable(tw: dict[str, torch.Tensor]) -> torch.Tensor:
    """[n] sorted: every token a bigram target's argmax can give."""
    embed = tw["model.embed_tokens.weight"]
    normed = embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True) + 1e-6)
    return torch.unique((normed @ tw["lm_head.weight"].T).argmax(-1))


def eagle3_head(target_folder: str, out: Path, agree: bool = True, layers: int = 1) -> str:
    """An EAGLE-3 head that attends to its own row and reads norm(embed(token p + 1)) there
    (``norm_before_residual``), or with ``agree=False`` a random one (the residual taken
    before hidden_norm); its vocabulary: the tokens a bigram target can produce (d2t maps
    them back)."""
    target, tw = _target(target_folder)
    h = target["hidden_size"]
    out.mkdir(parents=True)
    gen = torch.Generator().manual_seed(2)
    weights = _layer("midlayer", 2 * h, h, gen, agree)
    if agree:
        _attend_to_self(weights, h)
    else:
        for name in ("q_proj", "k_proj", "v_proj"):
            weights[f"midlayer.self_attn.{name}.bias"] = torch.randn(
                HEADS * HEAD_DIM, generator=gen
            )
        weights["midlayer.self_attn.o_proj.bias"] = torch.randn(h, generator=gen) * 0.2
        for name in ("midlayer.input_layernorm", "midlayer.hidden_norm", "norm"):
            weights[f"{name}.weight"] = 1 + torch.randn(h, generator=gen) * 0.2
    weights["fc.weight"] = torch.randn(h, 3 * h, generator=gen) * 0.2
    _more_layers(weights, layers, h, gen, bias=True)
    vocab = _reachable(tw)
    weights["lm_head.weight"] = tw["lm_head.weight"][vocab].clone()
    weights["d2t"] = vocab - torch.arange(len(vocab))
    t2d = torch.zeros(target["vocab_size"], dtype=torch.bool)
    t2d[vocab] = True
    weights["t2d"] = t2d
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    cfg = _head_config(
        target,
        architectures=["LlamaForCausalLMEagle3"],
        draft_vocab_size=len(vocab),
        attention_bias=True,
        rope_theta=2.0,
        target_hidden_size=h,
        norm_before_residual=agree,
        num_hidden_layers=layers,
    )
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def _attend_to_self(weights: dict[str, torch.Tensor], h: int) -> None:
    """q = k = a large bias: with RoPE at theta 2 distance 0 outscores every other by about
    70 in the softmax; V = o_proj's input = the normed embeddings; the residual (hidden_norm's
    output) made small by that norm's weight."""
    attn = "midlayer.self_attn"
    weights[f"{attn}.q_proj.weight"].zero_()
    weights[f"{attn}.k_proj.weight"].zero_()
    weights[f"{attn}.q_proj.bias"] = torch.full((HEADS * HEAD_DIM,), 8.0)
    weights[f"{attn}.k_proj.bias"] = torch.full((HEADS * HEAD_DIM,), 8.0)
    weights[f"{attn}.v_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], 1)
    weights[f"{attn}.v_proj.bias"] = torch.zeros(h)
    weights[f"{attn}.o_proj.weight"] = torch.eye(h)
    weights[f"{attn}.o_proj.bias"] = torch.zeros(h)
    weights["midlayer.input_layernorm.weight"] = torch.ones(h)
    weights["midlayer.hidden_norm.weight"] = torch.full((h,), 1e-3)
    weights["norm.weight"] = torch.ones(h)
