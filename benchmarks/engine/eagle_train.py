"""Train a small EAGLE head (EAGLE-1 layout) for a model on text the model generates itself, and
write it where ``--speculative-config '{"method": "eagle", "model": HEAD, ...}'`` reads it.

No trained head can be downloaded here, so this makes one, in minutes on two CPU cores:

1. the model answers ``--sequences`` distinct chat prompts (trillm, all at once; greedy and
   ``ignore_eos`` by default, as the benchmarks then decode: ``--max-tokens`` each);
2. transformers gives its final hidden states over prompt + answer: the output of the final
   norm, which is what trillm's model runner hands the head (``observe`` after P2). Steps 1-2
   are the slow part: their result is saved (``--data``, beside the head by default) and reused
   by a later run with the same model and generation settings;
3. the head (``fc`` over [embedding of token t+1, hidden state at t], then one Llama layer
   without input norm, initialized from the model's last layer; the model's embeddings and
   lm_head shared) starts as the least-squares linear map from [embedding, state at t] to the
   state at t+1 (``fc``; the layer's two output projections zeroed, so the layer passes it
   through) and learns EAGLE's objective for ``--minutes``: the model's hidden state at t+1
   (smooth L1) and, through the model's lm_head, its token t+2 (cross-entropy, weight 0.1, on
   a random quarter of the rows: the lm_head is most of the cost);
4. the last ``--held-out`` answers are not trained on: the head's teacher-forced top-1 over
   their answer tokens (its first draft's hit rate) is printed for the fit and after training;
5. the head is written in the published format (config.json, pytorch_model.bin) outside the
   repository (``~/.cache/trillm-eagle/<model>-eagle`` by default).

The benchmark prompts (``spec_decode.py``'s, ``spec_decode_served.py``'s) are not among the
training prompts. For SmolLM2-135M-Instruct (``make_smollm2.py`` of the peer scripts):

    python benchmarks/engine/eagle_train.py --model ~/.cache/trillm-eagle/smollm2-135m-instruct
    python benchmarks/serving/spec_decode_served.py --model ~/.cache/trillm-eagle/smollm2-135m-instruct \\
        --speculative-config '{"method": "eagle", "model": "HEAD", "num_speculative_tokens": 3}'
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

from trillm import LLM, SamplingParams
from trillm.default_model import ensure_default_model

SMOLLM2 = Path("~/.cache/trillm-eagle/smollm2-135m-instruct").expanduser()
TOPICS = (
    "the sea, a city at night, a recipe for soup, a train journey, a garden in spring, a robot, "
    "a library, winter, a football match, a market, the moon, a mountain, a museum, volcanoes, "
    "bees, the internet, a bicycle, rain forests, a birthday party, the human heart, electricity, "
    "a desert, chess, a small bakery, the ocean tides, a violin, a storm, a lost cat, "
    "the first day at school, a space station, recycling, a castle, dinosaurs, a farm"
).split(", ")
ASKS = [
    "Write a short story about {}.",
    "Describe {} in detail.",
    "Explain {} to a child.",
    "Write a poem about {}.",
    "Give me five facts about {}.",
    "Write a blog post about {}.",
    "What would a day with {} be like?",
    "Write a letter to a friend about {}.",
    "List the pros and cons of {}.",
    "Write a news report about {}.",
]
CE_FRACTION = 0.25  # of the rows whose token t+2 is scored by cross-entropy, each step


def training_prompts(n: int, seed: int) -> list[str]:
    prompts = [a.format(t) for a in ASKS for t in TOPICS]
    random.Random(seed).shuffle(prompts)
    if n > len(prompts):
        raise SystemExit(f"--sequences {n}: only {len(prompts)} distinct prompts")
    return prompts[:n]


def self_generated(
    model: str, n: int, max_tokens: int, temperature: float, seed: int
) -> tuple[list[list[int]], list[int]]:
    """Prompt + answer token ids of ``n`` chats the model answers itself, and the prompts'
    lengths."""
    llm = LLM(model, max_model_len=1024, kv_cache_memory="512MiB")
    params = SamplingParams(
        temperature=temperature, max_tokens=max_tokens, seed=seed, ignore_eos=True
    )
    chats = [[{"role": "user", "content": p}] for p in training_prompts(n, seed)]
    outs = llm.chat(chats, params, use_tqdm=False)
    llm.shutdown()
    sequences = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
    return sequences, [len(o.prompt_token_ids) for o in outs]


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

    @torch.no_grad()
    def start_from_linear_fit(
        self, ids: torch.Tensor, hidden: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """``fc`` := the ridge least-squares map from [embedding of t+1, state at t] to the
        state at t+1 over the ``rows`` [N, L - 2] of ``ids`` [N, L] / ``hidden`` [N, L, H], and
        the layer's output projections zeroed: the head starts as that linear map (the
        layer's residual passes it through), trained from there."""
        x = torch.cat([self.embed(ids[:, 1:-1]), hidden[:, :-2]], -1)[rows].double()
        y = hidden[:, 1:-1][rows].double()
        gram = x.T @ x
        gram += 1e-3 * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=gram.dtype)
        self.fc.weight.copy_(torch.linalg.solve(gram, x.T @ y).T)
        self.layer.self_attn.o_proj.weight.zero_()
        self.layer.mlp.down_proj.weight.zero_()

    def state_for_checkpoint(self) -> dict[str, torch.Tensor]:
        state = {"fc.weight": self.fc.weight}
        for name, tensor in self.layer.state_dict().items():
            state[f"layers.0.{name}"] = tensor
        return {k: v.detach().clone().contiguous() for k, v in state.items()}


def padded(sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [N, L] and their lengths [N]: under causal attention a row never sees
    the padding after it, so no attention mask is needed, only a loss mask."""
    lengths = torch.tensor([len(s) for s in sequences])
    ids = torch.zeros(len(sequences), int(lengths.max()), dtype=torch.int64)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
    return ids, lengths


@torch.no_grad()
def final_states(target: transformers.LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """The final norm's output over ``ids`` [N, L] -> [N, L, H], a few rows at a time."""
    return torch.cat([target.model(chunk).last_hidden_state for chunk in ids.split(8)])


def step_loss(
    head: EagleHead,
    target: transformers.LlamaForCausalLM,
    ids: torch.Tensor,  # [B, L]
    hidden: torch.Tensor,  # [B, L, H]
    valid: torch.Tensor,  # [B, L - 2] bool: row t has a token t + 2
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # (loss, feature loss, top-1)
    # row t: token t + 1 and hidden t -> hidden t + 1 and token t + 2
    out = head(ids[:, 1:-1], hidden[:, :-2])[valid]  # [R, H]
    feature = torch.nn.functional.smooth_l1_loss(out, hidden[:, 1:-1][valid])
    scored = torch.rand(out.shape[0], generator=gen) < CE_FRACTION
    logits = target.lm_head(out[scored])
    wanted = ids[:, 2:][valid][scored]
    ce = torch.nn.functional.cross_entropy(logits, wanted)
    top1 = (logits.argmax(-1) == wanted).float().mean()
    return feature + 0.1 * ce, feature, top1


def target_model(model: str) -> transformers.LlamaForCausalLM:
    target = transformers.LlamaForCausalLM.from_pretrained(model, dtype=torch.float32)
    return target.requires_grad_(False)


def dataset(model: str, args: argparse.Namespace, path: Path) -> dict[str, torch.Tensor]:
    """Padded ids, lengths, prompt lengths and final states of the self-generated answers:
    read from ``path`` when it was made with the same settings, else made and saved there."""
    settings = torch.tensor([args.sequences, args.max_tokens, int(1000 * args.temperature)])
    if path.is_file():
        data = torch.load(path)
        if torch.equal(data["settings"], settings):
            print(f"answers and states read from {path}", flush=True)
            return data
    start = time.perf_counter()
    sequences, prompt_lengths = self_generated(
        model, args.sequences, args.max_tokens, args.temperature, seed=0
    )
    print(f"{len(sequences)} sequences in {time.perf_counter() - start:.0f} s", flush=True)
    ids, lengths = padded(sequences)
    start = time.perf_counter()
    hidden = final_states(target_model(model), ids)
    print(f"hidden states of {int(lengths.sum())} tokens in {time.perf_counter() - start:.0f} s")
    data = {
        "settings": settings,
        "ids": ids,
        "lengths": lengths,
        "prompt_lengths": torch.tensor(prompt_lengths),
        "hidden": hidden,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(data, path)
    return data


def rows_with_target(lengths: torch.Tensor, width: int, first: torch.Tensor) -> torch.Tensor:
    """[N, width] bool: row t has a token t + 2 within the sequence, and t + 2 >= ``first``."""
    t = torch.arange(width)[None]
    return (t < (lengths - 2)[:, None]) & (t + 2 >= first[:, None])


@torch.no_grad()
def held_out_top1(
    head: EagleHead,
    target: transformers.LlamaForCausalLM,
    data: dict[str, torch.Tensor],
    rows: slice,
) -> float:
    """Teacher-forced top-1 of the head's next token over the answers of ``rows``."""
    ids, hidden = data["ids"][rows], data["hidden"][rows]
    answer = rows_with_target(data["lengths"][rows], ids.shape[1] - 2, data["prompt_lengths"][rows])
    predicted = target.lm_head(head(ids[:, 1:-1], hidden[:, :-2])[answer]).argmax(-1)
    return float((predicted == ids[:, 2:][answer]).float().mean())


def train(model: str, data: dict[str, torch.Tensor], args: argparse.Namespace) -> EagleHead:
    target = target_model(model)
    head = EagleHead(target)
    head.embed.requires_grad_(False)
    n = len(data["ids"]) - args.held_out
    ids, hidden, lengths = data["ids"][:n], data["hidden"][:n], data["lengths"][:n]
    valid = rows_with_target(lengths, ids.shape[1] - 2, torch.zeros_like(lengths))
    held_out = slice(n, None)
    head.start_from_linear_fit(ids, hidden, valid)
    if args.held_out:
        print(f"linear fit: held-out top-1 {held_out_top1(head, target, data, held_out):.3f}")
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    start, step = time.perf_counter(), 0
    while time.perf_counter() - start < 60 * args.minutes:
        rows = torch.randint(0, n, (args.batch,), generator=gen)
        loss, feature, top1 = step_loss(head, target, ids[rows], hidden[rows], valid[rows], gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 20 == 0:
            print(
                f"step {step}: loss {loss:.4f} feature {feature:.4f} top-1 {top1:.3f}", flush=True
            )
        step += 1
    print(f"{step} steps of {args.batch} sequences in {time.perf_counter() - start:.0f} s")
    if args.held_out:
        print(f"trained: held-out top-1 {held_out_top1(head, target, data, held_out):.3f}")
    return head


def write_head(head: EagleHead, model: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch.save(head.state_for_checkpoint(), out / "pytorch_model.bin")
    cfg = json.loads((Path(model) / "config.json").read_text())
    keep = (
        "vocab_size hidden_size intermediate_size num_attention_heads num_key_value_heads "
        "head_dim hidden_act rms_norm_eps rope_theta rope_scaling rope_parameters "
        "max_position_embeddings attention_bias mlp_bias"
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
    default = str(SMOLLM2 if SMOLLM2.is_dir() else ensure_default_model())
    parser.add_argument("--model", default=default)
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--minutes", type=float, default=6.0, help="of training steps")
    # 0: the model's greedy answers, what the benchmarks decode (a head learns the
    # continuations it will be asked to predict)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--held-out", type=int, default=8, help="answers not trained on")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--data", type=Path, default=None, help="the saved answers and states")
    args = parser.parse_args()
    name = Path(args.model).name
    out = args.out or Path(f"~/.cache/trillm-eagle/{name}-eagle").expanduser()
    data_path = args.data or Path(f"~/.cache/trillm-eagle/{name}-self-generated.pt").expanduser()
    start = time.perf_counter()
    data = dataset(args.model, args, data_path)
    head = train(args.model, data, args)
    write_head(head, args.model, out)
    print(f"head written to {out} ({time.perf_counter() - start:.0f} s in all)")


if __name__ == "__main__":
    main()
