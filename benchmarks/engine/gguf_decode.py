"""A GGUF model kept quantized against the same model in fp32 and bf16: decode steps and load time.

The model: SmolLM2-135M-Instruct, the Q4_1 GGUF (Q8_0 embedding, tied head) and the float32
folder transformers dequantizes from it; ``--gguf`` may name more files (e.g. a Q8_0 one from
``make_gguf.py``). ModelRunners in one process (each GGUF kept quantized, as served: fp32
activations below ``INT8_MIN_ROWS`` rows, int8 from there; the folder in fp32 and in bf16)
decode ``--batches`` rows for ``--steps`` steps each, alternated over ``--rounds`` rounds;
medians of the step times.
Then load times, each alternated too: trillm loading the GGUF (config, weights repacked,
tokenizer from the metadata), transformers converting the GGUF (``from_pretrained(...,
gguf_file=...)``, model and tokenizer), and trillm loading the float32 folder (the first
``--gguf``; ``--load-rounds 0`` skips them).

    python benchmarks/engine/gguf_decode.py --gguf G.gguf [G2.gguf ...] --folder F [--batches 1 16]
        [--steps 16] [--rounds 3] [--threads N] [--out x.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

import torch

from benchmarks.engine import decode_step  # benchmarks/engine/decode_step.py: time_decode
from trillm.config import EngineArgs
from trillm.engine.config_builder import build_config
from trillm.engine.tokenizer_loader import load_tokenizer
from trillm.worker.model_runner import ModelRunner


def _runner(model: str, dtype: str, batches: list[int]) -> ModelRunner:
    args = EngineArgs(
        model=model,
        dtype=dtype,
        device="cpu",
        block_size=decode_step.BLOCK_SIZE,
        max_num_seqs=max(batches),
        max_model_len=1024,
        num_gpu_blocks_override=max(batches) * 16,
    )
    runner = ModelRunner(build_config(args))
    runner.load_model()
    runner.initialize_kv_cache(runner.determine_num_blocks())
    return runner


def _linear_bytes(runner: ModelRunner) -> int:
    """Bytes the decode step's matmuls read: packed / quantized copies where the layer has one."""
    total = 0
    for module in runner.model.modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        quantized = getattr(module, "quantized_weight", None)
        packed = getattr(module, "packed_weight", None)
        if quantized is not None:
            total += quantized.nbytes
        elif packed is not None:
            total += packed.data.numel() * packed.data.element_size()
        else:
            total += module.weight.numel() * module.weight.element_size()
    return total


def _gguf_kind(path: Path) -> str:
    """The GGML type of the file's first-layer gate projection: its format, for the tables."""
    from trillm.model_executor.gguf_loader import GGUFFile

    return GGUFFile(path).tensor_types.get("blk.0.ffn_gate.weight", "?")


def decode(args: argparse.Namespace) -> list[dict]:
    variants = {f"gguf {_gguf_kind(g)}": (str(g), "float32") for g in args.gguf}
    variants |= {"fp32": (str(args.folder), "float32"), "bf16": (str(args.folder), "bfloat16")}
    runners = {
        name: _runner(model, dtype, args.batches) for name, (model, dtype) in variants.items()
    }
    times: dict[tuple[str, int], list[float]] = {}
    step_id = 0
    for _ in range(args.rounds):
        for batch in args.batches:
            for name, runner in runners.items():
                t = decode_step.time_decode(runner, batch, args.steps, step_id)
                step_id += args.steps + 2
                times.setdefault((name, batch), []).extend(t)
    rows = []
    for (name, batch), t in times.items():
        step = statistics.median(t)
        rows.append(
            dict(
                variant=name,
                batch=batch,
                step_ms=step * 1e3,
                tokens_per_s=batch / step,
                linear_mb=_linear_bytes(runners[name]) / 1e6,
            )
        )
    return rows


def _trillm_load(model: str) -> float:
    start = time.perf_counter()
    config = build_config(EngineArgs(model=model, dtype="float32", device="cpu"))
    runner = ModelRunner(config)
    runner.load_model()
    load_tokenizer(config.model.tokenizer)
    elapsed = time.perf_counter() - start
    del runner
    gc.collect()
    return elapsed


def _transformers_load(gguf: Path) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    elapsed = time.perf_counter() - start
    del model
    gc.collect()
    return elapsed


def load_times(args: argparse.Namespace) -> dict[str, float]:
    runs: dict[str, list[float]] = {}
    for _ in range(args.load_rounds):
        runs.setdefault("trillm GGUF", []).append(_trillm_load(str(args.gguf[0])))
        runs.setdefault("transformers GGUF conversion", []).append(_transformers_load(args.gguf[0]))
        runs.setdefault("trillm fp32 folder", []).append(_trillm_load(str(args.folder)))
    return {name: statistics.median(t) for name, t in runs.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, nargs="+", required=True)
    p.add_argument("--folder", type=Path, required=True)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--load-rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = decode(args)
    print(f"{torch.get_num_threads()} threads, {args.rounds} rounds x {args.steps} steps")
    print(f"{'variant':<30} {'batch':>5} {'step ms':>9} {'tok/s':>8} {'linear MB':>10}")
    for r in sorted(rows, key=lambda r: (r["batch"], r["variant"])):
        print(
            f"{r['variant']:<30} {r['batch']:>5} {r['step_ms']:>9.2f} "
            f"{r['tokens_per_s']:>8.1f} {r['linear_mb']:>10.1f}"
        )
    loads = load_times(args)
    for name, seconds in loads.items():
        print(f"load: {name:<32} {seconds:7.2f} s")
    if args.out:
        result = dict(
            threads=torch.get_num_threads(),
            steps=args.steps,
            rounds=args.rounds,
            rows=rows,
            load_seconds=loads,
        )
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
