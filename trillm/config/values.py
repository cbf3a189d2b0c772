"""The values of engine arguments: their Literal types, sizes and defaults, the checks they
share, and how a field is spelled as a flag (``flag`` / ``not_a_flag``)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, get_args

# The values of EngineArgs' enumerated fields, each spelled once: the tuples the checks use
# are derived from these (``get_args``).
Device = Literal["auto", "cpu", "cuda"]
AttentionBackendName = Literal["torch", "triton", "flashinfer", "eager"]
LoadFormat = Literal["auto", "safetensors", "gguf", "dummy"]  # vLLM's names trillm reads
KVCacheDtype = Literal["auto", "bfloat16", "fp8", "fp8_e4m3"]
Convert = Literal["auto", "none", "embed", "classify"]
Numerics = Literal["fast", "transformers"]


DEVICES: tuple[str, ...] = get_args(Device)
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackendName)
LOAD_FORMATS: tuple[str, ...] = get_args(LoadFormat)


DEFAULT_KV_CACHE_MEMORY = 1 << 30  # CPU: 1 GiB unless --kv-cache-memory says otherwise


# Compiled grammars kept for reuse: vLLM's xgrammar cache default (VLLM_XGRAMMAR_CACHE_MB=512).
DEFAULT_GRAMMAR_CACHE_BYTES = 512 << 20


GRAMMAR_CACHE_ENV = "VLLM_XGRAMMAR_CACHE_MB"  # (trillm/envs.py reads it)


def parse_memory_size(value: str | int | float) -> int:
    """'2GiB', '512MB', '1e9' or a byte count -> bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?)(i?)B?\s*", value, re.IGNORECASE)
    if not m:
        raise ValueError(f"Cannot parse memory size {value!r}; use e.g. 2GiB, 512MiB or bytes.")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    base = 1024 if binary or unit == "" else 1000
    power = " KMGT".index(unit) if unit else 0
    return int(number * base**power)


# How an EngineArgs field is spelled on the command line: ``trillm serve`` and ``trillm bench
# latency|throughput`` add one flag per field from this (trillm/entrypoints/cli/engine_flags.py),
# its type from the annotation (int, float, str, bool: --x/--no-x, a Literal: its choices)
# unless ``value`` names one of the parsers in flag_types.py.
FlagValue = Literal[
    "positive_int",
    "non_negative_int",
    "positive_seconds",
    "memory_size",
    "grammar_cache_bytes",
    "json_object",
    "quantization",
    "kv_cache_dtype",
    "load_format",
    "speculative_config",
    "limit_mm_per_prompt",
    "host",
    "class_name",
]


@dataclass(frozen=True)
class Flag:
    help: str
    aliases: tuple[str, ...] = ()  # short spellings, e.g. "-tp"
    value: FlagValue | None = None  # None: the annotation's type
    metavar: str | None = None
    several: bool = False  # nargs="+"; the field takes the first (served_model_name)


T = TypeVar("T")


def flag(default: T, help: str, **spec: Any) -> T:
    """An EngineArgs field that is an engine flag (``--`` + its name, dashed)."""
    return field(default=default, metadata={"flag": Flag(help, **spec)})


def not_a_flag(default: T, why: str) -> T:
    """An EngineArgs field that no engine flag sets, and why."""
    return field(default=default, metadata={"not_a_flag": why})


KV_CACHE_DTYPES: tuple[str, ...] = get_args(KVCacheDtype)
NUMERICS: tuple[str, ...] = get_args(Numerics)


def check_numerics(name: object) -> str:
    """``name`` if it is one of ``NUMERICS``, else a ValueError naming it."""
    if name not in NUMERICS:
        raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}; got {name!r}.")
    return str(name)


def grammar_cache_bytes_from_env() -> int:
    """vLLM's ``VLLM_XGRAMMAR_CACHE_MB`` (a positive whole number of MiB), else 512 MiB; a
    value that is not such a number is a ValueError naming the variable."""
    from trillm import envs

    mib = envs.XGRAMMAR_CACHE_MB.get()
    return DEFAULT_GRAMMAR_CACHE_BYTES if mib is None else mib << 20


def check_grammar_cache_bytes(value: object) -> int:
    """A positive byte count (or a size such as "512MiB"), else a ValueError naming it."""
    try:
        size = parse_memory_size(value) if isinstance(value, str | int | float) else 0
    except (ValueError, OverflowError):
        size = 0
    if isinstance(value, bool) or size < 1:
        raise ValueError(
            "structured_outputs_cache_bytes must be a size > 0 such as 512MiB or a byte "
            f"count; got {value!r}."
        )
    return size


def check_kv_cache_dtype(name: str) -> str:
    """``name`` if trillm stores a KV cache in it, else a ValueError naming it."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype {name!r} is not implemented yet; choose one of "
            f"{', '.join(KV_CACHE_DTYPES)}."
        )
    return name


CONVERTS: tuple[str, ...] = get_args(Convert)
