"""benchmarks/peers/peers_1b.py's own pieces (it and its peers_1b_*.py modules), without
servers: each shape's KV budget holds 64 streams of the workload, the servers' commands name the
shape's files, and the table carries the c64 figures and their ratios."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.peers import peers_1b, peers_1b_servers, peers_1b_shapes, peers_1b_table


@pytest.mark.parametrize(
    ("shape", "per_token"), [("llama-3.2-1b", 32 * 1024), ("qwen3-1.7b", 112 * 1024)]
)
def test_the_default_kv_budget_holds_64_streams_of_the_workload(shape, per_token):
    args = peers_1b.parse_args(["run", "--shape", shape])
    assert peers_1b_shapes.kv_bytes_per_token(shape) == per_token
    streams = args.kv_gib * 2**30 // per_token // (args.in_len + args.out_len)
    assert streams >= 64  # c64 runs in one wave on every server (each gets the same budget)


def test_the_servers_commands_name_the_shapes_files(tmp_path):
    args = peers_1b.parse_args(["run", "--shape", "qwen3-1.7b", "--peer", str(tmp_path)])
    root = tmp_path / "qwen3-1.7b-shape"
    cmd, _ = peers_1b_servers.server_cmd("trillm-bf16", args)
    assert cmd[2:5] == [str(root / "qwen3-1.7b"), "--dtype", "bfloat16"]
    cmd, _ = peers_1b_servers.server_cmd("trillm-gguf-bf16", args)
    assert cmd[2:5] == [str(root / "qwen3-1.7b-bf16.gguf"), "--tokenizer", str(root / "qwen3-1.7b")]
    cmd, env = peers_1b_servers.server_cmd("vllm-bf16", args)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "10"
    assert cmd[cmd.index("--served-model-name") + 1] == "qwen3-1.7b"
    cmd, _ = peers_1b_servers.server_cmd("llama-q4_k_m", args)
    assert cmd[cmd.index("-m") + 1] == str(root / "qwen3-1.7b-q4_k_m.gguf")
    assert int(cmd[cmd.index("-c") + 1]) == 10 * 2**30 // (112 * 1024)  # the same 10 GiB


def _run(tput: float, ttft: float, tpot: float) -> dict[str, float | str]:
    return {
        "output_throughput": tput,
        "mean_ttft_ms": ttft,
        "mean_tpot_ms": tpot,
        "output_len_check": "ok",
    }


def test_the_table_carries_c64_and_its_ratios():
    args = peers_1b.parse_args(["table", "--shape", "qwen3-1.7b", "--long-len", "0"])
    summary = {
        "settings": {"shape": "qwen3-1.7b", "kv_gib": "10"},
        "servers": {
            "trillm-q4_0": {
                "load_before": "0.1",
                "c1": _run(20.0, 900.0, 50.0),
                "c16": _run(30.0, 60_000.0, 400.0),
                "c64": _run(45.0, 200_000.0, 900.0),
            },
            "llama-q4_0": {
                "load_before": "0.2",
                "c1": _run(18.0, 1000.0, 55.0),
                "c16": _run(15.0, 90_000.0, 700.0),
                "c64": _run(18.0, 400_000.0, 1500.0),
            },
            "vllm-bf16": {"load_before": "0.3", "error": "exited during start-up"},
        },
    }
    table = peers_1b_table.render(summary, args)
    assert table.startswith("qwen3-1.7b's shape, KV budget 10 GiB")
    row = next(line for line in table.splitlines() if line.startswith("trillm-q4_0"))
    assert "45.0" in row.split() and "200000" in row.split()
    assert "c64 out tok/s  trillm 45.0 (trillm-q4_0) / peer 18.0 (llama-q4_0) = 2.50" in table
    assert "c64 TTFT       trillm 200000.0 (trillm-q4_0) / peer 400000.0 (llama-q4_0) = 0.50" in (
        table
    )
    assert "c1 TPOT        trillm 50.0 (trillm-q4_0) / peer 55.0 (llama-q4_0) = 0.91" in table
    assert "vllm-bf16     ERROR exited during start-up" in table


def test_the_checkpoints_are_the_same_for_the_same_seed():
    mk = peers_1b_shapes.checkpoints()
    tiny = dict(
        mk.QWEN3_1_7B, hidden_size=32, head_dim=8, intermediate_size=48, num_hidden_layers=2
    )
    tiny["vocab_size"] = 64
    a, b = mk.random_weights(tiny, 0), mk.random_weights(tiny, 0)
    assert a.keys() == b.keys()
    assert "model.layers.1.self_attn.q_norm.weight" in a  # Qwen3's per-head q / k norms
    assert all(a[k].equal(b[k]) for k in a)
    assert not mk.random_weights(tiny, 1)["model.embed_tokens.weight"].equal(
        a["model.embed_tokens.weight"]
    )
    assert Path(mk.__file__).name == "make_1b_checkpoints.py"
