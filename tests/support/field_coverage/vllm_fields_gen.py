"""Writes ``vllm_fields.json``: every request field of vLLM's OpenAI-compatible protocol, per
endpoint, and the ``VLLM_*`` variables a deployment commonly sets, read from vLLM's source.

The test of honour-or-refuse against vLLM's own list (tests/entrypoints/test_vllm_field_list.py)
reads the JSON, so CI needs no network. To refresh it::

    pip download vllm==X --no-deps --only-binary :all: -d /tmp/w
    unzip -q /tmp/w/vllm-X-*.whl 'vllm/*' 'vllm-X.dist-info/*' -d /tmp/w/src
    python tests/support/field_coverage/vllm_fields_gen.py /tmp/w/src /tmp/w/vllm-X-*.whl

The request models are pydantic classes; they are read with ``ast`` (vLLM is not imported):
each class's annotated fields, its bases' fields first (inheritance resolved across the files
read), and a type alias that is a union of request classes (vLLM's ``EmbeddingRequest``) gives
the union of their fields. A field's default is kept when it is a literal (``None``, ``[]``,
``"tensors"``), else its source text.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sys
from pathlib import Path

OUT = Path(__file__).with_name("vllm_fields.json")
EP = "vllm/entrypoints/"
FILES = (
    EP + "serve/engine/protocol.py",
    EP + "generate/base/protocol.py",
    EP + "openai/chat_completion/protocol.py",
    EP + "openai/completion/protocol.py",
    EP + "openai/responses/protocol.py",
    EP + "pooling/base/protocol.py",
    EP + "pooling/embed/protocol.py",
    EP + "pooling/pooling/protocol.py",
    EP + "pooling/scoring/protocol.py",
    EP + "serve/tokenize/protocol.py",
    EP + "anthropic/protocol.py",
)
# endpoint -> (vLLM's route, the request class or union alias that route parses)
ENDPOINTS = {
    "chat": ("/v1/chat/completions", "ChatCompletionRequest"),
    "completions": ("/v1/completions", "CompletionRequest"),
    "responses": ("/v1/responses", "ResponsesRequest"),
    "embeddings": ("/v1/embeddings", "EmbeddingRequest"),
    "pooling": ("/pooling", "PoolingRequest"),
    "score": ("/score", "ScoreRequest"),
    "rerank": ("/rerank", "RerankRequest"),
    "tokenize": ("/tokenize", "TokenizeRequest"),
    "detokenize": ("/detokenize", "DetokenizeRequest"),
    "messages": ("/v1/messages", "AnthropicMessagesRequest"),
    "count_tokens": ("/v1/messages/count_tokens", "AnthropicCountTokensRequest"),
}
# The VLLM_* variables a deployment commonly sets: those vLLM's deployment, CPU, logging,
# multimodal and security docs tell users to set (vLLM's envs.py declares ~320, most of them
# kernel switches for one accelerator).
COMMON_ENV = (
    "VLLM_API_KEY",
    "VLLM_HOST_IP",
    "VLLM_PORT",
    "VLLM_USE_MODELSCOPE",
    "VLLM_TARGET_DEVICE",
    "VLLM_CACHE_ROOT",
    "VLLM_CONFIG_ROOT",
    "VLLM_NO_USAGE_STATS",
    "VLLM_DO_NOT_TRACK",
    "VLLM_USAGE_SOURCE",
    "VLLM_CONFIGURE_LOGGING",
    "VLLM_LOGGING_CONFIG_PATH",
    "VLLM_LOGGING_LEVEL",
    "VLLM_LOGGING_PREFIX",
    "VLLM_LOG_STATS_INTERVAL",
    "VLLM_DEBUG_LOG_API_SERVER_RESPONSE",
    "VLLM_TRACE_FUNCTION",
    "VLLM_ENGINE_READY_TIMEOUT_S",
    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE",
    "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH",
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN",
    "VLLM_WORKER_MULTIPROC_METHOD",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_NUM_OF_RESERVED_CPU",
    "VLLM_IMAGE_FETCH_TIMEOUT",
    "VLLM_VIDEO_FETCH_TIMEOUT",
    "VLLM_AUDIO_FETCH_TIMEOUT",
    "VLLM_MEDIA_LOADING_THREAD_COUNT",
    "VLLM_MAX_AUDIO_CLIP_FILESIZE_MB",
    "VLLM_XGRAMMAR_CACHE_MB",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    "VLLM_SERVER_DEV_MODE",
    "VLLM_ALLOW_INSECURE_SERIALIZATION",
    "VLLM_PLUGINS",
    "VLLM_MODEL_REDIRECT_PATH",
    "VLLM_SKIP_MODEL_NAME_VALIDATION",
    "VLLM_ENABLE_RESPONSES_API_STORE",
    "VLLM_BATCH_INVARIANT",
    "VLLM_LORA_RESOLVER_CACHE_DIR",
    "VLLM_DISABLE_COMPILE_CACHE",
    "VLLM_USE_DEEP_GEMM",
    "VLLM_USE_FLASHINFER_SAMPLER",
    "VLLM_NCCL_SO_PATH",
    "VLLM_NIXL_SIDE_CHANNEL_HOST",
    "VLLM_NIXL_SIDE_CHANNEL_PORT",
    "VLLM_ROCM_USE_AITER",
)


def _default(value: ast.expr | None) -> object:
    """A field's default: a JSON literal, ``{"expr": source}`` when not a literal, or
    ``"<required>"``."""
    if value is None:
        return "<required>"
    if isinstance(value, ast.Call) and ast.unparse(value.func) == "Field":
        keywords = {k.arg: k.value for k in value.keywords}
        if "default_factory" in keywords:
            factory = ast.unparse(keywords["default_factory"])
            return {"list": [], "dict": {}}.get(factory, {"expr": factory + "()"})
        value = keywords.get("default", value.args[0] if value.args else None)
        if value is None or (isinstance(value, ast.Constant) and value.value is Ellipsis):
            return "<required>"
    try:
        return ast.literal_eval(value)
    except ValueError:
        return {"expr": ast.unparse(value)}


class _Protocol:
    """The classes (bases, own fields) and union aliases of vLLM's protocol files."""

    def __init__(self, root: Path) -> None:
        self.bases: dict[str, list[str]] = {}
        self.own: dict[str, dict[str, object]] = {}
        self.aliases: dict[str, ast.expr] = {}
        for path in FILES:
            for node in ast.parse((root / path).read_text()).body:
                self._read(node)

    def _read(self, node: ast.stmt) -> None:
        if isinstance(node, ast.ClassDef):
            self.bases[node.name] = [ast.unparse(b).split("[")[0] for b in node.bases]
            self.own[node.name] = {
                stmt.target.id: _default(stmt.value)
                for stmt in node.body
                if isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and not stmt.target.id.startswith("_")
                and "ClassVar" not in ast.unparse(stmt.annotation)
            }
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if node.value is not None and "TypeAlias" in ast.unparse(node.annotation):
                self.aliases[node.target.id] = node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                self.aliases[target.id] = node.value

    def _is_model(self, name: str) -> bool:
        """Whether ``name`` is a pydantic model (derives from BaseModel)."""
        bases = self.bases.get(name, [])
        return "BaseModel" in bases or any(self._is_model(b) for b in bases)

    def fields(self, name: str) -> dict[str, object]:
        """A class's fields, inheritance resolved; an alias's: the union of its classes'."""
        if name in self.own:
            merged: dict[str, object] = {}
            for base in reversed(self.bases[name]):
                if self._is_model(base):  # (a plain mixin's annotations are no fields)
                    merged.update(self.fields(base))
            return {**merged, **self.own[name]}
        names = [n for n in ast.walk(self.aliases[name]) if isinstance(n, ast.Name)]
        names.sort(key=lambda n: (n.lineno, n.col_offset))  # the first member's defaults win
        members = [n.id for n in names if n.id in self.own]
        union: dict[str, object] = {}
        for member in members:
            for field, default in self.fields(member).items():
                union.setdefault(field, default)
        return union


def _env_defaults(root: Path) -> dict[str, str]:
    """vLLM's declared type and default of each variable (envs.py's TYPE_CHECKING block)."""
    tree = ast.parse((root / "vllm/envs.py").read_text())
    block = next(
        n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
    )
    out = {}
    for stmt in block.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            default = ast.unparse(stmt.value) if stmt.value is not None else "?"
            out[stmt.target.id] = f"{ast.unparse(stmt.annotation)} = {default}"
    return out


def generate(root: Path, wheel: Path | None) -> dict[str, object]:
    protocol = _Protocol(root)
    version = next(root.glob("vllm-*.dist-info")).name.removeprefix("vllm-")
    env = _env_defaults(root)
    missing = [name for name in COMMON_ENV if name not in env]
    if missing:
        raise SystemExit(f"not in this vLLM's envs.py: {missing}")
    source = {
        "package": "vllm " + version.removesuffix(".dist-info"),
        "files": [*FILES, "vllm/envs.py"],
    }
    if wheel is not None:
        source["wheel"] = wheel.name
        source["wheel_sha256"] = hashlib.sha256(wheel.read_bytes()).hexdigest()
    return {
        "source": source,
        "endpoints": {
            endpoint: {"route": route, "model": cls, "fields": protocol.fields(cls)}
            for endpoint, (route, cls) in ENDPOINTS.items()
        },
        "env": {name: env[name] for name in COMMON_ENV},
    }


if __name__ == "__main__":
    wheel_arg = Path(sys.argv[2]) if len(sys.argv) > 2 else None
    data = generate(Path(sys.argv[1]), wheel_arg)
    OUT.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    print(f"wrote {OUT}")
