"""Two or more builds of the quantized GEMM (ext/cpu_gemm_q*) side by side in one process.

Each ``--revs`` entry (a git revision, or ``tree`` for the work tree) has its ``ext/cpu_gemm_q*``
(with cpu_common.h / cpu_program.h) built alone into a side module (a few lines of its own thread
pool; one C++ compile each, ~1 min), loaded into this process; at Llama-3.2-1B's shapes (qkv
3072x2048, o 2048x2048, gate_up 16384x2048, down 2048x8192; ``--head``: the tied 128,256 x 2,048
head in Q6_KP) each row count's call runs on every build in turn, round after round, bf16 rows
and bf16 out, int8 activations; per shape and build the median of the process's CPU time, the
GOP a core-second, the ratio to the first build and whether every build's output has the first
one's bits; ``step``: 16 layers' sum (head once).

    PYTHONPATH=<dir with pybind11> python benchmarks/kernels/q_side_modules.py \
        --revs HEAD~1 tree --types Q4_0 Q4_K --rows 16 32 [--head] [--rounds 15] [--threads 1]
        [--unpacked-from 0]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.kernels.q_small_m import random_weight  # noqa: E402

SOURCES = ("cpu_common.h", "cpu_program.h")
SHAPES = (("qkv", 3072, 2048, 16), ("o", 2048, 2048, 16), ("gate_up", 16384, 2048, 16))
SHAPES += (("down", 2048, 8192, 16),)
WRAPPER = """#include "cpu_gemm_q.cpp"
namespace trillm_cpu {
ThreadPool* pool_for(int num_threads) {  // one pool per count, as ext/cpu_kernels.cpp keeps
  static std::vector<ThreadPool*> pools;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  for (ThreadPool* pool : pools)
    if (pool->num_workers() == num_threads - 1) return pool;
  pools.push_back(new ThreadPool(num_threads - 1));
  return pools.back();
}
}  // namespace trillm_cpu
PYBIND11_MODULE(MODNAME, m) { register_cpu_gemm_q(m); }
"""


def build(rev: str, index: int, out: Path) -> str:
    """rev's cpu_gemm_q as module q_side<index> in out; its name."""
    src = out / f"src{index}"
    src.mkdir()
    files = [p.name for p in (ROOT / "ext").glob("cpu_gemm_q*")] + list(SOURCES)
    for name in files:
        if rev == "tree":
            text = (ROOT / "ext" / name).read_text()
        else:
            text = subprocess.run(
                ["git", "-C", str(ROOT), "show", f"{rev}:ext/{name}"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        (src / name).write_text(text)
    (src / "wrap.cpp").write_text(WRAPPER)
    import pybind11  # noqa: PLC0415 - a build dependency, not the project's

    name = f"q_side{index}"
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    subprocess.run(
        ["c++", "-O3", "-std=c++17", "-pthread", "-Wno-psabi", "-fPIC", "-shared"]
        + [f"-DMODNAME={name}", f"-I{src}", f"-I{pybind11.get_include()}"]
        + [f"-I{sysconfig.get_paths()['include']}", str(src / "wrap.cpp")]
        + ["-o", str(out / f"{name}{suffix}")],
        check=True,
    )
    return name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--revs", nargs="+", default=["HEAD", "tree"])
    p.add_argument("--types", nargs="+", default=["Q4_0"])
    p.add_argument("--rows", type=int, nargs="+", default=[16])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--head", action="store_true")
    p.add_argument("--unpacked-from", type=int, default=0)
    args = p.parse_args()
    out = Path(tempfile.mkdtemp(prefix="q_side_"))
    sys.path.insert(0, str(out))
    mods = [importlib.import_module(build(rev, i, out)) for i, rev in enumerate(args.revs)]
    for mod in mods:
        mod._set_int8_unpacked_min_rows(args.unpacked_from)
    shapes = [
        (t, s, random_weight(t, s[1], s[2], i)) for t in args.types for i, s in enumerate(SHAPES)
    ]
    if args.head:
        head = ("head", 128256, 2048, 1)
        shapes.append(("Q6_KP", head, random_weight("Q6_KP", head[1], head[2], 9)))
    steps: dict[tuple[int, str, int], float] = {}
    for m in args.rows:
        for t, (name, n, k, calls), w in shapes:
            x = torch.randn(m, k).bfloat16()
            outs = [torch.empty(m, n, dtype=torch.bfloat16) for _ in mods]
            times: list[list[float]] = [[] for _ in mods]
            for _ in range(args.rounds):
                for i, mod in enumerate(mods):
                    c = time.process_time()
                    mod.linear(
                        x.data_ptr(), True, m, k, k, w.data.data_ptr(), w.kernel_type, n, 0,
                        outs[i].data_ptr(), True, n, args.threads, True,
                    )  # fmt: skip
                    times[i].append(time.process_time() - c)
            same = all(torch.equal(outs[0].view(torch.int16), o.view(torch.int16)) for o in outs)
            med = [statistics.median(v) for v in times]
            cells = "  ".join(
                f"{rev} {v * 1e3:8.3f} ms {2 * m * n * k / v / 1e9:4.0f} GOP/s"
                for rev, v in zip(args.revs, med)
            )
            print(f"M={m:3} {t:5} {name:8} {cells}  ratio {med[-1] / med[0]:.3f} same bits {same}")
            for i, v in enumerate(med):
                key = (m, "head" if name == "head" else t, i)
                steps[key] = steps.get(key, 0.0) + v * calls
    for (m, t, i), v in sorted(steps.items()):
        print(f"step M={m} {t} {args.revs[i]}: {v * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
