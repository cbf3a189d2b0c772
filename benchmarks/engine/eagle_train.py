"""Train a small EAGLE head (EAGLE-1 layout) for a model on text the model generates itself, and
write it where ``--speculative-config '{"method": "eagle", "model": HEAD, ...}'`` reads it.

No trained head can be downloaded here, so this makes one: the model answers chat prompts
(trillm, all at once; greedy by default, as spec_decode.py decodes), transformers gives its
final hidden states over them, and the head (``fc`` over [embedding of token t+1, hidden state at t], then one Llama layer
without input norm, initialized from the model's last layer) learns EAGLE's objective: the
model's hidden state at t+1 (smooth L1) and, through the model's own lm_head, its token t+2
(cross-entropy, weight 0.1). The head is written in the published format (config.json,
pytorch_model.bin) outside the repo; benchmark it with spec_decode.py:

    python benchmarks/engine/eagle_train.py [--model PATH] [--steps 300]
    python benchmarks/engine/spec_decode.py --speculative-config \\
        '{"method": "eagle", "model": "~/.cache/trillm-eagle/<model>", "num_speculative_tokens": 3}'
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

from benchmarks.engine.spec_decode import FREE, PEER_MODEL, RANDOM, REPEAT, TEXTS
from trillm import LLM, SamplingParams
from trillm.default_model import ensure_default_model

TOPICS = (
    "the sea, a city at night, a recipe, a train journey, a garden, a robot, a library, "
    "winter, a football match, a market, the moon, a mountain, a letter to a friend, a museum"
).split(", ")
ASKS = ["Write a short story about {}.", "Describe {} in detail.", "Explain {} to a child."]


def self_generated(
    model: str, n: int, max_tokens: int, temperature: float, seed: int
) -> list[list[int]]:
    """Prompt + answer token ids of ``n`` chats the model answers itself."""
    prompts = [a.format(t) for a in ASKS for t in TOPICS] + FREE + RANDOM
    prompts += [r.format(t) for r in REPEAT for t in TEXTS]
    random.Random(seed).shuffle(prompts)
    llm = LLM(model, max_model_len=1024, kv_cache_memory="256MiB")
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    chats = [[{"role": "user", "content": p}] for p in (prompts * n)[:n]]
    outs = llm.chat(chats, params, use_tqdm=False)
    llm.shutdown()
    return [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]


class EagleHead(torch.nn.Module):
    def __init__(self, target: transformers.LlamaForCausalLM) -> None:
        super().__init__()
        cfg = target.config
        h = cfg.hidden_size
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        with torch.no_grad():  # start near "the hidden state as it is"
            self.fc.weight.copy_(torch.cat([torch.zeros(h, h), torch.eye(h)], 1))
        self.layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer(cfg, 0)
        self.layer.load_state_dict(target.model.layers[-1].state_dict())
        self.layer.input_layernorm = torch.nn.Identity()
        self.rotary = target.model.rotary_emb
        self.embed = target.model.embed_tokens

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:  # [B, T] ...
        x = self.fc(torch.cat([self.embed(ids), hidden], -1))
        positions = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
        out = self.layer(x, position_embeddings=self.rotary(x, positions), position_ids=positions)
        return out[0] if isinstance(out, tuple) else out

    def state_for_checkpoint(self) -> dict[str, torch.Tensor]:
        state = {"fc.weight": self.fc.weight}
        for name, tensor in self.layer.state_dict().items():
            state[f"layers.0.{name}"] = tensor
        return {k: v.detach().clone().contiguous() for k, v in state.items()}


def train(model: str, sequences: list[list[int]], steps: int, batch: int) -> EagleHead:
    target = transformers.LlamaForCausalLM.from_pretrained(model, dtype=torch.float32)
    target.requires_grad_(False)
    head = EagleHead(target)
    head.embed.requires_grad_(False)
    length = sorted(len(s) for s in sequences)[len(sequences) // 4]  # 3/4 of them reach it
    kept = [s[:length] for s in sequences if len(s) >= length]
    with torch.no_grad():
        ids = torch.tensor(kept)  # [N, L]
        hidden = target(ids, output_hidden_states=True).hidden_states[-1]  # [N, L, H] normed
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        rows = torch.randint(0, len(kept), (batch,), generator=gen)
        # row t: token t + 1 and hidden t -> hidden t + 1 and token t + 2
        out = head(ids[rows, 1:-1], hidden[rows, :-2])
        feature = torch.nn.functional.smooth_l1_loss(out, hidden[rows, 1:-1])
        logits = target.lm_head(out)
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[rows, 2:].flatten())
        loss = feature + 0.1 * ce
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            top1 = (logits.argmax(-1) == ids[rows, 2:]).float().mean()
            print(f"step {step}: feature {feature:.4f} ce {ce:.3f} top-1 {top1:.3f}", flush=True)
    return head


def write_head(head: EagleHead, model: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch.save(head.state_for_checkpoint(), out / "pytorch_model.bin")
    cfg = json.loads((Path(model) / "config.json").read_text())
    keep = (
        "vocab_size hidden_size intermediate_size num_attention_heads num_key_value_heads "
        "head_dim hidden_act rms_norm_eps rope_theta rope_scaling max_position_embeddings "
        "attention_bias mlp_bias"
    ).split()
    head_cfg = {k: cfg[k] for k in keep if k in cfg}
    head_cfg.update(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        num_hidden_layers=1,
        tie_word_embeddings=False,
    )
    (out / "config.json").write_text(json.dumps(head_cfg, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = str(PEER_MODEL if PEER_MODEL.is_dir() else ensure_default_model())
    parser.add_argument("--model", default=default)
    parser.add_argument("--sequences", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--steps", type=int, default=300)
    # 0: the model's greedy answers, what spec_decode.py then decodes (a head learns the
    # continuations it will be asked to predict)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path(f"~/.cache/trillm-eagle/{Path(args.model).name}-eagle").expanduser()
    start = time.perf_counter()
    sequences = self_generated(
        args.model, args.sequences, args.max_tokens, args.temperature, seed=0
    )
    print(f"{len(sequences)} sequences in {time.perf_counter() - start:.0f} s", flush=True)
    head = train(args.model, sequences, args.steps, args.batch)
    write_head(head, args.model, out)
    print(f"head written to {out} ({time.perf_counter() - start:.0f} s in all)")


if __name__ == "__main__":
    main()
