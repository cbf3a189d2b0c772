"""Servers shared by the test modules of one pytest worker, keyed by their flags.

A ``trillm serve`` start costs seconds of CPU (two processes import torch and transformers).
Modules that need a server with the same flags and leave it as they found it (no restarts,
no adapters loaded, no counters read as absolute values) share one: they ask the
``shared_server`` fixture (tests/conftest.py) for it and carry the same
``pytest.mark.xdist_group`` name, so that pytest-xdist runs them on one worker. Each server is
stopped when the worker's session ends, and must exit cleanly then.
"""

from __future__ import annotations

from pathlib import Path

from server_harness import ServerProcess

FAKE_RUNNER = ["--runner", "trillm.worker.fake_runner:FakeModelRunner"]


class ServerPool:
    """``get(args)`` starts ``trillm serve ARGS`` once per distinct flags; ``close()`` stops all."""

    def __init__(self, log_dir: Path) -> None:
        self._log_dir = log_dir
        self._servers: dict[tuple[str, ...], ServerProcess] = {}

    def get(self, args: list[str]) -> ServerProcess:
        key = tuple(args)
        if key not in self._servers:
            log = self._log_dir / f"shared-server-{len(self._servers)}.log"
            self._servers[key] = ServerProcess(list(args), log).start()
        return self._servers[key]

    def close(self) -> list[str]:
        """Stop every server; the failures, each its flags, exit code and log tail."""
        failures = []
        for key, srv in self._servers.items():
            code = srv.stop()
            if code != 0:
                failures.append(f"trillm serve {' '.join(key)} exited {code}:\n{srv.log()}")
        self._servers.clear()
        return failures


# The shared servers: their flags, and the xdist group of the modules that use them.
FAKE_512_TEMPLATES = [*FAKE_RUNNER, "--max-model-len", "512", "--trust-request-chat-template"]
FAKE_512_TEMPLATES_GROUP = "shared-server-fake-512-templates"
FAKE_256 = [*FAKE_RUNNER, "--max-model-len", "256"]
FAKE_256_GROUP = "shared-server-fake-256"
# The answer flags on (test_vllm_conformance.py, test_prefix_cache_writes.py), group FAKE_256's.
USAGE_KEY = "conformance-key"
FAKE_256_USAGE = [
    *FAKE_256,
    "--enable-prompt-tokens-details",
    "--enable-force-include-usage",
    "--return-tokens-as-token-ids",
    "--enable-tokenizer-info-endpoint",
    "--api-key",
    USAGE_KEY,
]

# The tool-calling server with an API key (tests/entrypoints/test_anthropic_messages.py): the
# default model with <think> tokens, a Hermes-style template (thinking closed unless
# ``enable_thinking``), hermes tool calls, the qwen3 reasoning parser.
TOOLS_KEY = "tools-key-5d2a"
TOOLS_GROUP = "shared-server-tools"
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for tc in m.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking %}<think>\n"
    "{%- else %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}"
)


def tools_server_args(base: Path) -> list[str]:
    """The tool server's flags; its model and template are built under ``base`` (the
    session's temporary root) once, so every module asking gets the same flags."""
    from trillm.testing.reasoning_model import build_reasoning_model
    from trillm.testing.tiny_models import DEFAULT_MODEL_DIR

    root = base / "shared-tools-server"
    model, template = root / "model", root / "template.jinja"
    if not template.exists():
        build_reasoning_model(DEFAULT_MODEL_DIR, model)
        template.write_text(TOOLS_TEMPLATE)
    return [
        str(model),
        "--chat-template",
        str(template),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        "64MiB",
        "--api-key",
        TOOLS_KEY,
    ]
