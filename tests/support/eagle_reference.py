"""A dense reference for EAGLE / EAGLE-3 drafting, written from the heads' published semantics
(EAGLE's cnets.py, vLLM's llama_eagle.py / llama_eagle3.py) on transformers' Llama pieces
(RMSNorm, rotary embedding): the target's states from transformers' ``hidden_states``, the
head's whole sequence recomputed at every draft with causal attention, no cache.

``reference_drafts(target, head, method, prompt_ids, next_token, k)``: the k tokens the head
proposes after the prompt's prefill step sampled ``next_token``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    files = list(folder.glob("*.safetensors"))
    raw = load_file(str(files[0])) if files else torch.load(folder / "pytorch_model.bin")
    return {k.replace("midlayer.", "layers.0.").removeprefix("model."): v for k, v in raw.items()}


class _Head:
    def __init__(self, folder: str, target: transformers.LlamaForCausalLM, method: str) -> None:
        path = Path(folder)
        self.cfg = transformers.LlamaConfig(**json.loads((path / "config.json").read_text()))
        self.w = _weights(path)
        self.eagle3 = method == "eagle3"
        self.target = target
        self.rotary = LlamaRotaryEmbedding(self.cfg)

    def norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        layer = LlamaRMSNorm(x.shape[-1], self.cfg.rms_norm_eps)
        layer.weight.data = self.w[name]
        return layer(x)

    def linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.w[f"{name}.weight"], self.w.get(f"{name}.bias"))

    def attention(self, p: str, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cfg, t = self.cfg, x.shape[0]
        d, hq, hk = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        q = self.linear(f"{p}.q_proj", x).view(t, hq, d).transpose(0, 1)[None]
        k = self.linear(f"{p}.k_proj", x).view(t, hk, d).transpose(0, 1)[None]
        v = self.linear(f"{p}.v_proj", x).view(t, hk, d).transpose(0, 1)[None]
        cos, sin = self.rotary(v, positions[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.linear(f"{p}.o_proj", out[0].transpose(0, 1).reshape(t, hq * d))

    def mlp(self, p: str, x: torch.Tensor) -> torch.Tensor:
        gate = torch.nn.functional.silu(self.linear(f"{p}.gate_proj", x))
        return self.linear(f"{p}.down_proj", gate * self.linear(f"{p}.up_proj", x))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.w.get("embed_tokens.weight", self.target.model.embed_tokens.weight)
        return table[ids]

    def forward(self, ids, hidden, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (for the logits, to feed back), as the heads define them."""
        e = self.embed(ids)
        if getattr(self.cfg, "add_para_norm", False):  # HASS
            e = self.norm("embedding_layernorm.weight", e)
            hidden = self.norm("hidden_states_layernorm.weight", hidden)
        if self.eagle3:
            normed = self.norm("layers.0.hidden_norm.weight", hidden)
            residual = normed if self.cfg.norm_before_residual else hidden
            x = torch.cat([self.norm("layers.0.input_layernorm.weight", e), normed], -1)
        else:
            x = self.linear("fc", torch.cat([e, hidden], -1))
            residual = x
        residual = residual + self.attention("layers.0.self_attn", x, positions)
        x = self.norm("layers.0.post_attention_layernorm.weight", residual)
        residual = residual + self.mlp("layers.0.mlp", x)
        for i in range(1, self.cfg.num_hidden_layers):  # plain pre-norm Llama layers
            x = self.norm(f"layers.{i}.input_layernorm.weight", residual)
            residual = residual + self.attention(f"layers.{i}.self_attn", x, positions)
            x = self.norm(f"layers.{i}.post_attention_layernorm.weight", residual)
            residual = residual + self.mlp(f"layers.{i}.mlp", x)
        if not self.eagle3:
            return residual, residual
        return self.norm("norm.weight", residual), residual

    def draft(self, state: torch.Tensor) -> int:
        if "lm_head.weight" not in self.w:
            return int(self.target.lm_head(state).argmax())
        top = int(torch.nn.functional.linear(state, self.w["lm_head.weight"]).argmax())
        return top + int(self.w["d2t"][top]) if "d2t" in self.w else top


@functools.cache
def _target_model(folder: str) -> transformers.LlamaForCausalLM:
    return transformers.LlamaForCausalLM.from_pretrained(folder)


@torch.no_grad()
def reference_drafts(
    target: str, head: str, method: str, prompt: list[int], next_token: int, k: int
) -> list[int]:
    model = _target_model(target)
    h = _Head(head, model, method)
    states = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    if method == "eagle3":
        layers = (2, model.config.num_hidden_layers // 2, model.config.num_hidden_layers - 3)
        hidden = h.linear("fc", torch.cat([states[i][0] for i in layers], -1))
    else:
        hidden = states[-1][0]  # after the final norm
    ids = torch.tensor(prompt[1:] + [next_token])
    drafts: list[int] = []
    for _ in range(k):
        out, back = h.forward(ids, hidden, torch.arange(len(ids)))
        drafts.append(h.draft(out[-1]))
        ids = torch.cat([ids, torch.tensor(drafts[-1:])])
        hidden = torch.cat([hidden, back[-1:]])
    return drafts
