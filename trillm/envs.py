"""Every environment variable trillm reads, with its type and meaning: the one place that
reads them (``tests/repo/test_envs.py`` checks that no other module does, and that
``docs/environment.md`` lists each).

A variable vLLM defines keeps vLLM's name and meaning; trillm's own start with ``TRILLM_``.
Where both exist (logging), ``TRILLM_<name>`` wins over ``VLLM_<name>``. A value that is not
one the variable takes is a ``ValueError`` naming the variable, raised where it is read, so
nothing set is silently ignored.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Generic, Literal, TypeVar

import attrs

from trillm import vllm_env

T = TypeVar("T")
# VLLM_CPU_OMP_THREADS_BIND's value: "auto", "nobind", or each rank's core ids in its order
CpuBinding = Literal["auto", "nobind"] | tuple[tuple[int, ...], ...]


@attrs.frozen
class EnvVar(Generic[T]):
    names: tuple[str, ...]  # read in this order; the first one set counts
    meaning: str
    parse: Callable[[str, str], T]  # (name, text) -> value, or a ValueError naming it
    default: T  # when none is set

    @property
    def name(self) -> str:
        return self.names[0]

    def get(self) -> T:
        for name in self.names:
            text = os.environ.get(name)
            if text is not None:
                return self.parse(name, text)
        return self.default


def _text_or_none(name: str, text: str) -> str | None:
    return text or None


def _positive_int(name: str, text: str) -> int | None:
    text = text.strip()
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{name} must be a whole number > 0; got {text!r}.")
    return int(text)


def _seconds(name: str, text: str) -> int:
    value = _positive_int(name, text)
    assert value is not None
    return value


def _switch(name: str, text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("", "0", "false", "no"):
        return False
    raise ValueError(f"{name} must be 1 / true / yes or 0 / false / no; got {text!r}.")


def _vllm_true(name: str, text: str) -> bool:
    # vLLM's reading of its boolean variables: "1" or "true" (any case) is on, anything else off.
    return text.strip().lower() in ("1", "true")


def _not_zero(name: str, text: str) -> bool:
    return text.strip() != "0"


def _log_level(name: str, text: str) -> str:
    level = text.strip().upper()  # vLLM upper-cases the name
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError(f"{name}={text!r}: expected DEBUG, INFO, WARNING, ERROR or CRITICAL.")
    return level


def _non_negative_int(name: str, text: str) -> int | None:
    text = text.strip()
    if not text.isdigit():
        raise ValueError(f"{name} must be a whole number >= 0; got {text!r}.")
    return int(text)


def _core_range(name: str, item: str) -> range:
    low, dash, high = item.strip().partition("-")
    if not low.isdigit() or (dash and not high.isdigit()) or int(high or low) < int(low):
        raise ValueError(f"{name}: {item!r} is not a core id or a range like 0-3.")
    return range(int(low), int(high or low) + 1)


def _cpu_binding(name: str, text: str) -> CpuBinding | None:
    """vLLM's values: auto, nobind, or each rank's cores ("0-31|32-63", "0,2|1,3"); empty: unset."""
    text = text.strip()
    if not text:
        return None
    if text == "auto":
        return "auto"
    if text == "nobind":
        return "nobind"
    ranks = []
    for part in text.split("|"):
        cores = [core for item in part.split(",") for core in _core_range(name, item)]
        if len(set(cores)) != len(cores):
            raise ValueError(f"{name}: {part!r} names a core twice.")
        ranks.append(tuple(cores))
    return tuple(ranks)


def _worker_start(name: str, text: str) -> str:
    mode = text.strip() or "zygote"
    if mode not in ("zygote", "spawn"):
        raise ValueError(f"{name}={mode!r}: expected one of zygote, spawn.")
    return mode


API_KEY = EnvVar(
    ("VLLM_API_KEY",),
    "The API key when --api-key is not given (vLLM's): every route but /health, /ping, "
    "/version and /metrics then needs 'Authorization: Bearer KEY'. Empty: no key.",
    _text_or_none,
    None,
)
XGRAMMAR_CACHE_MB = EnvVar(
    ("VLLM_XGRAMMAR_CACHE_MB",),
    "MiB of compiled grammars kept when --structured-outputs-cache-bytes is not given "
    "(vLLM's; default 512).",
    _positive_int,
    None,
)
ALLOW_RUNTIME_LORA_UPDATING = EnvVar(
    ("VLLM_ALLOW_RUNTIME_LORA_UPDATING",),
    "1 / true: the /v1/load_lora_adapter and /v1/unload_lora_adapter routes (vLLM's; as "
    "--allow-runtime-lora-updating). Any other value: off, as in vLLM.",
    _vllm_true,
    False,
)
SERVER_DEV_MODE = EnvVar(
    ("VLLM_SERVER_DEV_MODE",),
    "1 / true: the development routes (vLLM's): /sleep, /wake_up, /is_sleeping, "
    "/reset_prefix_cache, /pause, /resume, /is_paused, /collective_rpc. Any other value: "
    "off, as in vLLM (the routes are 404).",
    _vllm_true,
    False,
)
ENABLE_RESPONSES_API_STORE = EnvVar(
    ("VLLM_ENABLE_RESPONSES_API_STORE",),
    "1 / true: /v1/responses keeps each response asked with 'store' (the default) for GET "
    "/v1/responses/{id} and 'previous_response_id' (vLLM's), at most 4096 responses and "
    "256 MiB, the least recently used dropped first. Any other value: off, as in vLLM "
    "('store' ignored).",
    _vllm_true,
    False,
)
CONFIGURE_LOGGING = EnvVar(
    ("TRILLM_CONFIGURE_LOGGING", "VLLM_CONFIGURE_LOGGING"),
    "0: trillm serve leaves the root logger to the embedding application.",
    _not_zero,
    True,
)
LOGGING_LEVEL = EnvVar(
    ("VLLM_LOGGING_LEVEL",),
    "The level of trillm's own loggers (vLLM's: DEBUG, INFO, WARNING, ERROR or CRITICAL); "
    "--log-level keeps setting the root logger's (the HTTP server's). Not applied when a "
    "logging configuration file is given.",
    _log_level,
    None,
)
LOGGING_CONFIG_PATH = EnvVar(
    ("TRILLM_LOGGING_CONFIG_PATH", "VLLM_LOGGING_CONFIG_PATH"),
    "A logging.config.dictConfig JSON file for trillm serve's logging.",
    _text_or_none,
    None,
)
NO_EXTENSIONS = EnvVar(
    ("TRILLM_NO_EXTENSIONS",),
    "1 / true / yes: use the pure-Python twins and torch references instead of the native "
    "extensions (scheduler, KV blocks, detokenizer, CPU kernels).",
    _switch,
    False,
)
WORKER_START = EnvVar(
    ("TRILLM_WORKER_START",),
    "How the ranks of a multi-rank engine start: zygote (forked from one process that "
    "imported torch once; the default) or spawn (a process of its own each).",
    _worker_start,
    "zygote",
)
RANK_ZYGOTE = EnvVar(
    ("TRILLM_RANK_ZYGOTE",),
    "The Unix socket of a rank zygote server already running (python -m "
    "trillm.executor.rank_server) that this process started: engines fork their ranks from "
    "it, one rank included, instead of starting a zygote each (unset: a zygote per multi-rank "
    "start, a process of its own for one rank).",
    _text_or_none,
    None,
)
PP_MICRO_BATCHES = EnvVar(
    ("TRILLM_PP_MICRO_BATCHES",),
    "Steps in flight with pipeline parallelism, 1 .. pipeline_parallel_size (default: one "
    "per stage); 1 keeps one, for comparisons.",
    _positive_int,
    None,
)
CPU_OMP_THREADS_BIND = EnvVar(
    ("VLLM_CPU_OMP_THREADS_BIND",),
    "The cores of each rank's threads (vLLM's): auto (the usable cores split between this "
    "node's ranks), nobind (not pinned; OMP_NUM_THREADS or an equal share), or one list per "
    "rank such as 0-31|32-63. Unset: nobind, or auto when VLLM_CPU_NUM_OF_RESERVED_CPU is set.",
    _cpu_binding,
    None,
)
CPU_NUM_OF_RESERVED_CPU = EnvVar(
    ("VLLM_CPU_NUM_OF_RESERVED_CPU",),
    "Cores auto binding leaves to the API server and engine core (vLLM's; default 1 when "
    "several ranks share the node, else 0).",
    _non_negative_int,
    None,
)
CPU_ATTENTION_THREADS = EnvVar(
    ("TRILLM_CPU_ATTENTION_THREADS",),
    "Threads of the native CPU attention kernel (default: torch's intra-op threads).",
    _positive_int,
    None,
)
IMAGE_FETCH_TIMEOUT = EnvVar(
    ("VLLM_IMAGE_FETCH_TIMEOUT",),
    "Seconds an http(s) image URL of a chat may take to fetch, redirects included (vLLM's; "
    "default 5); past it the request is answered 400.",
    _seconds,
    5,
)
VIDEO_FETCH_TIMEOUT = EnvVar(
    ("VLLM_VIDEO_FETCH_TIMEOUT",),
    "Seconds an http(s) video URL may take to fetch, redirects included (vLLM's; default 30); "
    "past it the request is answered 400.",
    _seconds,
    30,
)
AUDIO_FETCH_TIMEOUT = EnvVar(
    ("VLLM_AUDIO_FETCH_TIMEOUT",),
    "Seconds an http(s) audio URL may take to fetch, redirects included (vLLM's; default 10); "
    "past it the request is answered 400.",
    _seconds,
    10,
)

RAY_ADDRESS = EnvVar(
    ("RAY_ADDRESS",),
    "The Ray cluster distributed_executor_backend='ray' joins (Ray's own variable, which "
    "ray.init reads); unset: a cluster `ray start --head` runs on this machine, else a local "
    "one the engine starts and stops.",
    _text_or_none,
    None,
)
OTLP_TRACES_PROTOCOL = EnvVar(
    ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",),
    "How --otlp-traces-endpoint's spans are sent (OpenTelemetry's variable, read as vLLM reads "
    "it): grpc or http/protobuf; unset: grpc, or http/protobuf for a URL ending in /v1/traces. "
    "Checked only when tracing is on.",
    _text_or_none,
    None,
)

ALL: tuple[EnvVar[Any], ...] = (
    API_KEY,
    XGRAMMAR_CACHE_MB,
    ALLOW_RUNTIME_LORA_UPDATING,
    SERVER_DEV_MODE,
    ENABLE_RESPONSES_API_STORE,
    CONFIGURE_LOGGING,
    LOGGING_LEVEL,
    LOGGING_CONFIG_PATH,
    NO_EXTENSIONS,
    WORKER_START,
    RANK_ZYGOTE,
    PP_MICRO_BATCHES,
    CPU_OMP_THREADS_BIND,
    CPU_NUM_OF_RESERVED_CPU,
    CPU_ATTENTION_THREADS,
    IMAGE_FETCH_TIMEOUT,
    VIDEO_FETCH_TIMEOUT,
    AUDIO_FETCH_TIMEOUT,
    RAY_ADDRESS,
    OTLP_TRACES_PROTOCOL,
)


def check_all() -> None:
    """Read every variable once: a value none of them takes is a ValueError now, at start-up,
    not when the feature is first used; so is a vLLM variable trillm cannot honour."""
    for var in ALL:
        var.get()
    check_vllm_variables()


def check_vllm_variables() -> None:
    """A ValueError naming the first variable of ``vllm_env.REFUSED`` set to a value that asks
    for what trillm does not do (vLLM's default asks nothing and passes)."""
    for name, refused in vllm_env.REFUSED.items():
        text = os.environ.get(name)
        if text is not None and refused.asks(text):
            raise ValueError(
                f"{name}={text!r} is not supported: {refused.reason}. Unset {name} to start."
            )
