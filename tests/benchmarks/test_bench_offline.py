"""``trillm bench latency|throughput`` on the offline engine (tiny real model), and the shared
engine flags of ``trillm/bench/engine_args.py``. The commands run as ``trillm bench ...``
forked from the worker's serve zygote (``python -m trillm.bench`` is the same parser:
tests/benchmarks/test_bench_serve.py runs it)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from bench_stub import write_sharegpt
from server_harness import run_trillm

from trillm.bench.engine_args import (
    add_engine_args,
    engine_args_from_namespace,
    engine_kwargs_from_namespace,
)
from trillm.config import EngineArgs

ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "256"]


def run_offline(cmd: str, args: list[str], log: Path) -> SimpleNamespace:
    """``returncode`` and ``output`` (stdout and stderr together) of ``trillm bench CMD``."""
    return run_trillm(["bench", cmd, *args, *ENGINE_FLAGS, "--disable-tqdm"], log, timeout=600)


@pytest.fixture(scope="module")
def tiny_model(tiny_model_factory) -> Path:
    return Path(tiny_model_factory("llama"))


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(argv)


def test_engine_flags_map_onto_engine_args() -> None:
    args = parse(
        ["/m", "--max-num-seqs", "4", "--kv-cache-memory", "2GiB", "--no-enable-prefix-caching"]
    )
    assert engine_kwargs_from_namespace(args) == {
        "max_num_seqs": 4,
        "kv_cache_memory": 2 << 30,
        "enable_prefix_caching": False,
    }
    ea = engine_args_from_namespace(args)
    assert isinstance(ea, EngineArgs) and ea.model == "/m" and ea.block_size == 16
    assert engine_args_from_namespace(parse(["--model", "/x"])).model == "/x"
    with pytest.raises(ValueError, match="Two different models"):
        engine_args_from_namespace(parse(["/a", "--model", "/b"]))


def test_every_engine_args_field_has_a_flag() -> None:
    from dataclasses import fields

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    dests = {a.dest for a in parser._actions}
    assert {f.name for f in fields(EngineArgs)} - {"model"} <= dests


def test_bad_memory_size_is_a_usage_error() -> None:
    with pytest.raises(SystemExit):
        parse(["--kv-cache-memory", "lots"])


def test_throughput_random_and_sharegpt(tiny_model: Path, tmp_path: Path) -> None:
    n, in_len, out_len = 6, 12, 5
    out = tmp_path / "tp.json"
    proc = run_offline(
        "throughput",
        [str(tiny_model), "--num-prompts", str(n), "--input-len", str(in_len)]
        + ["--output-len", str(out_len), "--output-json", str(out)],
        tmp_path / "random.log",
    )
    assert proc.returncode == 0, proc.output[-3000:]
    r = json.loads(out.read_text())
    assert r["num_requests"] == n
    assert r["total_output_tokens"] == n * out_len  # ignore_eos: exactly max_tokens each
    assert r["total_num_tokens"] == n * (in_len + out_len)
    assert r["tokens_per_second"] == pytest.approx(r["total_num_tokens"] / r["elapsed_time"])
    assert r["requests_per_second"] == pytest.approx(n / r["elapsed_time"])
    assert "Throughput:" in proc.output and "output tokens/s" in proc.output

    data = tmp_path / "sharegpt.json"
    write_sharegpt(
        data,
        [
            ("Tell me about the moon and its phases.", "The moon has phases as it orbits."),
            ("Hi", "too short a prompt to keep, filtered"),
            ("What do cats like to eat in winter?", "Cats like warm food and fish."),
        ],
    )
    proc = run_offline(
        "throughput",
        ["--model", str(tiny_model), "--dataset-name", "sharegpt", "--dataset-path", str(data)]
        + ["--num-prompts", "10", "--output-json", str(out)],
        tmp_path / "sharegpt.log",
    )
    assert proc.returncode == 0, proc.output[-3000:]
    assert json.loads(out.read_text())["num_requests"] == 2


def test_latency_json(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "lat.json"
    proc = run_offline(
        "latency",
        [str(tiny_model), "--batch-size", "2", "--input-len", "8", "--output-len", "3"]
        + ["--num-iters-warmup", "1", "--num-iters", "3", "--output-json", str(out)],
        tmp_path / "latency.log",
    )
    assert proc.returncode == 0, proc.output[-3000:]
    r = json.loads(out.read_text())
    assert len(r["latencies"]) == 3 and all(x > 0 for x in r["latencies"])
    assert r["avg_latency"] == pytest.approx(float(np.mean(r["latencies"])))
    values = [r["percentiles"][p] for p in ("10", "25", "50", "75", "90", "99")]
    assert values == sorted(values) and r["percentiles"]["50"] == pytest.approx(
        float(np.median(r["latencies"]))
    )
    assert "Avg latency:" in proc.output


def test_latency_bad_flag_is_a_clear_error(tmp_path: Path) -> None:
    proc = run_offline("latency", ["--batch-size", "0"], tmp_path / "latency.log")
    assert proc.returncode == 1 and "--batch-size must be at least 1" in proc.output
