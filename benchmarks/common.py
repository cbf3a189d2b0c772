"""Shared helpers of the benchmark scripts in ``benchmarks/<group>/``.

- the benchmark model (a ~28M-parameter random Llama, fp32) and its parameter counts;
- the workload (mixed prompt and output lengths, token-id prompts);
- the fp32 matmul rate of this machine, measured at the model's GEMM shapes and at 2048^3;
- machine facts for the results files, a table printer, JSON output;
- a ``trillm serve`` subprocess that is up (``/health`` 200) when the ``with`` body starts.

A script run as ``python benchmarks/GROUP/x.py`` has its group folder on ``sys.path``, not
the repository root (and the editable install only maps ``trillm.kernels``), so each script
puts the root there before ``from benchmarks import common``; this module does it too, for
code that imports it some other way.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# The benchmark model: hidden 512, 8 layers, MLP 1408, 8 query heads / 4 KV heads of 64,
# vocab 4096 (the shipped tokenizer's). Every benchmark here uses it.
MODEL_SPEC: dict[str, Any] = dict(
    hidden_size=512,
    num_hidden_layers=8,
    intermediate_size=1408,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=4096,
    max_position_embeddings=1024,
)
MODEL_CACHE_DIR = Path(os.environ.get("TRILLM_BENCH_MODEL_DIR", "/tmp/trillm-bench-model"))

# Workload defaults (issue text): prompts 8-384 tokens, outputs 8-160 tokens.
PROMPT_LEN_RANGE = (8, 384)
OUTPUT_LEN_RANGE = (8, 160)
# Prompt token ids are drawn from [100, 4000): ordinary tokens of the shipped vocabulary.
PROMPT_ID_RANGE = (100, 4000)

# GEMM shapes (M x K x N) of the model: the MLP up/gate projection at several row counts.
GEMM_ROWS = (64, 256, 1024, 4096)
SQUARE_N = 2048


# ---------------------------------------------------------------- model


def build_bench_model(folder: Path | None = None) -> Path:
    """Write the benchmark model once (seeded, so every run gets the same weights)."""
    from trillm.testing.tiny_models import build_tiny_model

    folder = folder or MODEL_CACHE_DIR
    if (folder / "model.safetensors").is_file() and (folder / "config.json").is_file():
        config = json.loads((folder / "config.json").read_text())
        if all(config.get(k) == v for k, v in MODEL_SPEC.items()):
            return folder
    return build_tiny_model("llama", folder, **MODEL_SPEC)


@dataclass(frozen=True)
class ParamCounts:
    total: int
    embedding: int  # input embedding table (a lookup, no FLOPs)
    lm_head: int
    non_embedding: int  # everything but the two vocab tables

    @property
    def flop_params(self) -> int:
        """Parameters that cost 2 FLOPs per token: non-embedding + lm_head."""
        return self.non_embedding + self.lm_head


def param_counts(folder: Path) -> ParamCounts:
    """Exact counts, read from the checkpoint's tensors (no model built)."""
    from safetensors import safe_open

    sizes: dict[str, int] = {}
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
            shape = f.get_slice(name).get_shape()
            n = 1
            for d in shape:
                n *= d
            sizes[name] = n
    embedding = sizes.get("model.embed_tokens.weight", 0)
    lm_head = sizes.get("lm_head.weight", embedding)  # tied: the same table again
    total = sum(sizes.values())
    non_embedding = total - embedding - sizes.get("lm_head.weight", 0)
    return ParamCounts(total, embedding, lm_head, non_embedding)


# ---------------------------------------------------------------- workload


@dataclass(frozen=True)
class Job:
    prompt_ids: list[int]
    output_len: int


def make_workload(
    num_prompts: int,
    seed: int = 0,
    prompt_range: tuple[int, int] = PROMPT_LEN_RANGE,
    output_range: tuple[int, int] = OUTPUT_LEN_RANGE,
) -> list[Job]:
    """Uniform prompt and output lengths in the (inclusive) ranges, random token ids."""
    import numpy as np

    rng = np.random.default_rng(seed)
    in_lens = rng.integers(prompt_range[0], prompt_range[1] + 1, size=num_prompts)
    out_lens = rng.integers(output_range[0], output_range[1] + 1, size=num_prompts)
    return [
        Job(rng.integers(*PROMPT_ID_RANGE, size=int(n)).tolist(), int(m))
        for n, m in zip(in_lens, out_lens, strict=True)
    ]


# ---------------------------------------------------------------- machine


def set_threads(n: int) -> None:
    """Torch intra-op threads here, and (via the environment) in worker subprocesses. Called
    before torch is first imported, it also gives this process the OpenMP spin count of the
    engine's workers (``trillm.executor.worker_ipc.WORKER_GOMP_SPINCOUNT``), so in-process model
    timings match what a worker does."""
    if "torch" not in sys.modules:
        from trillm.executor.worker_ipc import WORKER_GOMP_SPINCOUNT

        os.environ.setdefault("GOMP_SPINCOUNT", WORKER_GOMP_SPINCOUNT)
    import torch

    os.environ["OMP_NUM_THREADS"] = str(n)
    os.environ["MKL_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)


def median_thread_ms(fn: Any, repeats: int) -> float:
    """Median thread CPU time of ``repeats`` calls of ``fn()``, in ms (other load on the machine
    barely moves it)."""
    import statistics

    times = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return statistics.median(times) * 1e3


def matmul_gflops(m: int, k: int, n: int, min_time_s: float = 0.3) -> float:
    """fp32 ``[m, k] @ [k, n]`` rate in GFLOP/s: best of 3 timed rounds of >= min_time_s."""
    import torch

    a, b = torch.randn(m, k), torch.randn(k, n)
    out = torch.empty(m, n)
    torch.matmul(a, b, out=out)
    flops = 2.0 * m * k * n
    reps = max(1, int(min_time_s * 20e9 / flops))  # assume ~20 GFLOP/s for the first guess
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b, out=out)
        elapsed = time.perf_counter() - start
        best = max(best, flops * reps / elapsed / 1e9)
        reps = max(1, int(min_time_s * best * 1e9 / flops))
    return best


def matmul_rates(hidden: int = 512, intermediate: int = 1408) -> dict[str, float]:
    """GFLOP/s at the model's MLP GEMM (rows x hidden x intermediate) and at SQUARE_N^3."""
    rates = {
        f"{m}x{hidden}x{intermediate}": matmul_gflops(m, hidden, intermediate) for m in GEMM_ROWS
    }
    rates[f"{SQUARE_N}^3"] = matmul_gflops(SQUARE_N, SQUARE_N, SQUARE_N)
    return rates


def machine_info() -> dict[str, Any]:
    import torch

    model_name = platform.processor() or "unknown"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model_name = line.split(":", 1)[1].strip()
    return dict(
        date_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        cpu=model_name,
        cpus=os.cpu_count(),
        load_avg_1m=os.getloadavg()[0],
        torch=torch.__version__,
        torch_threads=torch.get_num_threads(),
        python=platform.python_version(),
    )


# ---------------------------------------------------------------- output


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> None:
    """``columns``: (key, format spec) pairs; the key is the header."""
    cells = [[format(r[k], f) if r.get(k) is not None else "-" for k, f in columns] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, (k, _) in enumerate(columns)]
    print("  ".join(k.rjust(w) for (k, _), w in zip(columns, widths, strict=True)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths, strict=True)))


def write_json(path: Path | None, result: dict[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {path}")


# ---------------------------------------------------------------- offline sizes (TP / PP / DP)


def add_offline_args(p: Any) -> None:
    """The options of a benchmark that times one ``LLM`` per parallel size on a fixed-length
    workload, each size in a fresh child process (``benchmarks/parallel/tensor_parallel.py``,
    ``data_parallel.py``); ``p``: an argparse parser."""
    import argparse

    p.add_argument("--model", default=None, help="model folder (default: the bench model)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)


def run_offline(
    args: Any, kv_cache_memory: str, probe: Any = None, **llm_kwargs: Any
) -> dict[str, Any]:
    """In a child: one LLM (``llm_kwargs``: its parallel sizes) on the workload (greedy,
    ``ignore_eos``, fixed lengths, distinct prompts, prefix caching off), after a one-request
    warm-up. -> seconds, output tokens and, with ``probe`` (llm -> value), its value before
    and after the timed run."""
    from trillm import LLM, SamplingParams

    jobs = make_workload(
        args.num_prompts, 0, (args.prompt_len, args.prompt_len), (args.output_len,) * 2
    )
    prompts = [{"prompt_token_ids": j.prompt_ids} for j in jobs]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        kv_cache_memory=kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=False,
        **llm_kwargs,
    )
    with llm:
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        before = probe(llm) if probe is not None else None
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        after = probe(llm) if probe is not None else None
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": seconds, "output_tokens": tokens, "probe": [before, after]}


def run_offline_child(
    script: str, args: Any, extra: Sequence[str], label: str
) -> tuple[dict[str, Any], str]:
    """Run ``script`` as a child (``extra``: its size options) with the workload options of
    ``args``: -> (the JSON of its last stdout line, its stderr)."""
    argv = [
        sys.executable,
        script,
        *extra,
        "--model",
        args.model,
        "--num-prompts",
        str(args.num_prompts),
        "--prompt-len",
        str(args.prompt_len),
        "--output-len",
        str(args.output_len),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{label} run failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def run_rounds(rounds: int, sizes: Sequence[Any], measure: Any) -> list[dict[str, Any]]:
    """``measure(size)`` for each size, the sizes alternating within each round; each row
    printed as it comes (a JSON line) and returned."""
    rows = []
    for round_ in range(rounds):
        for size in sizes:
            row = {"round": round_, **measure(size), "load_1m": os.getloadavg()[0]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


# ---------------------------------------------------------------- server subprocess


class ServerStartError(RuntimeError):
    """``trillm serve`` exited, or did not answer /health in time."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def trillm_server(
    model: str,
    args: Sequence[str],
    port: int | None = None,
    timeout_s: float = 300.0,
    log_path: Path | None = None,
) -> Iterator[tuple[str, subprocess.Popen]]:
    """``python -m trillm serve model --port P *args``; yields (base_url, process)."""
    port = port or free_port()
    cmd = [
        sys.executable,
        "-m",
        "trillm",
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        *args,
    ]
    log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while not _healthy(url):
            if proc.poll() is not None:
                raise ServerStartError(f"trillm serve exited with {proc.returncode}: {cmd}")
            if time.monotonic() > deadline:
                raise ServerStartError(f"trillm serve not healthy after {timeout_s}s: {cmd}")
            time.sleep(0.5)
        yield url, proc
    finally:
        _stop(proc)
        if log_path:
            log.close()  # type: ignore[union-attr]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_bench_serve(
    base_url: str, args: Sequence[str], result_file: Path, timeout_s: float = 1200
) -> dict[str, Any]:
    """``python -m trillm.bench serve --base-url URL *args``; returns its saved JSON record."""
    cmd = [
        sys.executable,
        "-m",
        "trillm.bench",
        "serve",
        "--base-url",
        base_url,
        "--disable-tqdm",
        "--result-dir",
        str(result_file.parent),
        "--result-filename",
        result_file.name,
        *args,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    print("$", " ".join(cmd[1:]), flush=True)
    proc = subprocess.run(
        cmd, cwd=REPO_ROOT, env=env, timeout=timeout_s, text=True, capture_output=True
    )
    print(proc.stdout[-3000:])
    if proc.returncode != 0:
        raise RuntimeError(f"trillm bench serve failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(result_file.read_text())
