"""vLLM's environment variables that trillm does not read as settings: those whose being
ignored would change what a deployment gets without a word (``REFUSED``: ``trillm serve``
stops at start-up naming the variable, through ``envs.check_all``), and those that change
nothing here (``NO_EFFECT``, with the reason; set or not, trillm behaves the same).

The variables vLLM defines that trillm honours are declared in ``envs.py`` with vLLM's names.
Which variables are listed, and the test that each is read, refused or without effect:
``tests/support/field_coverage/vllm_fields.json``, ``tests/entrypoints/test_vllm_field_list.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs


def _set(text: str) -> bool:
    return text.strip() != ""


def _vllm_on(text: str) -> bool:
    # vLLM's reading of its switches: "1" or "true" (any case) is on.
    return text.strip().lower() in ("1", "true")


def _not(*defaults: str) -> Callable[[str], bool]:
    """Asks for something when set to other than one of vLLM's defaults (case-insensitive)."""
    return lambda text: text.strip().lower() not in (*defaults, "")


@attrs.frozen
class Refused:
    reason: str  # what the variable asks for that trillm does not do, and what to use
    asks: Callable[[str], bool]  # whether this value asks for it (vLLM's default does not)


REFUSED: dict[str, Refused] = {
    "VLLM_HOST_IP": Refused(
        "the ranks of a multi-node group meet at --master-addr (trillm serve --headless)", _set
    ),
    "VLLM_PORT": Refused(
        "trillm's ranks pick free ports; a multi-node group meets at --master-port", _set
    ),
    "VLLM_USE_MODELSCOPE": Refused(
        "models come from the Hugging Face Hub or a local path; ModelScope is not a source",
        _vllm_on,
    ),
    "VLLM_LOGGING_PREFIX": Refused(
        "log lines carry no prefix; a VLLM_LOGGING_CONFIG_PATH file sets their format", _set
    ),
    "VLLM_LOG_STATS_INTERVAL": Refused(
        "the stats line's interval is --log-stats-interval", _not("10", "10.0", "10.")
    ),
    "VLLM_DEBUG_LOG_API_SERVER_RESPONSE": Refused(
        "responses are not logged; --log-level debug logs every request", _vllm_on
    ),
    "VLLM_TRACE_FUNCTION": Refused("function-call tracing is not implemented", _not("0")),
    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": Refused(
        "the keep-alive timeout is --timeout-keep-alive", _not("5")
    ),
    "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": Refused(
        "trillm serve exits when the engine dies (--restart-on-engine-death restarts it)",
        _vllm_on,
    ),
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN": Refused(
        "--max-model-len is bounded by the model's own positions", _vllm_on
    ),
    "VLLM_CPU_KVCACHE_SPACE": Refused(
        "the KV cache on CPU is sized by --kv-cache-memory (e.g. 4GiB)", _not("0")
    ),
    "VLLM_PLUGINS": Refused("vLLM's plugins are not loaded", _set),
    "VLLM_MODEL_REDIRECT_PATH": Refused(
        "model names are not redirected; give the path as the model", _set
    ),
    "VLLM_SKIP_MODEL_NAME_VALIDATION": Refused(
        "a request's model must be one that is served (--served-model-name)", _vllm_on
    ),
    "VLLM_BATCH_INVARIANT": Refused(
        "batch-invariant kernels are not implemented (an output's last bits may depend on "
        "its batch)",
        _vllm_on,
    ),
    "VLLM_LORA_RESOLVER_CACHE_DIR": Refused(
        "LoRA resolver plugins are not supported; load adapters with --lora-modules or "
        "/v1/load_lora_adapter",
        _set,
    ),
}

_OTHER_ACCELERATOR = "a kernel library of vLLM's GPU builds; trillm's kernels are its own"
NO_EFFECT: dict[str, str] = {
    "VLLM_TARGET_DEVICE": "read when vLLM is built; trillm runs on CUDA when there is one, "
    "else on the CPU",
    "VLLM_CACHE_ROOT": "vLLM's own cache folder (compiled graphs, assets); trillm keeps none",
    "VLLM_CONFIG_ROOT": "vLLM's own configuration folder (usage-stats settings); trillm has none",
    "VLLM_NO_USAGE_STATS": "trillm sends no usage statistics, so there is nothing to turn off",
    "VLLM_DO_NOT_TRACK": "trillm sends no usage statistics, so there is nothing to turn off",
    "VLLM_USAGE_SOURCE": "a label of vLLM's usage statistics; trillm sends none",
    "VLLM_ENGINE_READY_TIMEOUT_S": "trillm waits for the engine's start without a deadline; "
    "a start that fails ends trillm serve with its error",
    "VLLM_WORKER_MULTIPROC_METHOD": "how vLLM starts its workers (fork or spawn); trillm's "
    "start (TRILLM_WORKER_START) changes no output",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "the engine core always runs in a process of its own "
    "here; where it runs changes no output",
    "VLLM_MEDIA_LOADING_THREAD_COUNT": "speed only: media are decoded on trio's worker threads",
    "VLLM_MAX_AUDIO_CLIP_FILESIZE_MB": "read by vLLM's transcription routes, which trillm does "
    "not serve (/v1/audio/* is 404)",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "trillm's processes exchange only their own message "
    "types, never pickled objects, so there is nothing to allow",
    "VLLM_DISABLE_COMPILE_CACHE": "trillm does not torch.compile the model, so there is no "
    "compile cache",
    "VLLM_USE_DEEP_GEMM": _OTHER_ACCELERATOR,
    "VLLM_USE_FLASHINFER_SAMPLER": _OTHER_ACCELERATOR,
    "VLLM_NCCL_SO_PATH": "trillm's ranks use torch's own NCCL (gloo on the CPU)",
    "VLLM_ROCM_USE_AITER": _OTHER_ACCELERATOR,
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "read by vLLM's NIXL KV connector only; --kv-transfer-config "
    "is refused here",
    "VLLM_NIXL_SIDE_CHANNEL_PORT": "read by vLLM's NIXL KV connector only; --kv-transfer-config "
    "is refused here",
}
