"""Decode-step time by weight format: fp32, bf16, fp8 weights (``--quantization fp8``) on CPU,
against the memory-bandwidth bound (bytes of weights read per step / bandwidth).

Every variant is a ModelRunner over the same checkpoint in one process; rounds alternate the
variants so that load from other work falls on all of them alike. Per (variant, batch): the
median decode-step time over the rounds' medians. The bound counts the linear layers' weights
in the format they are read (fp8: one byte a weight plus a 4-byte scale per output channel;
the lm_head stays in the model dtype); the embedding lookup reads a few rows and is left out.

    python benchmarks/engine/quant_decode.py [--model FOLDER] [--batches 1 16] [--steps 16]
        [--rounds 3] [--bandwidth-gbps 33] [--out x.json]

Default model: ~/.cache/trillm-peer/smollm2-135m-instruct when present (SmolLM2-135M-Instruct,
float32), else the embedded default model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

import torch
from torch import nn

from benchmarks.engine import (
    decode_step,  # benchmarks/engine/decode_step.py: time_decode, copy_gbps
)
from trillm.config import EngineArgs
from trillm.engine.config_builder import build_config
from trillm.worker.model_runner import ModelRunner

PEER_MODEL = Path.home() / ".cache/trillm-peer/smollm2-135m-instruct"
# name -> (dtype, quantization)
VARIANTS = {
    "fp32": ("float32", None),
    "bf16": ("bfloat16", None),
    "fp8 (fp32 act.)": ("float32", "fp8"),
    "fp8 (bf16 act.)": ("bfloat16", "fp8"),
}


def weight_bytes(model: nn.Module) -> int:
    """Bytes of linear-layer weights one forward reads, in the format each is stored."""
    total = 0
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        fp8 = getattr(module, "fp8_weight", None)
        if fp8 is not None:
            total += fp8.out_features * fp8.in_features + 4 * fp8.out_features
        else:
            total += module.weight.numel() * module.weight.element_size()
    return total


def make_runner(
    folder: str | None, dtype: str, quantization: str | None, batch: int, steps: int
) -> ModelRunner:
    args = EngineArgs(
        model=folder,
        dtype=dtype,
        quantization=quantization,
        device="cpu",
        block_size=decode_step.BLOCK_SIZE,
        max_num_seqs=batch,
        max_model_len=1024,
        num_gpu_blocks_override=batch * (-(-(decode_step.PROMPT_LEN + steps + 2) // 16) + 1),
        distributed_executor_backend="uni",
    )
    runner = ModelRunner(build_config(args))
    runner.load_model()
    runner.initialize_kv_cache(runner.determine_num_blocks())
    return runner


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bandwidth-gbps", type=float, default=33.0, help="the bound's bandwidth")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    folder = args.model or (str(PEER_MODEL) if (PEER_MODEL / "config.json").is_file() else None)
    batch_max = max(args.batches)
    runners = {
        name: make_runner(folder, *VARIANTS[name], batch_max, args.steps) for name in args.variants
    }
    times: dict[tuple[str, int], list[float]] = {}
    step_ids = dict.fromkeys(runners, 0)
    for round_ in range(args.rounds):
        for batch in args.batches:
            for name, runner in runners.items():
                t = decode_step.time_decode(runner, batch, args.steps, step_ids[name])
                step_ids[name] += args.steps + 2
                times.setdefault((name, batch), []).append(statistics.median(t))
                print(
                    f"round {round_} batch {batch} {name}: {statistics.median(t) * 1e3:.1f} ms",
                    flush=True,
                )
    copy = decode_step.copy_gbps()
    rows = []
    for (name, batch), samples in times.items():
        nbytes = weight_bytes(runners[name].model)
        step = statistics.median(samples)
        bound = nbytes / (args.bandwidth_gbps * 1e9)
        rows.append(
            dict(
                variant=name,
                batch=batch,
                step_ms=step * 1e3,
                weight_mb=nbytes / 1e6,
                bound_ms=bound * 1e3,
                of_bound=bound / step,
                rounds_ms=[s * 1e3 for s in samples],
            )
        )
    print(
        f"model {folder or 'embedded default'}, {torch.get_num_threads()} threads, "
        f"copy bandwidth measured now {copy:.1f} GB/s, bound at {args.bandwidth_gbps} GB/s"
    )
    print(
        f"{'variant':<16} {'batch':>5} {'step ms':>8} {'weights MB':>10} {'bound ms':>8} "
        f"{'of bound':>8}"
    )
    for r in sorted(rows, key=lambda r: (r["batch"], r["variant"])):
        print(
            f"{r['variant']:<16} {r['batch']:>5} {r['step_ms']:>8.2f} {r['weight_mb']:>10.1f} "
            f"{r['bound_ms']:>8.2f} {r['of_bound']:>8.1%}"
        )
    if args.out:
        result = dict(
            model=folder,
            threads=torch.get_num_threads(),
            copy_gbps=copy,
            bandwidth_gbps=args.bandwidth_gbps,
            steps=args.steps,
            rounds=args.rounds,
            rows=rows,
        )
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
