"""benchmarks/peers/vllm_server_tests.py's own pieces: a test model name resolves offline to the
mapped folder through the hub cache (what lets ``trillm serve NAME`` and vLLM's helpers load
SmolLM2 under the tests' names), and the per-test outcome read from pytest's JUnit XML names
the flag a server refused."""

from __future__ import annotations

import json
from pathlib import Path

import huggingface_hub
import huggingface_hub.constants
import huggingface_hub.errors
import pytest

from benchmarks.peers import vllm_server_tests
from benchmarks.peers.vllm_test_shim import map_model_name


def test_a_mapped_name_resolves_offline_to_the_folder(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (model / "DONE").touch()
    hub = tmp_path / "hub"
    map_model_name("Qwen/Qwen3-0.6B", model, hub)
    map_model_name("Qwen/Qwen3-0.6B", model, hub)  # a second mapping keeps the first
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    folder = Path(huggingface_hub.snapshot_download("Qwen/Qwen3-0.6B", cache_dir=hub))
    assert json.loads((folder / "config.json").read_text()) == {"model_type": "llama"}
    assert not (folder / "DONE").exists()
    with pytest.raises(huggingface_hub.errors.LocalEntryNotFoundError):
        huggingface_hub.snapshot_download("Qwen/Other", cache_dir=hub)


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="t" name="test_ok" />
<testcase classname="t" name="test_bad"><failure message="AssertionError: assert 1 == 2&#10;more">trace</failure></testcase>
<testcase classname="t" name="test_start"><error message="failed on setup with &quot;RuntimeError: Server exited unexpectedly:&#10;$ tr">E   RuntimeError: Server exited unexpectedly:
E   $ trillm serve m --x
E   trillm: error: unrecognized arguments: --x

tests/utils.py:127: RuntimeError</error></testcase>
<testcase classname="t" name="test_skip"><skipped message="needs a GPU" /></testcase>
<testcase time="0.000" />
</testsuite></testsuites>
"""


def test_outcomes_and_the_refused_flag_come_from_the_junit_file(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    cases = vllm_server_tests.parse_junit(path, "chat_completion/test_x.py::test_ok")
    assert [(c["id"], c["outcome"], c["message"]) for c in cases] == [
        ("chat_completion/test_x.py::test_ok", "passed", ""),
        ("chat_completion/test_x.py::test_bad", "failed", "AssertionError: assert 1 == 2"),
        (
            "chat_completion/test_x.py::test_start",
            "error",
            "server did not start: trillm: error: unrecognized arguments: --x",
        ),
        ("chat_completion/test_x.py::test_skip", "skipped", "needs a GPU"),
    ]


def test_compare_lists_what_passes_on_vllm_only_first(tmp_path):
    runs = {
        "trillm": {"a::t1": "passed", "a::t2": "error", "a::t3": "failed"},
        "vllm": {"a::t1": "passed", "a::t2": "failed", "a::t3": "passed"},
    }
    paths = []
    for server, outcomes in runs.items():
        cases = [{"id": i, "outcome": o, "message": f"{server} {o}"} for i, o in outcomes.items()]
        path = tmp_path / f"{server}.json"
        path.write_text(json.dumps({"files": [{"tests": cases}]}))
        paths.append(path)
    rows = vllm_server_tests.compare(*paths).splitlines()[2:]
    assert rows[0] == "| `a::t3` | passed | failed | trillm failed |"
    assert sorted(rows[1:]) == [
        "| `a::t1` | passed | passed | trillm passed |",
        "| `a::t2` | failed | error | trillm error |",
    ]


def test_serve_paths_lie_beside_openai():
    assert vllm_server_tests.vllm_path("serve/tokenize/t.py::x") == (
        "tests/entrypoints/serve/tokenize/t.py"
    )
    assert vllm_server_tests.vllm_path("basic/t.py::x", whole=False) == (
        "tests/entrypoints/openai/basic/t.py::x"
    )


def test_the_lora_adapter_fits_the_model(tmp_path):
    from safetensors.torch import load_file

    model = tmp_path / "model"
    model.mkdir()
    cfg = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    (model / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 2}))
    out = vllm_server_tests.make_lora(model, tmp_path / "lora")
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["peft_type"] == "LORA" and adapter["target_modules"] == ["q_proj", "v_proj"]
    tensors = load_file(str(out / "adapter_model.safetensors"))
    assert len(tensors) == 2 * 2 * 2  # layers x projections x (A, B)
    attn = "base_model.model.model.layers.1.self_attn"
    rank = vllm_server_tests.LORA_RANK
    assert tensors[f"{attn}.q_proj.lora_A.weight"].shape == (rank, 64)
    assert tensors[f"{attn}.q_proj.lora_B.weight"].shape == (64, rank)
    assert tensors[f"{attn}.v_proj.lora_B.weight"].shape == (32, rank)  # 2 kv heads x 16
