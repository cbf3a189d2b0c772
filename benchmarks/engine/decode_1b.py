"""Batch-1 decode at Llama-3.2-1B's shape against the memory-bandwidth limit of its weight format.

For each ``--model`` (a GGUF file kept quantized, or a safetensors folder), a ModelRunner in
``--dtype`` (bf16, as the peer runs serve it) prefills one ``--prompt``-token prompt and decodes
``--steps`` steps, ``--rounds`` times; the median step is the batch-1 TPOT without the server.
Then its linear layers alone, in model order, one bf16 row each (``gemv``; ``lm_head`` apart),
and ``rest`` = step - gemv - lm_head (attention over the KV, norms, rotary, sampling, the
step's Python). The limit: the bytes a token reads in the file's format (every linear weight,
a tied ``lm_head`` as the embedding's type; one embedding row) over the host's streaming read
bandwidth, measured in the same run (a 1 GiB buffer summed by all threads); ``packed MB``:
trillm's in-memory copies of the same weights (Q6_K: its file's 6.5625 bits a weight as Q6_KP
where the CPU has AVX512-BF16 and VBMI, else 9).

``--batch N``: N such prompts decoded together (a c16 run's steps at 16), the linears timed
with N rows each (as the model dispatches them: int8 activations from ``INT8_MIN_ROWS`` rows).

    python benchmarks/engine/decode_1b.py --model M.gguf [M2.gguf FOLDER ...] [--tokenizer HF]
        [--prompt 1024] [--steps 16] [--batch 1] [--rounds 2] [--clock wall|thread] [--label L]
        [--out x.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

import torch

from benchmarks.engine import decode_step  # benchmarks/engine/decode_step.py: time_decode
from trillm.config import EngineArgs
from trillm.engine.config_builder import build_config
from trillm.worker.model_runner import ModelRunner


def read_gbps(clock: Callable[[], float], gib: int = 1, repeats: int = 7) -> float:
    """Streaming read bandwidth: a buffer far over the L3 summed by torch's threads, median."""
    buf = torch.ones(gib << 28)
    buf.sum()
    times = []
    for _ in range(repeats):
        start = clock()
        buf.sum()
        times.append(clock() - start)
    return buf.numel() * 4 / statistics.median(times) / 1e9


def format_bytes(model: str) -> tuple[int, int]:
    """(bytes a token reads in the file's format, of which the lm_head): every linear weight
    once, a tied head as the embedding's tensor, one embedding row."""
    path = Path(model)
    if path.suffix == ".gguf":
        from gguf import GGUFReader

        tensors = {t.name: t for t in GGUFReader(path).tensors}
        embed = int(tensors["token_embd.weight"].n_bytes)
        head = int(tensors["output.weight"].n_bytes) if "output.weight" in tensors else embed
        rows = int(tensors["token_embd.weight"].shape[-1])  # GGUF lists dims fastest first
        linear = sum(
            int(t.n_bytes)
            for name, t in tensors.items()
            if name.startswith("blk.") and len(t.shape) == 2
        )
        return linear + head + embed // int(rows), head
    from safetensors import safe_open

    total = head = 0
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            t = f.get_slice(name)
            shape = t.get_shape()
            nbytes = 2 * int(torch.tensor(shape).prod())  # bf16 checkpoints
            if name.endswith("embed_tokens.weight"):
                head = nbytes  # tied: the head reads it all, the lookup one row
                total += nbytes + nbytes // shape[0]
            elif len(shape) == 2:
                total += nbytes
    return total, head


def _linears(runner: ModelRunner) -> list[torch.nn.Linear]:
    return [m for m in runner.model.modules() if isinstance(m, torch.nn.Linear)]


def packed_bytes(runner: ModelRunner) -> int:
    total = 0
    for module in _linears(runner):
        quantized = getattr(module, "quantized_weight", None)
        total += quantized.nbytes if quantized is not None else module.weight.nbytes
    return total


def gemv_ms(
    runner: ModelRunner,
    dtype: torch.dtype,
    clock: Callable[[], float],
    passes: int = 5,
    batch: int = 1,
) -> tuple[float, float]:
    """(the layers' linears, the lm_head): ``batch`` rows through each in model order, median
    ms."""
    layers = _linears(runner)
    head = [m for m in layers if m.out_features == runner.model.config.vocab_size]
    body = [m for m in layers if m not in head]
    rows = {m.in_features: torch.randn(batch, m.in_features).to(dtype) for m in layers}

    def run(mods: list[torch.nn.Linear]) -> float:
        times = []
        with torch.inference_mode():
            for _ in range(passes):
                start = clock()
                for m in mods:
                    m(rows[m.in_features])
                times.append(clock() - start)
        return statistics.median(times) * 1e3

    return run(body), run(head)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", nargs="+", required=True)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--batch", type=int, default=1, help="prompts decoded together")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--label", default="")
    p.add_argument(
        "--clock",
        choices=["wall", "thread"],
        default="wall",
        help="thread: one thread, its CPU time (a shared machine's wall time is noise)",
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    clock = time.perf_counter
    if args.clock == "thread":
        torch.set_num_threads(1)
        clock = time.thread_time
    gbps = read_gbps(clock)
    rows = []
    for model in args.model:
        ctx = args.prompt + args.steps + 2
        engine = EngineArgs(
            model=model,
            tokenizer=args.tokenizer,
            dtype=args.dtype,
            device="cpu",
            block_size=decode_step.BLOCK_SIZE,
            max_num_seqs=args.batch,
            max_model_len=ctx,
            num_gpu_blocks_override=args.batch * -(-ctx // decode_step.BLOCK_SIZE) + 1,
        )
        runner = ModelRunner(build_config(engine))
        runner.load_model()
        runner.initialize_kv_cache(runner.determine_num_blocks())
        times: list[float] = []
        for r in range(args.rounds):
            first = r * (args.steps + 4)
            times += decode_step.time_decode(
                runner, args.batch, args.steps, first, prompt_len=args.prompt, clock=clock
            )
        step = statistics.median(times) * 1e3
        body, head = gemv_ms(runner, getattr(torch, args.dtype), clock, batch=args.batch)
        fmt, fmt_head = format_bytes(model)
        limit = fmt / gbps / 1e6
        rows.append(
            dict(
                model=Path(model).name,
                label=args.label,
                batch=args.batch,
                step_ms=step,
                gemv_ms=body,
                lm_head_ms=head,
                rest_ms=step - body - head,
                format_mb=fmt / 1e6,
                format_head_mb=fmt_head / 1e6,
                packed_mb=packed_bytes(runner) / 1e6,
                limit_ms=limit,
                of_limit=step / limit,
            )
        )
        del runner
    print(
        f"read bandwidth {gbps:.1f} GB/s, {torch.get_num_threads()} threads, "
        f"{args.clock} clock, {args.label}"
    )
    print(
        f"{'model':<28} {'step ms':>8} {'gemv':>7} {'head':>6} {'rest':>6} "
        f"{'fmt MB':>7} {'packed':>7} {'limit ms':>8} {'x limit':>7}"
    )
    for r in rows:
        print(
            f"{r['model']:<28} {r['step_ms']:>8.1f} {r['gemv_ms']:>7.1f} {r['lm_head_ms']:>6.1f} "
            f"{r['rest_ms']:>6.1f} {r['format_mb']:>7.0f} {r['packed_mb']:>7.0f} "
            f"{r['limit_ms']:>8.1f} {r['of_limit']:>7.2f}"
        )
    if args.out:
        result = dict(read_gbps=gbps, clock=args.clock, threads=torch.get_num_threads(), rows=rows)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
