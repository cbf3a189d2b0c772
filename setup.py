"""Build script for trillm's native extensions (ext/).

The Python package metadata lives in pyproject.toml; this file only declares the native
extensions (Cython and pybind11 C++) and the packages. The repository's top-level ``kernels/``
folder is the package ``trillm.kernels``: ``trillm/kernels`` is a link to it, and it has no
``__init__.py`` (a namespace package), so the folder, on sys.path when Python starts in the
checkout's root, never shadows the PyPI package ``kernels`` that transformers probes for.
Installed, editable or not, it is found through the link (setuptools' editable finder cannot
map a namespace package below a regular one to another folder).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from Cython.Build import cythonize
from pybind11.setup_helpers import ParallelCompile, Pybind11Extension
from setuptools import Extension, find_namespace_packages, setup

# The sources of one extension compile side by side, one per core (cpu_kernels has ten C++
# files; serially they were most of a fresh `pip install`); TRILLM_BUILD_JOBS=N caps it.
ParallelCompile("TRILLM_BUILD_JOBS", default=0).install()

CXX_FLAGS = ["-O3", "-std=c++17"]


def stage_declarations(include_dir: str) -> list[str]:
    """Copies each ext/<name>.pxd to <include_dir>/trillm/_ext/<name>.pxd; returns the copied.

    Cython looks a module's .pxd up by its qualified name only (trillm/_ext/<name>.pxd on the
    include path), for the module's own declarations and for a cimport alike; it never looks
    beside a .pyx whose path is not its module name (ext/<name>.pyx builds trillm._ext.<name>).
    The declarations live beside their .pyx and are staged at that name for the compile.
    """
    package = Path(include_dir, "trillm", "_ext")
    package.mkdir(parents=True)
    pxds = sorted(Path("ext").glob("*.pxd"))
    for pxd in pxds:
        # copy2 keeps the mtime: cythonize regenerates a .cpp when a .pxd is newer than it
        shutil.copy2(pxd, package / pxd.name)
    return [str(pxd) for pxd in pxds]


def cython_extensions() -> list[Extension]:
    # ext/<name>.pyx -> trillm._ext.<name>. The KV manager's types are declared in
    # ext/kv_cache_manager.pxd: compiled once, in trillm._ext.kv_cache_manager; the scheduler
    # cimports them as trillm._ext.kv_cache_manager, and its parts (request_queues, step_plan,
    # step_outputs) as trillm._ext.<part>, each declared in its ext/<part>.pxd.
    modules = ["kv_cache_manager", "request_queues", "step_plan", "step_outputs", "scheduler"]
    with tempfile.TemporaryDirectory() as include_dir:
        pxds = stage_declarations(include_dir)
        exts = [
            Extension(
                f"trillm._ext.{name}",
                [f"ext/{name}.pyx"],
                # cythonize swaps the .pyx for its .cpp in the sources: named here, the .pyx
                # and the .pxd files go into the sdist (a wheel built from it compiles them)
                depends=[f"ext/{name}.pyx", *pxds],
                language="c++",
                extra_compile_args=CXX_FLAGS,
            )
            for name in modules
        ]
        return cythonize(
            exts,
            compiler_directives={
                "language_level": "3",
                "boundscheck": False,
                "wraparound": False,
                "initializedcheck": False,
            },
            include_path=[include_dir],
            quiet=True,
        )


def pybind_extensions() -> list[Extension]:
    return [
        Pybind11Extension(
            "trillm._ext.detokenizer",
            ["ext/detokenizer.cpp"],
            cxx_std=17,
            extra_compile_args=["-O3"],
        ),
        Pybind11Extension(
            "trillm._ext.cpu_kernels",
            [
                "ext/cpu_kernels.cpp",
                "ext/cpu_attention.cpp",
                "ext/cpu_prefill_attention.cpp",
                "ext/cpu_gemm.cpp",
                "ext/cpu_gemm_bf16.cpp",
                "ext/cpu_gemm_fp16.cpp",
                "ext/cpu_gemm_fp8.cpp",
                "ext/cpu_gemm_q.cpp",
                "ext/cpu_ops.cpp",
                "ext/cpu_lora.cpp",
                "ext/cpu_program.cpp",
            ],
            depends=[
                "ext/cpu_common.h",
                "ext/cpu_attention_bf16.h",
                "ext/cpu_attention_tile.h",
                "ext/cpu_prefill_attention_dp.h",
                "ext/cpu_attention_paged_dp.h",
                "ext/cpu_attention_paged_avx2.h",
                "ext/cpu_attention_avx2_tiles.h",
                "ext/cpu_attention_dp_tiles.h",
                "ext/cpu_bf16_pair_pack.h",
                "ext/cpu_attention_decode.h",
                "ext/cpu_attention_decode_dp.h",
                "ext/cpu_attention_decode_dp_slots.h",
                "ext/cpu_attention_key_splits.h",
                "ext/cpu_attention_kernel_choice.h",
                "ext/cpu_bf16_tiles.h",
                "ext/cpu_gemm_q_params.h",
                "ext/cpu_gemm_q_vnni.h",
                "ext/cpu_gemm_q_vnni_prefill.h",
                "ext/cpu_gemm_q_bf16.h",
                "ext/cpu_gemm_q_avx2.h",
                "ext/cpu_gemm_q_q6.h",
                "ext/cpu_program.h",
                "ext/cpu_ops_avx512.h",
            ],
            cxx_std=17,
            extra_compile_args=["-O3", "-pthread", "-Wno-psabi"],
            extra_link_args=["-pthread"],
        ),
    ]


setup(
    # namespace packages too: trillm.kernels (trillm/kernels -> kernels/) has no __init__.py
    packages=find_namespace_packages(include=["trillm", "trillm.*"]),
    ext_modules=cython_extensions() + pybind_extensions(),
    # and the extensions themselves build side by side
    options={"build_ext": {"parallel": os.cpu_count() or 1}},
)
