"""The sampler's all-greedy call at a concurrency-16 SmolLM2-135M decode step (16 greedy slots,
16 x 49,152 float32 logits): process CPU ms and wall ms a call, median of 5 x 100 calls, with 1
and 2 torch threads (a served worker runs as many as the cores), one fresh process per tree and
thread count, trees alternated each round. ``--trees``: source trees to compare (each first on
PYTHONPATH; e.g. a ``git worktree`` of an older commit with its built extensions), default
this one.

    python benchmarks/engine/greedy_argmax.py [--trees /tmp/old .] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
import trillm
from trillm.sample.sampler import Sampler, SamplingState
from trillm.sampling_params import SamplingParams
state = SamplingState(16, 49152, torch.device("cpu"))
for slot in range(16):
    state.add_request(slot, SamplingParams(temperature=0.0), prompt_token_ids=[], output_token_ids=[])
sampler, slots, logits = Sampler(), torch.arange(16), torch.randn(16, 49152)
for _ in range(20):
    sampler(logits, state, slots, None)
times = []
for _ in range(5):
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(100):
        sampler(logits, state, slots, None)
    times.append(((time.process_time() - cpu) * 10, (time.perf_counter() - wall) * 10))
times.sort()
print(f"{trillm.__file__}: torch threads {sys.argv[1]}: process CPU {times[2][0]:.3f} ms a call "
      f"(min {times[0][0]:.3f}), wall {times[2][1]:.3f} ms")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", default=[str(Path(__file__).resolve().parents[2])])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for _ in range(args.rounds):
        for threads in ("1", "2"):
            for tree in args.trees:
                env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
                subprocess.run([sys.executable, "-c", CHILD, threads], cwd="/", env=env, check=True)


if __name__ == "__main__":
    main()
