"""A GGUF of a Hugging Face folder with its projections and embedding in one GGML type (the
gguf package's quantizer), the way llama.cpp lays it out (``trillm/testing/gguf_models.py``):
for benchmarks on the real model, never in CI.

    python benchmarks/numerics/make_gguf.py --folder ~/.cache/trillm-peer/smollm2-135m-instruct \
        --type Q8_0 --out /tmp/smollm2-q8_0    # writes /tmp/smollm2-q8_0/model.gguf

``--type F32`` writes the float32 file, the reference the quantized one is measured against.
The writer also leaves ``OUT/dequantized/`` (the quantized values as a float32 folder).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

from benchmarks import common  # noqa: F401 - puts the repository root on sys.path
from trillm.testing.gguf_models import write_tiny_gguf

PROJECTIONS = (
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "token_embd",
    "output",
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--folder", type=Path, required=True)
    p.add_argument("--type", default="Q8_0", help="a GGML type the gguf package quantizes to")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    types = {} if args.type == "F32" else dict.fromkeys(PROJECTIONS, args.type)
    print(write_tiny_gguf(args.folder, args.out, types))


if __name__ == "__main__":
    main()
