"""benchmarks/peers/peers_1b.py's shapes and its ``prepare``: the random bf16 checkpoint at a
shape's exact config (``benchmarks/serving/make_1b_checkpoints.py``), its padding tokens'
embedding rows zeroed, then GGUFs of the same weights made with llama.cpp's converter (bf16)
and ``llama-quantize`` (Q8_0, Q4_0, Q4_K_M), all outside the repository in
``$TRILLM_PEER_DIR/SHAPE-shape/``."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PEER = Path(os.environ.get("TRILLM_PEER_DIR", "~/.cache/trillm-peer")).expanduser()
# --shape: its served name and default KV budget (GiB, every server the same). The budget holds
# 64 streams of 1,024 + 256 tokens: the llama shape's 32 KiB a token (bf16/f16 K and V) needs
# 2.5 GiB, Qwen3-1.7B's 112 KiB a token (28 layers x 8 KV heads x 128) 8.75 GiB
SHAPES = {"llama-3.2-1b": ("llama1b", 4), "qwen3-1.7b": ("qwen3-1.7b", 10)}
QUANTS = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k_m": "Q4_K_M"}


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def prepare(args: argparse.Namespace) -> None:
    root, name = args.root, args.shape
    mk = checkpoints()
    mk.SMOLLM2 = args.peer / "smollm2-135m-instruct"  # setup.sh's folder: its tokenizer
    hf = mk.build(name, root, args.seed)
    zero_reserved_rows(hf, root)
    # llama.cpp's converter pins transformers 4.x, which cannot read the tokenizer_config.json
    # transformers 5 wrote: a shadow folder links the files and names a class 4.x knows
    shadow = root / "hf-shadow"
    if not (shadow / "tokenizer_config.json").exists():
        shutil.rmtree(shadow, ignore_errors=True)
        shadow.mkdir()
        for f in hf.iterdir():
            if f.name != "tokenizer_config.json":
                (shadow / f.name).symlink_to(f)
        cfg = json.loads((hf / "tokenizer_config.json").read_text())
        cfg.update(tokenizer_class="GPT2Tokenizer", add_bos_token=False)
        (shadow / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    llama = args.peer / "llama.cpp"
    bf16 = root / f"{name}-bf16.gguf"
    if not bf16.exists():
        say("converting to a bf16 GGUF")
        tmp = bf16.with_suffix(".tmp")
        subprocess.run(
            [
                str(args.peer / "venv/bin/python"),
                str(llama / "convert_hf_to_gguf.py"),
                str(shadow),
                "--outtype",
                "bf16",
                "--outfile",
                str(tmp),
            ],
            check=True,
        )
        tmp.rename(bf16)
    quantize = llama / "build/bin/llama-quantize"
    if not quantize.exists():
        say("building llama-quantize")
        subprocess.run(
            [
                "cmake",
                "--build",
                str(llama / "build"),
                f"-j{os.cpu_count()}",
                "--target",
                "llama-quantize",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    for q, ftype in QUANTS.items():
        out = root / f"{name}-{q}.gguf"
        if not out.exists():
            say(f"quantizing to {ftype}")
            subprocess.run(
                [str(quantize), str(bf16), str(out.with_suffix(".tmp")), ftype, "2"],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            out.with_suffix(".tmp").rename(out)
    for f in sorted(root.glob("*.gguf")):
        say(f"{f.name}: {f.stat().st_size / 1e9:.2f} GB")


def checkpoints() -> Any:
    """benchmarks/serving/make_1b_checkpoints.py: the shapes' configs and the builder."""
    sys.path.insert(0, str(REPO))
    from benchmarks.serving import make_1b_checkpoints

    return make_1b_checkpoints


def kv_bytes_per_token(shape: str) -> int:
    """K and V in 16 bits over every layer: what each server's KV budget holds per token."""
    cfg = checkpoints().MODELS[shape]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2


def zero_reserved_rows(hf: Path, root: Path) -> None:
    """Zero the (tied) embedding rows of the padding tokens ``<|reserved_N|>`` (ids from
    SmolLM2's 49,152 up), as a trained Llama 3 leaves its reserved tokens' rows near zero: their
    logits are 0, so greedy picks real tokens, which every server streams as text (llama.cpp
    and vLLM send special tokens as empty text, and a client's TTFT waits for text). The same
    compute either way. The GGUFs are made after this."""
    from safetensors.torch import load_file, save_file

    done = root / "reserved-rows-zeroed"
    if done.exists():
        return
    say("zeroing the reserved tokens' embedding rows")
    path = hf / "model.safetensors"
    weights = load_file(str(path))
    weights["model.embed_tokens.weight"][49152:] = 0
    save_file(weights, str(path.with_suffix(".tmp")), metadata={"format": "pt"})
    del weights
    path.with_suffix(".tmp").rename(path)
    for f in root.glob("*.gguf"):
        f.unlink()  # made from the weights before
    done.touch()
