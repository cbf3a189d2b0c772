"""Native vs pure-Python scheduler twins: time schedule() + update_from_output() per step.

256 running requests decode one token per step (fake sampling: a fixed token, ignore_eos, no
finishes inside the timed window). Both twins run the same workload side by side in one process;
the figure is their ratio (these machines are shared and noisy).

    python benchmarks/engine/scheduler_twins.py [--num-requests 256] [--steps 300] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root

from trillm import _native  # noqa: E402
from trillm.config import CacheConfig, SchedulerConfig  # noqa: E402
from trillm.core.scheduler import Scheduler as PyScheduler  # noqa: E402
from trillm.messages import EngineCoreRequest, ModelRunnerOutput  # noqa: E402
from trillm.sampling_params import SamplingParams  # noqa: E402


def build(cls, num_requests: int, prompt_len: int, steps: int, block_size: int):
    max_len = prompt_len + steps + 64
    num_blocks = num_requests * (-(-max_len // block_size)) + 16
    sched = cls(
        SchedulerConfig(
            max_num_seqs=num_requests, max_num_batched_tokens=8192, max_model_len=max_len
        ),
        CacheConfig(block_size=block_size),
        num_blocks,
    )
    params = SamplingParams(max_tokens=steps + 32, ignore_eos=True)
    for i in range(num_requests):
        prompt = [(i * 7919 + j) % 30000 for j in range(prompt_len)]  # distinct: no prefix hits
        sched.add_request(EngineCoreRequest(f"req-{i}", prompt, params, float(i)))
    return sched


def fake_runner_output(sched_out) -> ModelRunnerOutput:
    req_ids = list(sched_out.num_scheduled_tokens)
    return ModelRunnerOutput(sched_out.step_id, req_ids, [[11] for _ in req_ids])


def run(cls, num_requests: int, prompt_len: int, steps: int, block_size: int) -> float:
    """Seconds per decode step (schedule + update_from_output), prefill excluded."""
    sched = build(cls, num_requests, prompt_len, steps, block_size)
    while sched.get_request_counts()[1] or not sched.num_running:  # prefill everything first
        out = sched.schedule()
        sched.update_from_output(out, fake_runner_output(out))
    total = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        runner_out = fake_runner_output(out)
        t2 = time.perf_counter()
        sched.update_from_output(out, runner_out)
        total += (t1 - t0) + (time.perf_counter() - t2)
        assert len(out.num_scheduled_tokens) == num_requests
    return total / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    native = _native.native_module("scheduler")
    if native is None:
        raise SystemExit("native scheduler not built: python setup.py build_ext --inplace")
    impls = {"python": PyScheduler, "native": native.Scheduler}
    times: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(args.repeats):  # interleaved, so both see the same machine load
        for name, cls in impls.items():
            times[name].append(
                run(cls, args.num_requests, args.prompt_len, args.steps, args.block_size)
            )
    med = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"{args.num_requests} running requests, {args.steps} decode steps, "
        f"block_size={args.block_size}, median of {args.repeats}"
    )
    for name, t in med.items():
        print(f"  {name:7s} schedule+update_from_output: {t * 1e6:9.1f} us/step")
    print(f"  speed-up native / python: {med['python'] / med['native']:.2f}x")


if __name__ == "__main__":
    main()
