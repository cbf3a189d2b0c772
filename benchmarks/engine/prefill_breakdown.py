"""Where one long prompt's prefill goes, kernel by kernel, on a bf16 model (issue 38's
"Prefill"): one fresh prompt of ``--prompt-len`` tokens through ``LLM.generate`` with
``max_tokens=1``, the engine in this process (``uni``), ``enforce_eager`` so every native call
goes through ``kernels/recording.py``, each call timed in wall time (the kernels run on the
thread pool). The GEMM calls' rate is their FLOPs over their time; what is left of the
generate call's wall time is Python and torch glue (embedding, residual adds, the step's
scheduling, sampling). Each call's process CPU time (all threads) is summed too: the GEMMs'
FLOPs over it (GFLOP a core-second) is their rate on the cores they held, which a shared
machine's load does not lower as it lowers the wall rate (against a core's peak:
``benchmarks/kernels/cpu_gemm_bf16_prefill.py``). Compare the GEMM rate with
``benchmarks/kernels/cpu_gemm.py`` or the per-shape figures of ``--gemm-shapes`` (the model's
linear shapes at ``--rows`` rows, the native bf16 GEMM against torch's bf16 ``F.linear``, best
of 3 each).

    python benchmarks/engine/prefill_breakdown.py \
        --model ~/.cache/trillm-peer/llama-3.2-1b-shape/llama-3.2-1b --prompt-len 1024 8192

``--bf16-dot both`` alternates the fresh-prompt attention's AVX512-BF16 products with its AVX2
path round by round (ext/cpu_prefill_attention_dp.h); the result of

    python benchmarks/engine/prefill_breakdown.py --model ~/.cache/trillm-peer/llama-3.2-1b-shape/llama-3.2-1b \
        --prompt-len 1024 4096 --rounds 2 --bf16-dot both --out benchmarks/engine/results/prefill_breakdown_1b.json

is in benchmarks/engine/results/prefill_breakdown_1b.{json,txt} (this 2-core Zen 4 host, shared).

A quantized GGUF as c16 serving runs SmolLM2-135M's (``--dtype auto``: float32, its linears on
the quantized kernels with int8 activations; each GEMM shape's process CPU printed too), here
before / after a kernel change with ``--ext`` (another build's extension), run by run:

    GOMP_SPINCOUNT=20000 python benchmarks/engine/prefill_breakdown.py \
        --model ~/.cache/trillm-peer/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --tokenizer ~/.cache/trillm-peer/smollm2-135m-instruct --dtype auto \
        --prompt-len 256 --prompts 8 --rounds 3 [--ext /tmp/before/cpu_kernels.so]

``--paged-dot both`` alternates a chunked prompt's later chunks (a prompt longer than
``--max-num-batched-tokens``) between the paged kernel's long-chunk path (vdpbf16ps,
ext/cpu_attention_paged_dp.h, or on a CPU without AVX512-BF16 its AVX2 tiles,
ext/cpu_attention_paged_avx2.h) and its fp32 tile kernel: one 8,192-token prompt at the default
chunk size on the 1B shape cut to 2 layers is in
benchmarks/engine/results/prefill_breakdown_1b2l_8k_chunked.{json,txt}.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

import torch  # noqa: E402

from trillm.kernels import paged_attention_cpu, recording  # noqa: E402


def kernel_name(kernel: Any) -> str:
    module = str(getattr(kernel, "__module__", "") or "").rsplit(".", 1)[-1]
    name = str(getattr(kernel, "__name__", type(kernel).__name__))
    return f"{module}.{name}" if module else name


def gemm_shapes(model: Path, rows: list[int]) -> list[dict]:
    """The native bf16 GEMM and torch's bf16 F.linear at the model's linear shapes."""
    import torch.nn.functional as F

    from trillm.kernels import linear_cpu

    cfg = json.loads((model / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    shapes = {
        "qkv": ((heads + 2 * kv) * d, hidden),
        "o": (hidden, heads * d),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "lm_head": (cfg["vocab_size"], hidden),
    }
    out = []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k).to(torch.bfloat16)
        packed = linear_cpu.PackedWeightBf16(w)
        for m in rows:
            x = torch.randn(m, k).to(torch.bfloat16)
            rates = {}
            for label, fn in (
                ("native", lambda x=x, p=packed: linear_cpu.linear_bf16(x, p)),
                ("torch", lambda x=x, w=w: F.linear(x, w)),
            ):
                fn()
                times = []
                for _ in range(3):
                    t = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t)
                rates[label] = 2 * m * n * k / min(times) / 1e9
            row = dict(op=name, m=m, n=n, k=k, native_gflops=rates["native"])
            row["torch_gflops"] = rates["torch"]
            print(
                f"  {name:8s} M={m:5d} N={n:6d} K={k:5d}  native {rates['native']:6.1f} GFLOP/s"
                f"  torch {rates['torch']:6.1f} GFLOP/s",
                flush=True,
            )
            out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--prompt-len", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--prompts",
        type=int,
        default=1,
        help="fresh prompts of --prompt-len each, handed over together (one step when they fit "
        "the token budget: 8 x 256 = the server's 2,048)",
    )
    parser.add_argument(
        "--bf16-dot",
        choices=("on", "off", "both"),
        default="on",
        help="the fresh-prompt attention's bf16 products on vdpbf16ps (where the CPU has "
        "AVX512-BF16) or its AVX2 path; both: alternated, each round",
    )
    parser.add_argument(
        "--paged-dot",
        choices=("on", "off", "both"),
        default="on",
        help="a chunked prompt's later chunks' attention on the paged kernel's long-chunk path "
        "(the best the CPU has: vdpbf16ps or AVX2 tiles) or its fp32 tile kernel; both: "
        "alternated, each round",
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        help="the model's dtype (auto: a quantized GGUF runs in float32, its linears on the "
        "quantized kernels, int8 activations at prefill)",
    )
    parser.add_argument("--tokenizer", type=Path, help="a GGUF model's Hugging Face tokenizer")
    parser.add_argument(
        "--ext",
        help="another build's cpu_kernels extension (a copy of trillm/_ext/cpu_kernels*.so) in "
        "place of the tree's: a before / after of a native kernel, run by run",
    )
    parser.add_argument("--gemm-shapes", action="store_true")
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.ext:  # before anything loads the tree's (trillm imports its extensions lazily)
        import importlib.util

        spec = importlib.util.spec_from_file_location("trillm._ext.cpu_kernels", args.ext)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["trillm._ext.cpu_kernels"] = module
        spec.loader.exec_module(module)
    model = args.model.expanduser()
    result: dict[str, Any] = dict(args={k: str(v) for k, v in vars(args).items()})
    result["load_avg_1m"] = Path("/proc/loadavg").read_text().split()[0]
    result["threads"] = torch.get_num_threads()
    if args.gemm_shapes:
        print("GEMM shapes (bf16):")
        result["gemm_shapes"] = gemm_shapes(model, args.rows)

    spent: dict[str, float] = collections.defaultdict(float)
    cpu_spent: dict[str, float] = collections.defaultdict(float)  # process CPU s (all threads)
    calls: collections.Counter[str] = collections.Counter()
    flops: dict[str, float] = collections.defaultdict(float)
    # per GEMM shape (kernel, N, K, and the quantized kernel's weight type): wall s, CPU s, FLOPs
    shape_s: dict[str, float] = collections.defaultdict(float)
    shape_cpu: dict[str, float] = collections.defaultdict(float)
    shape_calls: collections.Counter[str] = collections.Counter()
    shape_flops: dict[str, float] = collections.defaultdict(float)
    native_call, native_attention = recording.call, recording.attention

    def timed_call(kernel: Any, *a: Any, **kw: Any) -> None:
        name = kernel_name(kernel)
        start, cpu_start = time.perf_counter(), time.process_time()
        native_call(kernel, *a, **kw)
        spent[name] += time.perf_counter() - start
        cpu_spent[name] += time.process_time() - cpu_start
        calls[name] += 1
        if name == "gemm_q.linear" and len(a) >= 8:  # (x, x_bf16, M, K, ldx, packed, qtype, N, ...)
            m, k, n = a[2], a[3], a[7]
        elif name.endswith(".linear") and len(a) >= 7:  # (x, x_dtype, M, K, ldx, packed, N, ...)
            m, k, n = a[2], a[3], a[6]
        else:
            return
        flops[name] += 2.0 * m * k * n
        shape = f"{name} N={n} K={k}" + (f" q{a[6]}" if name == "gemm_q.linear" else "")
        shape_s[shape] += time.perf_counter() - start
        shape_cpu[shape] += time.process_time() - cpu_start
        shape_calls[shape] += 1
        shape_flops[shape] += 2.0 * m * k * n

    def timed_attention(plan: Any, native: Any, **kw: Any) -> None:
        start, cpu_start = time.perf_counter(), time.process_time()
        native_attention(plan, native, **kw)
        spent["paged_attention"] += time.perf_counter() - start
        cpu_spent["paged_attention"] += time.process_time() - cpu_start
        calls["paged_attention"] += 1

    recording.call, recording.attention = timed_call, timed_attention  # type: ignore[assignment]
    from trillm import LLM, SamplingParams

    longest = max(args.prompt_len)
    kw: dict[str, Any] = {}
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.tokenizer:
        kw["tokenizer"] = str(args.tokenizer.expanduser())
    llm = LLM(
        str(model),
        dtype=args.dtype,
        max_model_len=max(longest + 16, 128),
        max_num_seqs=args.prompts,
        kv_cache_memory="2GiB",
        enable_prefix_caching=False,
        enforce_eager=True,
        distributed_executor_backend="uni",
        **kw,
    )
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5] * 64}], params, use_tqdm=False)  # warm-up
    result["runs"] = []
    attention = paged_attention_cpu.cpu_kernels("attention")
    fresh = ["on", "off"] if args.bf16_dot == "both" else [args.bf16_dot]
    paged = ["on", "off"] if args.paged_dot == "both" else [args.paged_dot]
    variants = [f"{a}/{b}" for a in fresh for b in paged]  # fresh-prompt / paged kernel
    dot_before = attention.prefill_bf16_dot(True)
    paged_before = attention.paged_chunk_kernel()  # "on": the CPU's best, "off": the tile kernel
    try:
        for length, r, variant in (
            (n, r, v) for n in args.prompt_len for r in range(args.rounds) for v in variants
        ):
            attention.prefill_bf16_dot(variant.split("/")[0] == "on")
            attention.paged_chunk_kernel(paged_before if variant.endswith("/on") else "tile")
            for table in (
                spent,
                cpu_spent,
                calls,
                flops,
                shape_s,
                shape_cpu,
                shape_calls,
                shape_flops,
            ):
                table.clear()
            batch = [
                {"prompt_token_ids": torch.randint(100, 30000, (length,), generator=g).tolist()}
                for _ in range(args.prompts)
            ]
            load = os.getloadavg()[0]
            start, cpu_start = time.perf_counter(), time.process_time()
            llm.generate(batch, params, use_tqdm=False)
            total = time.perf_counter() - start
            total_cpu = time.process_time() - cpu_start
            kernels = sum(spent.values())
            gemm_s = sum(spent[n] for n in flops)
            gemm_cpu_s = sum(cpu_spent[n] for n in flops)
            gemm_rate = sum(flops.values()) / gemm_s / 1e9 if gemm_s else 0.0
            # GFLOP a core-second: the rate a core held by the GEMM gives, whatever the load
            gemm_cpu_rate = sum(flops.values()) / gemm_cpu_s / 1e9 if gemm_cpu_s else 0.0
            print(
                f"{args.prompts} x {length} tokens (round {r}, bf16 dot fresh/paged {variant}, load {load:.1f}): TTFT {total:.2f} s,"
                f" {args.prompts * length / total:,.0f} tok/s, process CPU {total_cpu:.2f} s; GEMMs {gemm_s:.2f} s"
                f" at {gemm_rate:.1f} GFLOP/s ({gemm_cpu_rate:.1f} GFLOP a core-second)"
            )
            ops = sorted(spent.items(), key=lambda kv: -kv[1])
            for name, seconds in ops:
                print(
                    f"  {name:36s} {seconds:7.2f} s {100 * seconds / total:5.1f}%"
                    f"  {calls[name]} calls, process CPU {cpu_spent[name]:6.3f} s"
                )
            for shape in sorted(shape_s, key=lambda k: -shape_cpu[k]):
                print(
                    f"    {shape:38s} {shape_calls[shape]:4d} calls, process CPU {shape_cpu[shape]:6.3f} s,"
                    f" {shape_flops[shape] / shape_cpu[shape] / 1e9 if shape_cpu[shape] else 0.0:6.1f} GFLOP a core-second"
                )
            rest_cpu = total_cpu - sum(cpu_spent.values())
            print(
                f"  {'(rest: Python, torch glue)':36s} {total - kernels:7.2f} s "
                f"{100 * (total - kernels) / total:5.1f}%  process CPU {rest_cpu:6.3f} s",
                flush=True,
            )
            run = dict(prompt_len=length, round=r, bf16_dot=variant, ttft_s=total)
            run["load_avg_1m"] = load
            run["process_cpu_s"] = total_cpu
            run["gemm_s"] = gemm_s
            run["gemm_gflops"] = gemm_rate
            run["gemm_cpu_s"] = gemm_cpu_s
            run["gemm_gflops_per_core_s"] = gemm_cpu_rate
            run["gemm_flops"] = sum(flops.values())
            run["ops"] = {n: dict(s=s, cpu_s=cpu_spent[n], calls=calls[n]) for n, s in ops}
            run["gemm_shapes"] = {
                k: dict(
                    s=shape_s[k], cpu_s=shape_cpu[k], calls=shape_calls[k], flops=shape_flops[k]
                )
                for k in shape_s
            }
            run["rest_s"] = total - kernels
            run["rest_cpu_s"] = rest_cpu
            result["runs"].append(run)
    finally:
        attention.prefill_bf16_dot(dot_before)
        attention.paged_chunk_kernel(paged_before)
        llm.shutdown()
        recording.call, recording.attention = native_call, native_attention  # type: ignore[assignment]
    for length in args.prompt_len:
        for variant in variants:
            runs = result["runs"]
            ttfts = [
                r["ttft_s"] for r in runs if (r["prompt_len"], r["bf16_dot"]) == (length, variant)
            ]
            print(
                f"{length} tokens, bf16 dot fresh/paged {variant}: median TTFT {statistics.median(ttfts):.2f} s"
            )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
