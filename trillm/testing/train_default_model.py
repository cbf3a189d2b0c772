"""Train the embedded default model: a tiny Llama on the King James Bible (public domain).

The corpus comes from a registry package: Debian's ``bible-kjv`` (``apt-get install
bible-kjv``), dumped with ``bible -f "Gen1:1-Rev22:21"``; any UTF-8 text file works too
(``--corpus FILE``). The shipped tokenizer (trillm/default_model/tokenizer.json) is reused.
The result (config.json, model.safetensors, generation_config.json) is written beside the
tokenizer, where ``trillm.default_model.ensure_default_model`` finds it.

    python -m trillm.testing.train_default_model --minutes 30
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import time
from pathlib import Path

from trillm.default_model import CONFIG, HERE
from trillm.testing.tiny_models import BASE, EOS_IDS


def read_corpus(path: str | None) -> str:
    if path:
        return Path(path).read_text(encoding="utf-8")
    raw = subprocess.run(
        ["bible", "-f", "Gen1:1-Rev22:21"], capture_output=True, text=True, check=True
    ).stdout
    # "Ge1:1 In the beginning ..." -> "In the beginning ..."; a blank line between chapters.
    lines: list[str] = []
    for line in raw.splitlines():
        m = re.match(r"^\S+?(\d+):(\d+) (.*)$", line)
        if m:
            if m.group(2) == "1" and lines:
                lines.append("")
            lines.append(m.group(3))
    return "\n".join(lines) + "\n"


def main() -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default=None)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--out", default=str(HERE))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--save-every-minutes", type=float, default=5.0)
    args = ap.parse_args()

    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(HERE)
    text = read_corpus(args.corpus)
    ids = torch.tensor(tok.encode(text) + [EOS_IDS[1]], dtype=torch.long)
    print(f"corpus: {len(text)} chars, {len(ids)} tokens")

    kwargs = {**BASE, **CONFIG, "initializer_range": 0.02, "tie_word_embeddings": True}
    config = LlamaConfig(**kwargs)
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f}M parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    deadline = time.time() + args.minutes * 60
    start = time.time()
    step = 0
    last_save = time.time()
    while time.time() < deadline:
        frac = (time.time() - start) / (deadline - start)
        lr = (
            args.lr
            * min(1.0, (step + 1) / 100)
            * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        )
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(ids) - args.seq_len, (args.batch_size,))
        batch = torch.stack([ids[s : s + args.seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss  # transformers shifts the labels

        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0:
            print(
                f"step {step} loss {loss.item():.3f} lr {lr:.2e} {time.time() - start:.0f}s",
                flush=True,
            )
        step += 1
        if time.time() - last_save > args.save_every_minutes * 60:
            save(model, config, Path(args.out), save_file)
            last_save = time.time()
            print(f"checkpoint at step {step}", flush=True)
    save(model, config, Path(args.out), save_file)
    print(f"saved to {args.out} after {step} steps")


def save(model, config, out: Path, save_file) -> None:
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    state.pop("lm_head.weight", None)  # tied to the embeddings
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = config.to_dict()
    cfg["architectures"] = ["LlamaForCausalLM"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"eos_token_id": EOS_IDS, "pad_token_id": 0}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


if __name__ == "__main__":
    main()
