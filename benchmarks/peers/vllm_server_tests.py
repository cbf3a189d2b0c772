"""vLLM's own server tests (``tests/entrypoints/openai`` and ``serve`` in vLLM's repository) run against
``trillm serve`` -- or, with ``--server vllm``, against vLLM's CPU build as the control -- on
SmolLM2-135M-Instruct, with every model name the tests use mapped to that folder.

The tests are read from an export of vLLM's test tree (``--tests-dir``, default
``~/.cache/vllm-tests``, laid out as in vLLM's repository, with a ``MANIFEST.json`` naming the
commit each file came from). Each chosen file runs in its own pytest process (the client: vLLM's
venv when present, so the tests' ``from vllm... import`` helpers resolve) in a scratch folder
where ``tests/utils.py`` is ``vllm_test_shim.py``: its ``RemoteOpenAIServer`` starts the chosen
server with the test's flags unchanged. Model names resolve through an offline hub cache whose
snapshots are the SmolLM2 folder. Per-test outcomes (from pytest's JUnit XML), each server start
(command, ready or the log's last lines) and the files left out, with the reason, go to ``--out``
(JSON) and a markdown summary beside it.

    python benchmarks/peers/vllm_server_tests.py --out benchmarks/peers/results/vllm_server_tests_trillm.json
    python benchmarks/peers/vllm_server_tests.py --server vllm --out .../vllm_server_tests_vllm.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
SHIM = HERE / "vllm_test_shim.py"
CACHE = Path.home() / ".cache"
DEFAULT_MODEL = CACHE / "trillm-eagle" / "smollm2-135m-instruct"
DEFAULT_VLLM_VENV = CACHE / "trillm-peer" / "vllm-venv"

# Files under tests/entrypoints/openai (``serve/...``: tests/entrypoints/serve) that start a
# server on a text chat model (paths as in
# vLLM's tree, ``file::test`` for one test of a file); each runs when the export has it.
CHOSEN = [
    "basic/test_basic.py",
    "basic/test_return_token_ids.py",
    "chat_completion/test_batched_chat_completions.py",
    "chat_completion/test_chat.py",
    "chat_completion/test_chat_completion.py",
    "chat_completion/test_chat_echo.py",
    "chat_completion/test_chat_logit_bias_validation.py",
    "chat_completion/test_chat_stop_token_ids_validation.py",
    "chat_completion/test_enable_force_include_usage.py",
    "chat_completion/test_logprob_token_ids.py",
    "chat_completion/test_root_path.py",
    "completion/test_completion.py",
    "completion/test_prompt_validation.py::test_empty_prompt",
    "completion/test_prompt_validation.py::test_out_of_vocab_token_ids",
    "completion/test_token_in_token_out.py",  # (imports vLLM: the client is vLLM's venv)
    "completion/test_usage_policy.py",
    "responses/test_simple.py",  # (--reasoning-parser qwen3, VLLM_ENABLE_RESPONSES_API_STORE=1)
    "responses/test_usage_policy.py",
    "serve/instrumentator/test_orca_metrics.py",
    "serve/tokenize/test_tokenization.py",
]
# Files left out, and why (recorded in the results).
NOT_RUN = {
    "chat_completion/test_non_object_body_validation.py": "tests vLLM's Python request classes, no server",
    "completion/test_empty_prompt_list.py": "tests vLLM's Python request classes, no server",
    "chat_completion/test_system_fingerprint_none.py": "tests vLLM's Python response classes, no server",
    "completion/test_completion_text_offset.py": "drives vLLM's OpenAIServingCompletion in process",
    "chat_completion/test_serving_chat.py": "drives vLLM's serving classes in process with mocks",
    "completion/test_serving_completion.py": "drives vLLM's serving classes in process with mocks",
    "chat_completion/test_vision.py": "needs a vision model (Phi-3.5-vision), not SmolLM2",
    "chat_completion/test_audio.py": "needs an audio model (Ultravox)",
    "chat_completion/test_video.py": "needs a video model",
    "chat_completion/test_harmony.py": "needs gpt-oss (harmony format)",
    "correctness/test_lmeval.py": "accuracy run on a GPU-sized model",
    "correctness/test_transcription_api_correctness.py": "needs Whisper",
    "chat_completion/test_chat.py::test_chat_completion_request_n_parameter_*": (
        "7 in-process tests of vLLM's ChatCompletionRequest.to_sampling_params and "
        "VLLM_MAX_N_SEQUENCES, no server (not exported)"
    ),
    "serve/dev/**": "VLLM_SERVER_DEV_MODE routes for RL: sleep levels on a GPU (cumem), weight "
    "transfer over NCCL, routed experts of MoE models, multi-GPU",
    "serve/instrumentator/test_health.py": "drives vLLM's health route in process with mocks",
    "serve/middleware/test_x_request_id.py": "drives vLLM's middleware class in process",
    "serve/middleware/**, serve/exception_handl*/**": "most drive vLLM's FastAPI middleware and "
    "exception handlers in process (TestClient); not yet exported",
    "serve/disagg/**, serve/elastic_ep/**, serve/grpc/**, serve/kv_events/**, serve/snapshot/**, "
    "serve/steering/**, serve/sagemaker/**, serve/render/**": "vLLM internals (disaggregated "
    "prefill, expert-parallel scaling, gRPC, KV events, steering, SageMaker handlers, the "
    "render server); not yet exported",
    "serve/lora/**, serve/tokenize/test_serving_tokenization.py": "in-process serving classes "
    "or Hub LoRA adapters of other models; not yet exported",
    "chat_completion/test_batched_chat_completions.py (5 of its 10)": "drive vLLM's "
    "OpenAIServingChatBatch / BatchChatCompletionRequest in process with mocks (not exported)",
    "chat_completion/test_logprob_token_ids_validation.py, chat_completion/test_tool_choice_null"
    ".py, chat_completion/test_usage_prompt_tokens.py, completion/test_completion_logprobs.py, "
    "completion/test_stream_frame_template.py, completion/test_packed_logprobs.py": "test vLLM's "
    "Python request / serving classes and helpers in process, no server",
    "chat_completion/test_include_reasoning.py": "needs a reasoning model's <think> output "
    "(Qwen3-0.6B, --reasoning-parser qwen3); SmolLM2 never opens a reasoning section",
    "chat_completion/test_extra_content_fields.py": "needs TranslateGemma's template and a "
    "Spanish translation (model quality)",
    "chat_completion/test_token_in_token_out.py, completion/test_shutdown.py": "import vLLM "
    "helpers (download_weights_from_hf into its own cache folder, vllm.platforms, vLLM's "
    "api_server module started directly); not yet run",
    "chat_completion/test_cache_accounting.py": "from vLLM pull request 44822, closed unmerged "
    "(its reviewers had usage.cache_read_input_tokens taken out of the OpenAI routes); no vLLM "
    "release has the field (0.32 reports cache hits and writes in prompt_tokens_details, "
    "with --enable-prompt-tokens-details)",
    "responses/test_basic.py, test_stateful.py, test_structured_output.py": "use the "
    "package conftest's server (at 41c5903d: Qwen3-1.7B, "
    "--max-model-len 18192, over SmolLM2's 8192: no server starts, on vLLM either); their "
    "asserts are a reasoning model's answers ('312', reasoning items, 'Mark' recalled)",
    "responses/test_harmony*.py, test_mcp_tools.py, test_tool_choice_harmony.py": "gpt-oss "
    "(its harmony format; MCP / code-interpreter / browser tools)",
    "responses/test_errors.py, test_count_tokens.py, test_sampling_params.py, "
    "test_streaming_events.py": "drive vLLM's Responses serving / request / streaming classes "
    "in process (mocks, no server)",
    "responses/** (the other 32 files: test_function_call*, test_image, test_serving_*, "
    "test_parsable_context*, test_protocol, test_store*, test_websocket*, ...)": (
        "not read one by one; by their names: tool calls, images, unit tests of vLLM's "
        "Responses classes in process, its response store backends, its WebSocket transport"
    ),
    "embedding_tests/**, correctness/test_mteb*.py": "pooling (embedding / score) models, not "
    "a chat model",
    "cpu/**, engine/**, files/**": "vLLM's render server, engine helpers and media connector "
    "classes in process",
}
# LoRA adapters the tests download by hub id: each becomes a snapshot of a rank-8 adapter of the
# SmolLM2 folder (q_proj / v_proj, seeded random weights) that ``make_lora`` writes.
LORA_REPOS = ["typeof/zephyr-7b-beta-lora"]
LORA_RANK = 8
# Lines of the shim's own exception, not the server's log.
SHIM_LINES = r"Server exited|did not become ready|^\S+\.py:\d+: \w+$"
MODEL_NAME_RE = re.compile(r"""(?:MODEL_NAME|model_name|MODEL)\s*=\s*["']([\w.-]+/[\w.-]+)["']""")


def export_files(tests_dir: Path, files: list[str]) -> tuple[list[str], dict[str, str]]:
    """The chosen files the export holds, and the reason for each one it lacks."""
    present = [f for f in files if (tests_dir / vllm_path(f)).is_file()]
    missing = {f: "not in the export" for f in files if f not in present}
    return present, missing


def vllm_path(rel: str, whole: bool = True) -> str:
    """Where ``rel`` lies in vLLM's tree: ``serve/...`` under tests/entrypoints, the rest under
    tests/entrypoints/openai; ``whole`` drops a ``::test`` suffix."""
    rel = rel.split("::")[0] if whole else rel
    return (
        f"tests/entrypoints/{rel}"
        if rel.startswith("serve/")
        else f"tests/entrypoints/openai/{rel}"
    )


def make_run_root(tests_dir: Path, hub: Path) -> Path:
    """A scratch tree: vLLM's tests as exported, with the shim as ``tests/utils.py``."""
    root = Path(tempfile.mkdtemp(prefix="vllm-server-tests-"))
    shutil.copytree(tests_dir / "tests", root / "tests")
    # Packages throughout, as vLLM's conftests import ``....utils`` relatively.
    for folder in [root / "tests", *(root / "tests").rglob("*")]:
        if folder.is_dir():
            (folder / "__init__.py").touch()
    shutil.copy(SHIM, root / "tests" / "utils.py")
    (root / "pytest.ini").write_text(
        "[pytest]\nasyncio_default_fixture_loop_scope = function\n"
        "markers =\n    asyncio\n    skip_global_cleanup\n    core_model\n    cpu_model\n"
    )
    hub.mkdir(parents=True, exist_ok=True)
    return root


def map_names(root: Path, files: list[str], model_dir: Path, hub: Path) -> list[str]:
    """Map the model names the files assign (``MODEL_NAME = "org/name"``) before any test runs,
    for helpers that read a tokenizer or config before a server starts."""
    sys.path.insert(0, str(HERE))
    from vllm_test_shim import map_model_name

    names = set()
    for f in files:
        text = (root / vllm_path(f)).read_text()
        names.update(MODEL_NAME_RE.findall(text))
    for name in sorted(names):
        map_model_name(name, model_dir, hub)
    return sorted(names)


def make_lora(model_dir: Path, out: Path) -> Path:
    """A PEFT LoRA adapter (rank ``LORA_RANK`` on q_proj and v_proj of every layer, seeded random
    A and B so that it changes the outputs) for the model in ``model_dir``, written once."""
    if (out / "adapter_model.safetensors").is_file():
        return out
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    widths = {"q_proj": heads * head_dim, "v_proj": cfg["num_key_value_heads"] * head_dim}
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj, width in widths.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(LORA_RANK, hidden, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(width, LORA_RANK, generator=gen) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": LORA_RANK, "lora_alpha": 16,
               "target_modules": sorted(widths), "bias": "none", "lora_dropout": 0.0,
               "base_model_name_or_path": str(model_dir), "fan_in_fan_out": False}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(adapter, indent=1))
    return out


def server_cmd(args: argparse.Namespace) -> str:
    if args.server == "trillm":
        return shlex.join([sys.executable, "-m", "trillm"])
    python = args.vllm_venv / "bin" / "python"
    return shlex.join([str(python), "-m", "vllm.entrypoints.openai.api_server"])


def run_file(args: argparse.Namespace, root: Path, rel: str, env: dict[str, str]) -> dict[str, Any]:
    junit = root / "junit" / (re.sub(r"[/:]", "_", rel) + ".xml")
    cmd = [
        str(args.client_python), "-m", "pytest", vllm_path(rel, whole=False),
        "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-p", "no:xdist",
        f"--junitxml={junit}", "-o", "junit_family=xunit1", *shlex.split(args.pytest_args),
    ]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, text=True)
    try:
        tail = proc.communicate(timeout=args.file_timeout)[0][-3000:]
    except subprocess.TimeoutExpired:
        # Ctrl-C, not a kill: pytest then tears its server down and still writes the JUnit
        # file with the tests done so far (the rest are left out of the results).
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=120)[0]
        tail = f"timed out after {args.file_timeout} s (interrupted)\n" + out[-3000:]
    tests = parse_junit(junit, rel) if junit.is_file() else []
    return {"file": rel, "seconds": round(time.monotonic() - t0, 1), "tests": tests, "tail": tail}


def parse_junit(path: Path, rel: str) -> list[dict[str, str]]:
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        if case.get("name") is None:  # the test an interrupt stopped midway
            continue
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = key_line(node.get("message") or "", node.text or "")
                break
        name = f"{rel.split('::')[0]}::{case.get('name')}"
        out.append({"id": name, "outcome": outcome, "message": message})
    return out


def key_line(message: str, text: str) -> str:
    """The message's first line; for a server that did not start, the log's last error line
    (the shim puts the log's tail in the exception), which names a refused flag."""
    first = next((ln.strip() for ln in message.splitlines() if ln.strip()), "")
    if "Server exited unexpectedly" not in first and "did not become ready" not in first:
        return first[:400]
    # (pytest prefixes the lines with "E", the log's traceback groups with "|")
    lines = [re.sub(r"^(E\s+)?[|\s]*", "", ln) for ln in text.splitlines()]
    errors = [ln for ln in lines if re.search(r"Error\b|error:", ln)]
    errors = [ln for ln in errors if not re.search(SHIM_LINES, ln)]
    return ("server did not start: " + (errors[-1] if errors else first))[:400]


def server_starts(log_dir: Path) -> list[dict[str, Any]]:
    """Each server the shim started: its command and, for those that never became ready, the
    last lines of its log (a refused flag shows there)."""
    starts = []
    for log in sorted(log_dir.glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        errors = [ln for ln in lines if re.search(r"error|refus|unrecogni|not supported", ln, re.I)]
        starts.append(
            {"command": lines[0][2:] if lines else "", "log": str(log), "errors": errors[-3:]}
        )
    return starts


def summary(results: dict[str, Any]) -> str:
    t = results["totals"]
    rows = [
        f"# vLLM's server tests on {results['server']} ({results['model']})",
        "",
        f"`{results['command']}`",
        "",
        f"passed {t['passed']}, failed {t['failed']}, error {t['error']}, skipped {t['skipped']}",
        "",
        "| test | outcome | message |",
        "|---|---|---|",
    ]
    for f in results["files"]:
        for case in f["tests"]:
            msg = case["message"].replace("|", "\\|")[:200]
            rows.append(f"| `{case['id']}` | {case['outcome']} | {msg} |")
    rows += ["", "Files not run:", ""]
    rows += [f"- `{f}`: {why}" for f, why in results["not_run"].items()]
    return "\n".join(rows) + "\n"


def compare(trillm_json: Path, vllm_json: Path) -> str:
    """Each test's outcome on both servers, those that pass on vLLM and not on trillm first."""
    outcomes = {}
    for server, path in (("trillm", trillm_json), ("vllm", vllm_json)):
        for f in json.loads(path.read_text())["files"]:
            for case in f["tests"]:
                outcomes.setdefault(case["id"], {})[server] = case
    rows = ["| test | vLLM | trillm | trillm's message |", "|---|---|---|---|"]
    for test_id, by in sorted(outcomes.items(), key=lambda kv: _gap_first(kv[1])):
        v, t = by.get("vllm", {}), by.get("trillm", {})
        msg = t.get("message", "").replace("|", "\\|")[:160]
        rows.append(f"| `{test_id}` | {v.get('outcome', '-')} | {t.get('outcome', '-')} | {msg} |")
    return "\n".join(rows) + "\n"


def _gap_first(by: dict[str, dict[str, str]]) -> int:
    passed_on_vllm = by.get("vllm", {}).get("outcome") == "passed"
    return 0 if passed_on_vllm and by.get("trillm", {}).get("outcome") != "passed" else 1


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", choices=["trillm", "vllm"], default="trillm")
    p.add_argument("--tests-dir", type=Path, default=CACHE / "vllm-tests")
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="the SmolLM2 folder")
    p.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV)
    p.add_argument("--client-python", type=Path, default=None,
                   help="python that runs pytest (default: the vLLM venv's, else this one)")  # fmt: skip
    p.add_argument(
        "--files",
        nargs="*",
        default=CHOSEN,
        help="paths under tests/entrypoints/openai (serve/...: tests/entrypoints/serve)",
    )
    p.add_argument("--file-timeout", type=int, default=900)
    p.add_argument("--pytest-args", default="",
                   help="more pytest arguments, e.g. -k EXPR to resume an interrupted file")  # fmt: skip
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--compare", type=Path, nargs=2, metavar=("TRILLM_JSON", "VLLM_JSON"),
                   help="no run: write the two runs' outcomes side by side to --out (markdown)")  # fmt: skip
    args = p.parse_args()
    if args.client_python is None:
        venv_python = args.vllm_venv / "bin" / "python"
        args.client_python = venv_python if venv_python.exists() else Path(sys.executable)
    return args


def main() -> None:
    args = parse_args()
    if args.compare:
        args.out.write_text(compare(*args.compare))
        return
    files, not_run = export_files(args.tests_dir, args.files)
    not_run.update({f: why for f, why in NOT_RUN.items() if f not in files})
    scratch = Path(tempfile.mkdtemp(prefix="vllm-tests-hub-"))
    root = make_run_root(args.tests_dir, scratch / "hub")
    names = map_names(root, files, args.model, scratch / "hub")
    lora_dir = make_lora(args.model, scratch / "lora")
    sys.path.insert(0, str(HERE))
    from vllm_test_shim import map_model_name

    for repo in LORA_REPOS:
        map_model_name(repo, lora_dir, scratch / "hub")
    env = {
        **os.environ,
        "PYTHONPATH": str(root),
        "HF_HUB_CACHE": str(scratch / "hub"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_TESTS_SERVER": args.server,
        "VLLM_TESTS_SERVER_CMD": server_cmd(args),
        "VLLM_TESTS_SERVER_PYTHONPATH": str(REPO_ROOT) if args.server == "trillm" else "",
        "VLLM_TESTS_MODEL_DIR": str(args.model),
        "VLLM_TESTS_LOG_DIR": str(scratch / "logs"),
    }
    if args.server == "vllm":  # 2 GiB of KV cache, as run_compare.sh gives it (default 4)
        env["VLLM_CPU_KVCACHE_SPACE"] = "2"
    per_file = []
    for rel in files:
        per_file.append(run_file(args, root, rel, env))
        done = per_file[-1]
        print(f"{rel}: {len(done['tests'])} tests, {done['seconds']} s", flush=True)
    outcomes = [c["outcome"] for f in per_file for c in f["tests"]]
    results = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "server": args.server,
        "trillm_commit": git_head(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average": os.getloadavg(),
        "model": str(args.model),
        "mapped_model_names": names,
        "client_python": str(args.client_python),
        "manifest": read_manifest(args.tests_dir),
        "totals": {k: outcomes.count(k) for k in ("passed", "failed", "error", "skipped")},
        "files": per_file,
        "not_run": not_run,
        "server_starts": server_starts(scratch / "logs"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(summary(results))
    print(summary(results))


def git_head() -> str:
    out = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    return out.stdout.strip()


def read_manifest(tests_dir: Path) -> dict[str, str]:
    path = tests_dir / "MANIFEST.json"
    return json.loads(path.read_text()) if path.is_file() else {}


if __name__ == "__main__":
    main()
