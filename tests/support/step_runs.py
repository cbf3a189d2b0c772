"""A tiny model's runner with step programs on, and a decode whose batch shrinks through
several token counts (requests of different lengths finish at different steps)."""

from __future__ import annotations

from runner_harness import BLOCK_SIZE, NUM_BLOCKS, MiniScheduler, Req, random_prompts

from trillm.config import EngineArgs
from trillm.engine.config_builder import build_config
from trillm.sampling_params import SamplingParams
from trillm.worker.model_runner import ModelRunner

PROMPT_LENS = [3, 29, 12, 41, 8]


def step_runner(
    path, *, eager: bool = False, dtype: str = "float32", seqs: int = 16
) -> ModelRunner:
    args = EngineArgs(
        model=str(path),
        dtype=dtype,
        device="cpu",
        block_size=BLOCK_SIZE,
        max_num_seqs=seqs,
        max_model_len=256,
        num_gpu_blocks_override=NUM_BLOCKS,
        distributed_executor_backend="uni",
        enforce_eager=eager,
    )
    runner = ModelRunner(build_config(args))
    runner.load_model()
    runner.initialize_kv_cache(runner.determine_num_blocks())
    return runner


def decode_shrinking_batch(runner: ModelRunner, lens=PROMPT_LENS, seed: int | None = None):
    """Each request's tokens and per-step logprobs (greedy, or seeded sampling)."""
    sched = MiniScheduler(runner)
    reqs = []
    for i, prompt in enumerate(random_prompts(lens)):
        n = 4 + 3 * i  # the batch shrinks as they finish
        if seed is None:
            params = SamplingParams(temperature=0.0, max_tokens=n, logprobs=3)
        else:
            params = SamplingParams(
                temperature=1.0, top_p=0.9, seed=seed + i, max_tokens=n, logprobs=3
            )
        reqs.append(Req(f"r{i}", prompt, params, n))
        sched.add(reqs[-1])
    sched.run()
    return [r.output for r in reqs], [r.logprobs for r in reqs]
