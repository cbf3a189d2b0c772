"""Where a concurrency-16 run's CPU time goes: ``--requests`` prompts (SmolLM2-135M by
default, 256-token prompts, 128 outputs, greedy, EOS ignored) sent by ``--concurrency`` clients
in a closed loop (each sends its next prompt when its last one finished, as ``trillm bench
serve --max-concurrency`` does; 16 and 16: all arrive together), the engine in this process
(``distributed_executor_backend`` uni, the server's default step budget), its steps split into
prefill steps (any request with more than one scheduled token) and decode steps, and each
kind's time split into the model's forward (kernel by kernel and, for the GEMMs, shape by
shape), the head (``compute_logits``), sampling and the rest (scheduler, detokenizer, Python
between them). A request's TTFT is the process CPU time from its arrival to its first token.

Every clock is CPU time of the thread that did the work (``time.thread_time``) or of the
process (``time.process_time``), which other load on the machine barely moves. The kernels are
timed through ``kernels/recording.py``, so the forward runs eagerly (``enforce_eager``: a step
program's replay calls its kernels natively, unseen); ``--programs`` keeps the programs and
times only the stages. ``--threads`` sets torch's and the kernels' threads (1 by default: the
CPU time is then the work, no pool spinning).

    python benchmarks/engine/c16_breakdown.py [--gguf ~/.cache/trillm-peer/models/SmolLM2-135M-Instruct.Q4_1.gguf]
        [--requests 64] [--budget 2048] [--rounds 1] [--programs] [--dtype D] [--kv-cache-dtype D]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root

from benchmarks import common  # noqa: E402

MODEL = Path("~/.cache/trillm-peer/smollm2-135m-instruct").expanduser()
_ROW_BUCKETS = (1, 16, 64, 256, 1024, 4096)


def _rows(m: int) -> str:
    for b in _ROW_BUCKETS:
        if m <= b:
            return f"M<={b}"
    return f"M>{_ROW_BUCKETS[-1]}"


class Clock:
    """Thread CPU seconds by (step kind, what), and calls."""

    def __init__(self) -> None:
        self.spent: dict[tuple[str, str], float] = collections.defaultdict(float)
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()
        self.kind = "idle"

    def add(self, what: str, seconds: float) -> None:
        self.spent[self.kind, what] += seconds
        self.calls[self.kind, what] += 1

    def clear(self) -> None:
        self.spent.clear()
        self.calls.clear()


def install(clock: Clock) -> None:
    """Wraps the kernels' recording hooks and the model runner's stages with thread clocks."""
    from trillm.kernels import recording
    from trillm.worker import model_runner

    native_call, native_attention = recording.call, recording.attention

    def timed_call(kernel: Any, *a: Any, **kw: Any) -> Any:
        name = str(getattr(kernel, "__name__", type(kernel).__name__))
        module = getattr(kernel, "__module__", "") or ""
        if name == "linear" and len(a) >= 8:  # (x, x_bf16, m, k, ldx, packed, [type,] n, …)
            part = module.rsplit(".", 1)[-1]
            n = a[7] if part == "gemm_q" else a[6]
            name = f"{part}.linear {_rows(a[2])} K{a[3]} N{n}"
        start = time.thread_time()
        out = native_call(kernel, *a, **kw)
        clock.add(name, time.thread_time() - start)
        return out

    def timed_attention(plan: Any, native: Any, **kw: Any) -> Any:
        start = time.thread_time()
        out = native_attention(plan, native, **kw)
        clock.add("paged_attention", time.thread_time() - start)
        return out

    recording.call, recording.attention = timed_call, timed_attention  # type: ignore[assignment]
    runner = model_runner.ModelRunner

    def stage(method: str, label: str) -> None:
        original = getattr(runner, method)

        def timed(self: Any, *a: Any, **kw: Any) -> Any:
            start = time.thread_time()
            try:
                return original(self, *a, **kw)
            finally:
                clock.add(label, time.thread_time() - start)

        setattr(runner, method, timed)

    execute = runner.execute_model

    def execute_model(self: Any, sched: Any) -> Any:
        counts = list(sched.num_scheduled_tokens.values())
        clock.kind = "prefill" if any(n > 1 for n in counts) else "decode"
        start = time.thread_time()
        try:
            return execute(self, sched)
        finally:
            clock.add("[execute_model]", time.thread_time() - start)

    runner.execute_model = execute_model  # type: ignore[method-assign]
    stage("_forward", "[forward]")
    stage("sample_tokens", "[sample_tokens]")


def open_llm(args: argparse.Namespace) -> Any:
    from trillm import LLM

    kw: dict[str, Any] = dict(
        device="cpu",
        kv_cache_memory="512MiB",
        max_model_len=args.prompt_len + args.output_len + 16,
        max_num_batched_tokens=args.budget,
        enable_prefix_caching=False,
        distributed_executor_backend="uni",
        enforce_eager=not args.programs,
    )
    if args.kv_cache_dtype:
        kw["kv_cache_dtype"] = args.kv_cache_dtype
    if args.gguf:  # --dtype auto unless named
        dtype = {"dtype": args.dtype} if args.dtype else {}
        return LLM(str(Path(args.gguf).expanduser()), tokenizer=str(MODEL), **kw, **dtype)
    return LLM(str(MODEL), dtype=args.dtype or "bfloat16", **kw)


def closed_loop(llm: Any, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """``args.requests`` prompts from ``args.concurrency`` clients, each sending its next
    prompt when its last one finished; TTFTs in process CPU seconds."""
    import numpy as np
    import trio

    from trillm import SamplingParams

    rng = np.random.default_rng(seed)
    vocab = llm.get_tokenizer().vocab_size
    prompts = [
        {"prompt_token_ids": rng.integers(100, min(vocab, 30000), args.prompt_len).tolist()}
        for _ in range(args.requests)
    ]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    ttft: list[float] = []
    tokens = 0
    queue = iter(enumerate(prompts))

    async def client() -> None:
        nonlocal tokens
        for i, prompt in queue:
            sent = time.process_time()
            first = None
            async with llm.engine.generate(prompt, params, f"c16-{seed}-{i}") as outputs:
                async for out in outputs:
                    if first is None and out.outputs and out.outputs[0].token_ids:
                        first = time.process_time()
                    if out.finished:
                        tokens += len(out.outputs[0].token_ids)
            assert first is not None
            ttft.append(first - sent)

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(args.concurrency):
                nursery.start_soon(client)

    c0, w0 = time.process_time(), time.perf_counter()
    llm._call(run)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    return dict(
        mean_ttft_cpu_s=statistics.mean(ttft),
        median_ttft_cpu_s=statistics.median(ttft),
        max_ttft_cpu_s=max(ttft),
        total_cpu_s=cpu,
        wall_s=wall,
        tokens=tokens,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", default=None, help="a GGUF file (else the bf16 folder)")
    p.add_argument("--dtype", default=None, help="bfloat16 for the folder, auto for a GGUF")
    p.add_argument("--kv-cache-dtype", default=None, help="auto unless named")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--programs", action="store_true", help="keep step programs (no kernels)")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    common.set_threads(args.threads)
    clock = Clock()
    install(clock)
    llm = open_llm(args)
    core = llm.engine.cores[0]
    steps: dict[str, list[float]] = collections.defaultdict(list)
    step = core.step

    async def step_timed() -> Any:
        start = time.process_time()
        result = await step()
        if result is not None and result.num_scheduled_tokens:
            steps[clock.kind].append(time.process_time() - start)
        return result

    core.step = step_timed
    closed_loop(llm, argparse.Namespace(**{**vars(args), "requests": 2, "output_len": 4}), 99)
    for r in range(args.rounds):
        clock.clear()
        steps.clear()
        run = closed_loop(llm, args, r)
        print(
            f"round {r + 1}: mean TTFT {run['mean_ttft_cpu_s']:.2f} CPU s (median"
            f" {run['median_ttft_cpu_s']:.2f}, max {run['max_ttft_cpu_s']:.2f}), total"
            f" {run['total_cpu_s']:.2f} CPU s, {run['tokens'] / run['total_cpu_s']:.1f} output"
            f" tokens a CPU-s, wall {run['wall_s']:.2f} s",
            flush=True,
        )
        for kind in ("prefill", "decode"):
            n = len(steps[kind])
            if not n:
                continue
            total = sum(steps[kind])
            print(
                f"  {kind}: {n} steps, {total:.2f} CPU s (process), median"
                f" {1e3 * statistics.median(steps[kind]):.1f} ms a step"
            )
            rows = sorted(
                ((w, s) for (k, w), s in clock.spent.items() if k == kind), key=lambda x: -x[1]
            )
            for what, seconds in rows[: args.top]:
                calls = clock.calls[kind, what]
                print(
                    f"    {what:44s} {seconds:7.3f} s {100 * seconds / total:5.1f}%"
                    f" {1e3 * seconds / n:7.2f} ms/step  {calls} calls"
                )


if __name__ == "__main__":
    main()
