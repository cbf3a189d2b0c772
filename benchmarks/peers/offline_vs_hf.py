"""Offline throughput, trillm against Hugging Face transformers ``generate``, plus the roofline.

Both run the same random Llama (``common.MODEL_SPEC``, fp32, CPU) on the same workload: mixed
prompt lengths (8-384) and output lengths (8-160), EOS ignored, greedy. Only requested tokens
count: transformers runs static left-padded batches of ``--hf-batch-size`` to the longest
request of each batch (``min_new_tokens = max_new_tokens``), but a request's tokens past its
own output length, and the padding, are not counted. The two are measured alternately in one
process (HF, trillm, HF, trillm, ...), with the same torch thread count.

Roofline: model-FLOPs utilisation (MFU) = 2 x flop_params x tokens / time / matmul rate, with
flop_params = non-embedding parameters + lm_head (the input embedding is a lookup). Attention
score FLOPs are not counted (so MFU is a lower bound). The matmul rate is measured in the same
run, before and after, at the model's MLP GEMM (rows x 512 x 1408) and at 2048^3; MFU is
reported against the best GEMM rate seen ("peak") and against 2048^3. The decode-step MFU is
measured on the ModelRunner directly (benchmarks/engine/decode_step.py's ``time_decode``).

    python benchmarks/peers/offline_vs_hf.py --out benchmarks/peers/results/offline_vs_hf.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

from benchmarks import common

THREADS_DEFAULT = 2


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2, help="HF, trillm pairs")
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument(
        "--hf-order",
        choices=["input", "output-len"],
        default="input",
        help="HF batches in workload order, or sorted by output length (less padding waste)",
    )
    p.add_argument("--threads", type=int, default=THREADS_DEFAULT)
    p.add_argument("--backend", choices=["mp", "uni"], default="mp")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=20)
    p.add_argument(
        "--decode-contexts",
        type=int,
        nargs="+",
        default=[64, 256],
        help="prompt lengths the decode steps start from (the first is the headline)",
    )
    p.add_argument("--skip-hf", action="store_true", help="trillm and roofline only")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


# ---------------------------------------------------------------- Hugging Face


def hf_batches(jobs: list[common.Job], batch_size: int, order: str) -> list[list[common.Job]]:
    if order == "output-len":
        jobs = sorted(jobs, key=lambda j: j.output_len)
    return [jobs[i : i + batch_size] for i in range(0, len(jobs), batch_size)]


def hf_generate_batch(model: Any, batch: list[common.Job]) -> int:
    """One static left-padded batch to its longest output; returns the tokens it generated."""
    import torch

    width = max(len(j.prompt_ids) for j in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)  # [B, L], pad id 0
    mask = torch.zeros(len(batch), width, dtype=torch.long)  # [B, L]
    for row, job in enumerate(batch):
        n = len(job.prompt_ids)
        ids[row, width - n :] = torch.tensor(job.prompt_ids)
        mask[row, width - n :] = 1
    new = max(j.output_len for j in batch)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            use_cache=True,
        )
    generated = out.shape[1] - width
    if generated != new:
        raise RuntimeError(f"HF generated {generated} tokens, {new} were asked for.")
    return generated * len(batch)


def run_hf(model: Any, batches: list[list[common.Job]]) -> dict[str, Any]:
    start = time.perf_counter()
    computed = sum(hf_generate_batch(model, b) for b in batches)
    return dict(seconds=time.perf_counter() - start, generated_incl_padding=computed)


def load_hf(folder: Path) -> Any:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return model.eval()


# ---------------------------------------------------------------- trillm


def open_llm(folder: Path, args: argparse.Namespace) -> Any:
    from trillm import LLM

    return LLM(
        str(folder),
        dtype="float32",
        device="cpu",
        kv_cache_memory="2GiB",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,  # rounds repeat the prompts; HF has no such cache
        distributed_executor_backend=args.backend,
    )


def record_steps(llm: Any) -> list[tuple[float, float]]:
    """Wrap the engine core's ``step`` to keep (step_time_s, model_time_s) of every step."""
    core, steps = llm.engine.cores[0], []
    step = core.step

    async def timed_step() -> Any:
        result = await step()
        if result is not None and result.step_time_s:
            steps.append((result.step_time_s, result.model_time_s))
        return result

    core.step = timed_step
    return steps


def run_trillm(llm: Any, jobs: list[common.Job], steps: list | None = None) -> dict[str, Any]:
    from trillm import SamplingParams

    prompts = [{"prompt_token_ids": j.prompt_ids} for j in jobs]
    params = [
        SamplingParams(max_tokens=j.output_len, ignore_eos=True, temperature=0.0) for j in jobs
    ]
    if steps is not None:
        steps.clear()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    got = [len(o.outputs[0].token_ids) for o in outs]
    want = [j.output_len for j in jobs]
    if got != want:
        raise RuntimeError("trillm returned other output lengths than requested.")
    if not steps:
        return dict(seconds=seconds)
    return dict(
        seconds=seconds,
        steps=len(steps),
        step_s_sum=sum(s for s, _ in steps),
        model_s_sum=sum(m for _, m in steps),
    )


# ---------------------------------------------------------------- decode steps


def decode_step_times(folder: Path, batch: int, steps: int, prompt_len: int) -> list[float]:
    """Seconds per decode step of ``batch`` requests (contexts from ``prompt_len`` on) on an
    in-process ModelRunner."""
    from benchmarks.engine import (
        decode_step,  # benchmarks/engine/decode_step.py (the model engineer's micro-benchmark)
    )
    from trillm.config import EngineArgs
    from trillm.engine.config_builder import build_config
    from trillm.worker.model_runner import ModelRunner

    engine_args = EngineArgs(
        model=str(folder),
        dtype="float32",
        device="cpu",
        block_size=decode_step.BLOCK_SIZE,
        max_num_seqs=batch,
        max_model_len=1024,
        num_gpu_blocks_override=batch * (-(-(prompt_len + steps + 16) // decode_step.BLOCK_SIZE)),
    )
    runner = ModelRunner(build_config(engine_args))
    runner.load_model()
    runner.initialize_kv_cache(runner.determine_num_blocks())
    decode_step.time_decode(runner, batch, 3, 0, prompt_len)  # warm-up
    return decode_step.time_decode(runner, batch, steps, 10, prompt_len)


# ---------------------------------------------------------------- main


def attention_path() -> str:
    from trillm.kernels import paged_attention_cpu

    if paged_attention_cpu.available():
        return "native CPU paged kernel (ext/cpu_attention.cpp) + is_causal SDPA for fresh prompts"
    return "torch gather + SDPA"


def workload_tokens(jobs: list[common.Job]) -> tuple[int, int]:
    return sum(len(j.prompt_ids) for j in jobs), sum(j.output_len for j in jobs)


def summarize_runs(
    name: str, times: list[float], prompt_toks: int, out_toks: int, flops_per_tok: float
) -> dict[str, Any]:
    mean = statistics.mean(times)
    return dict(
        engine=name,
        runs_s=[round(t, 3) for t in times],
        mean_s=mean,
        output_tok_s=out_toks / mean,
        total_tok_s=(prompt_toks + out_toks) / mean,
        achieved_gflops=flops_per_tok * (prompt_toks + out_toks) / mean / 1e9,
    )


def main() -> None:
    args = parse_args()
    common.set_threads(args.threads)
    folder = common.build_bench_model()
    counts = common.param_counts(folder)
    flops_per_tok = 2.0 * counts.flop_params
    jobs = common.make_workload(args.num_prompts, args.seed)
    prompt_toks, out_toks = workload_tokens(jobs)
    machine = common.machine_info()
    print(
        f"model: {counts.total:,} params ({counts.non_embedding:,} non-embedding, "
        f"embedding {counts.embedding:,}, lm_head {counts.lm_head:,}); FLOPs/token = 2 x "
        f"{counts.flop_params:,} (non-embedding + lm_head)"
    )
    print(
        f"workload: {len(jobs)} prompts, {prompt_toks} prompt + {out_toks} output tokens; "
        f"{args.threads} torch threads; {machine['cpu']}, load {machine['load_avg_1m']:.1f}"
    )
    rates_before = common.matmul_rates()

    llm = open_llm(folder, args)
    run_trillm(llm, common.make_workload(4, seed=99, output_range=(4, 8)))  # warm-up
    steps = record_steps(llm)
    hf_model = hf_list = None
    if not args.skip_hf:
        hf_model = load_hf(folder)
        hf_list = hf_batches(jobs, args.hf_batch_size, args.hf_order)
        run_hf(hf_model, hf_batches(common.make_workload(4, 99, output_range=(4, 8)), 4, "input"))

    hf_times, trillm_times, trillm_steps, hf_padded = [], [], [], 0
    for r in range(args.rounds):
        if hf_model is not None:
            res = run_hf(hf_model, hf_list)
            hf_times.append(res["seconds"])
            hf_padded = res["generated_incl_padding"]
            print(f"round {r}: HF      {res['seconds']:8.2f} s", flush=True)
        res = run_trillm(llm, jobs, steps)
        trillm_times.append(res["seconds"])
        trillm_steps.append(res)
        print(
            f"round {r}: trillm  {res['seconds']:8.2f} s ({res['steps']} steps, model "
            f"{res['model_s_sum']:.2f} s, engine step {res['step_s_sum']:.2f} s)",
            flush=True,
        )
    llm.shutdown()
    del hf_model

    decode_times = {
        ctx: decode_step_times(folder, args.decode_batch, args.decode_steps, ctx)
        for ctx in args.decode_contexts
    }
    rates_after = common.matmul_rates()
    rates = {k: max(rates_before[k], rates_after[k]) for k in rates_before}
    peak = max(rates.values())
    square = rates[f"{common.SQUARE_N}^3"]
    decode_gemm = f"{args.decode_batch}x512x1408"

    rows = [summarize_runs("trillm", trillm_times, prompt_toks, out_toks, flops_per_tok)]
    if hf_times:
        rows.insert(0, summarize_runs("hf", hf_times, prompt_toks, out_toks, flops_per_tok))
    for row in rows:
        row["mfu_vs_peak"] = row["achieved_gflops"] / peak
        row["mfu_vs_2048^3"] = row["achieved_gflops"] / square
    decodes = []
    for ctx, step_times in decode_times.items():
        step_s = statistics.median(step_times)
        decode_gflops = flops_per_tok * args.decode_batch / step_s / 1e9
        same_shape = rates.get(decode_gemm)
        decodes.append(
            dict(
                batch=args.decode_batch,
                context_start=ctx,
                step_ms_median=step_s * 1e3,
                step_ms_all=[round(t * 1e3, 2) for t in step_times],
                tok_s=args.decode_batch / step_s,
                achieved_gflops=decode_gflops,
                mfu_vs_peak=decode_gflops / peak,
                mfu_vs_2048_cubed=decode_gflops / square,
                mfu_vs_same_shape_gemm=decode_gflops / same_shape if same_shape else None,
            )
        )

    print("\nmatmul GFLOP/s (best of before/after):", {k: round(v, 1) for k, v in rates.items()})
    print(f"\noffline throughput (HF batch size {args.hf_batch_size}, order {args.hf_order}):")
    common.print_table(
        rows,
        [
            ("engine", ""),
            ("mean_s", ".2f"),
            ("output_tok_s", ".1f"),
            ("total_tok_s", ".1f"),
            ("achieved_gflops", ".1f"),
            ("mfu_vs_peak", ".1%"),
            ("mfu_vs_2048^3", ".1%"),
        ],
    )
    ratio = statistics.mean(hf_times) / statistics.mean(trillm_times) if hf_times else None
    if ratio is not None:
        print(f"trillm / HF tokens/s (ratio of means): {ratio:.2f}x  (target >= 4x)")
        print(f"HF generated {hf_padded} tokens incl. padding for {out_toks} requested")
    print(
        f"\ndecode steps at batch {args.decode_batch} (ModelRunner, median of {args.decode_steps}):"
    )
    common.print_table(
        decodes,
        [
            ("batch", "d"),
            ("context_start", "d"),
            ("step_ms_median", ".2f"),
            ("tok_s", ".1f"),
            ("achieved_gflops", ".1f"),
            ("mfu_vs_peak", ".1%"),
            ("mfu_vs_2048_cubed", ".1%"),
            ("mfu_vs_same_shape_gemm", ".1%"),
        ],
    )

    common.write_json(
        args.out,
        dict(
            benchmark="offline_vs_hf",
            machine=machine,
            args=vars(args) | {"out": str(args.out)},
            params=dict(counts.__dict__, flop_params=counts.flop_params),
            workload=dict(
                num_prompts=len(jobs),
                prompt_tokens=prompt_toks,
                output_tokens=out_toks,
                prompt_len_range=common.PROMPT_LEN_RANGE,
                output_len_range=common.OUTPUT_LEN_RANGE,
            ),
            matmul_gflops=dict(before=rates_before, after=rates_after, best=rates, peak=peak),
            offline=rows,
            trillm_step_timing=trillm_steps,
            hf_generated_incl_padding=hf_padded,
            ratio_trillm_over_hf=ratio,
            decode=decodes[0],
            decode_by_context=decodes,
            attention=attention_path(),
        ),
    )


if __name__ == "__main__":
    main()
