"""A dense reference for MTP drafting (DeepSeek-V3's multi-token-prediction layer, as vLLM's
``deepseek_mtp.py`` defines it), in torch ops on the checkpoint's weights: the target's final
states from transformers, the MTP layer's decoder layer run by transformers itself (loaded by
asking for one more layer than the config has), its whole sequence recomputed at every draft
with causal attention, no cache.

``reference_drafts(folder, prompt_ids, next_token, k)``: the k tokens the layer proposes after
the prompt's prefill step sampled ``next_token``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class _Mtp:
    def __init__(self, folder: str) -> None:
        path = Path(folder)
        n = int(json.loads((path / "config.json").read_text())["num_hidden_layers"])
        self.target = transformers.DeepseekV3ForCausalLM.from_pretrained(folder)
        # One more layer: transformers loads the MTP layer's decoder weights into it.
        longer = transformers.DeepseekV3ForCausalLM.from_pretrained(
            folder, num_hidden_layers=n + 1, attn_implementation="eager"
        )
        self.layer, self.rotary = longer.model.layers[n], longer.model.rotary_emb
        self.eps = self.target.config.rms_norm_eps
        raw = load_file(str(path / "model.safetensors"))
        p = f"model.layers.{n}."
        self.w = {k.removeprefix(p): v for k, v in raw.items() if k.startswith(p)}
        self.embed = self.w.get("embed_tokens.weight", raw["model.embed_tokens.weight"])
        self.head = self.w.get("shared_head.head.weight", raw["lm_head.weight"])

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [T] (token p + 1 at row p), hidden [T, H] -> (normed h' [T, H], h' [T, H])."""
        t = len(ids)
        e = self.embed[ids].clone()
        e[0] = 0  # position 0: vLLM masks the embedding there
        x = torch.cat(
            [
                _rms(e, self.w["enorm.weight"], self.eps),
                _rms(hidden, self.w["hnorm.weight"], self.eps),
            ],
            -1,
        )
        x = torch.nn.functional.linear(x, self.w["eh_proj.weight"])[None]  # [1, T, H]
        positions = torch.arange(t)[None]
        mask = torch.full((t, t), torch.finfo(x.dtype).min).triu(1)[None, None]
        h = self.layer(
            x,
            attention_mask=mask,
            position_ids=positions,
            position_embeddings=self.rotary(x, positions),
        )[0]
        return _rms(h, self.w["shared_head.norm.weight"], self.eps), h


@functools.cache
def _mtp(folder: str) -> _Mtp:
    return _Mtp(folder)


@torch.no_grad()
def reference_drafts(folder: str, prompt: list[int], next_token: int, k: int) -> list[int]:
    mtp = _mtp(folder)
    hidden = mtp.target.model(torch.tensor([prompt])).last_hidden_state[0]  # after the norm
    ids = torch.tensor(prompt[1:] + [next_token])
    drafts: list[int] = []
    for _ in range(k):
        out, back = mtp.forward(ids, hidden)
        drafts.append(int(torch.nn.functional.linear(out[-1], mtp.head).argmax()))
        ids = torch.cat([ids, torch.tensor(drafts[-1:])])
        hidden = torch.cat([hidden, back[-1:]])
    return drafts
