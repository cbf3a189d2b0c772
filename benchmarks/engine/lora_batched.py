"""Batched mixed-adapter LoRA vs one adapter at a time, offline, on the benchmark model.

One ``LLM(enable_lora=True, max_loras=A)``; A PEFT adapters (rank R, every q/k/v/o/gate/up/
down projection) built on ``common.MODEL_SPEC``'s model; P prompts per adapter (greedy,
``ignore_eos``, fixed lengths). Each round measures, alternately in the same process:

- ``mixed``: all A x P requests in one ``generate`` call (one batch of several adapters);
- ``one_at_a_time``: one ``generate`` call per adapter, each with its P requests;
- ``base``: the same A x P requests without adapters (the cost of the LoRA deltas);
- with ``--compare-torch``, also ``mixed_torch_ref``: the mixed batch with the LoRA deltas on
  the torch reference (``kernels/lora_torch.py``) instead of the native shrink / expand kernel
  (the worker then runs in this process, ``distributed_executor_backend="uni"``, for every mode).

    python benchmarks/engine/lora_batched.py --compare-torch --out benchmarks/engine/results/lora_batched.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

from benchmarks.common import (  # noqa: E402
    build_bench_model,
    machine_info,
    make_workload,
    print_table,
    set_threads,
    write_json,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--prompts-per-adapter", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--compare-torch",
        action="store_true",
        help="also run the mixed batch on the torch reference of the LoRA kernels",
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    set_threads(args.threads)

    from trillm import LLM, LoRARequest, SamplingParams
    from trillm.testing.lora_adapters import build_peft_adapter

    model = build_bench_model()
    tmp = Path(tempfile.mkdtemp(prefix="trillm-lora-bench-"))
    loras = [
        LoRARequest(
            f"a{i}",
            i + 1,
            str(build_peft_adapter(model, tmp / f"a{i}", seed=i, rank=args.rank, alpha=args.rank)),
        )
        for i in range(args.adapters)
    ]
    jobs = make_workload(
        args.adapters * args.prompts_per_adapter,
        seed=0,
        prompt_range=(args.prompt_len,) * 2,
        output_range=(args.output_len,) * 2,
    )
    prompts = [{"prompt_token_ids": j.prompt_ids} for j in jobs]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    per = args.prompts_per_adapter
    owner = [loras[i // per] for i in range(len(prompts))]  # prompt i -> its adapter
    total_tokens = len(prompts) * args.output_len

    backend = "uni" if args.compare_torch else "mp"
    with LLM(
        str(model),
        enable_lora=True,
        max_loras=args.adapters,
        max_lora_rank=args.rank,
        enable_prefix_caching=False,
        distributed_executor_backend=backend,
    ) as llm:

        def mixed() -> None:
            llm.generate(prompts, params, use_tqdm=False, lora_request=owner)

        def one_at_a_time() -> None:
            for k, lora in enumerate(loras):
                llm.generate(
                    prompts[k * per : (k + 1) * per], params, use_tqdm=False, lora_request=lora
                )

        def base() -> None:
            llm.generate(prompts, params, use_tqdm=False)

        def mixed_torch_ref() -> None:
            from trillm.kernels import lora_cpu

            saved = lora_cpu.available
            lora_cpu.available = lambda: False  # the dispatch then takes kernels/lora_torch.py
            try:
                mixed()
            finally:
                lora_cpu.available = saved

        modes = {"mixed": mixed, "one_at_a_time": one_at_a_time, "base": base}
        if args.compare_torch:
            modes["mixed_torch_ref"] = mixed_torch_ref
        llm.generate(prompts[:2], params, use_tqdm=False, lora_request=owner[:2])  # warm-up
        times: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.rounds):
            for name, run in modes.items():
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
    rows = [
        dict(
            mode=name,
            wall_s=statistics.median(ts),
            output_tok_s=total_tokens / statistics.median(ts),
            runs=len(ts),
        )
        for name, ts in times.items()
    ]
    print_table(rows, [("mode", ""), ("wall_s", ".2f"), ("output_tok_s", ".1f"), ("runs", "d")])
    speedup = statistics.median(times["one_at_a_time"]) / statistics.median(times["mixed"])
    print(f"mixed batch vs one adapter at a time: {speedup:.2f}x")
    write_json(
        args.out,
        dict(
            machine=machine_info(),
            args=vars(args),
            rows=rows,
            times=times,
            speedup_mixed_vs_one_at_a_time=speedup,
        ),
    )


if __name__ == "__main__":
    main()
