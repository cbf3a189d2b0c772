"""``trillm collect-env``: what a bug report needs to know about this machine (vLLM's
``collect-env``): versions, the CPU's vector extensions, GPUs, the native extensions, and the
environment variables that change trillm's behaviour (secrets masked)."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import sys
from typing import Any

PACKAGES = (
    "trillm",
    "torch",
    "transformers",
    "tokenizers",
    "triton",
    "flashinfer-python",
    "xgrammar",
    "trio",
    "hypercorn",
    "quart-trio",
    "numpy",
    "safetensors",
    "gguf",
)
# The CPU features the native kernels choose their paths by.
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
ENV_PREFIXES = ("TRILLM_", "VLLM_", "OMP_", "GOMP_", "KMP_", "MKL_", "CUDA_", "TRITON_", "HF_")
SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD", re.IGNORECASE)


def add_collect_env_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "collect-env",
        help="Print this machine's versions, CPU, GPUs and trillm settings (for bug reports).",
        description="Print what a bug report needs: versions, CPU features, GPUs, native "
        "extensions and the environment variables that change trillm's behaviour.",
    )
    p.set_defaults(func=run_collect_env)


def collect() -> list[tuple[str, str]]:
    rows = [
        ("OS", platform.platform()),
        ("Python", sys.version.split()[0]),
        ("CPU", _cpu_model()),
        ("CPU cores usable", str(len(os.sched_getaffinity(0)))),
        ("CPU features", " ".join(f for f in CPU_FLAGS if f in _cpu_flags()) or "none of note"),
    ]
    for name in PACKAGES:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = "not installed"
        rows.append((name, version))
    rows.extend(_torch_rows())
    rows.append(("CPU threads binding", _cpu_binding()))
    rows.append(("native extensions", _extensions()))
    rows.append(("GPUs (nvidia-smi)", _nvidia_smi()))
    for key, value in sorted(os.environ.items()):  # a listing, not a setting (trillm/envs.py)
        if key.startswith(ENV_PREFIXES):
            rows.append((f"env {key}", "***" if SECRET.search(key) else value))
    return rows


def _cpu_info() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return f.read()
    except OSError:
        return ""


def _cpu_model() -> str:
    match = re.search(r"^model name\s*:\s*(.+)$", _cpu_info(), re.MULTILINE)
    return match.group(1).strip() if match else platform.processor() or "unknown"


def _cpu_flags() -> set[str]:
    match = re.search(r"^flags\s*:\s*(.+)$", _cpu_info(), re.MULTILINE)
    return set(match.group(1).split()) if match else set()


def _torch_rows() -> list[tuple[str, str]]:
    try:
        import torch
    except ImportError:
        return []
    cuda = torch.cuda.is_available()
    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return [
        ("torch CUDA", f"{torch.version.cuda} (available: {cuda})"),
        ("torch devices", ", ".join(devices) or "cpu only"),
        ("torch threads", str(torch.get_num_threads())),
    ]


def _cpu_binding() -> str:
    from trillm.distributed.cpu_binding import summary

    return summary()


def _extensions() -> str:
    from trillm._native import extensions_disabled, native_module

    names = ("scheduler", "kv_cache_manager", "detokenizer", "cpu_kernels")
    built = [n for n in names if native_module(n) is not None]
    state = "disabled by TRILLM_NO_EXTENSIONS" if extensions_disabled() else "enabled"
    return f"{', '.join(built) or 'none built'} ({state})"


def _nvidia_smi() -> str:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "none (nvidia-smi not found)"
    query = "--query-gpu=name,driver_version,memory.total"
    try:
        out = subprocess.run(
            [exe, query, "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi failed: {exc}"
    return "; ".join(line.strip() for line in out.stdout.splitlines() if line.strip()) or (
        out.stderr.strip() or "none"
    )


def run_collect_env(args: argparse.Namespace) -> int:
    rows = collect()
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0
