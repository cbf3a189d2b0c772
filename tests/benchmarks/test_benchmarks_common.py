"""The benchmark helpers (benchmarks/common.py, the py-spy summary, the overhead summary)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import common
from benchmarks.engine import engine_overhead
from benchmarks.serving import frontend_headroom


@pytest.mark.parametrize("tie", [False, True])
def test_param_counts_match_the_hf_model(tmp_path: Path, tie: bool) -> None:
    import transformers

    from trillm.testing.tiny_models import build_tiny_model

    folder = build_tiny_model("llama", tmp_path, tie_word_embeddings=tie)
    counts = common.param_counts(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    embed = model.model.embed_tokens.weight.numel()
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert counts.embedding == embed
    assert counts.lm_head == model.lm_head.weight.numel()
    layers = sum(p.numel() for p in model.model.layers.parameters())
    assert counts.non_embedding == layers + model.model.norm.weight.numel()
    assert counts.flop_params == counts.non_embedding + model.lm_head.weight.numel()


def test_workload_lengths_and_determinism() -> None:
    jobs = common.make_workload(200, seed=3)
    assert jobs == common.make_workload(200, seed=3)
    assert jobs != common.make_workload(200, seed=4)
    lens = [len(j.prompt_ids) for j in jobs]
    outs = [j.output_len for j in jobs]
    assert min(lens) >= 8 and max(lens) <= 384 and len(set(lens)) > 50
    assert min(outs) >= 8 and max(outs) <= 160 and len(set(outs)) > 50
    ids = [t for j in jobs for t in j.prompt_ids]
    assert min(ids) >= common.PROMPT_ID_RANGE[0] and max(ids) < common.PROMPT_ID_RANGE[1]


def test_matmul_rate_is_positive_and_finite() -> None:
    rate = common.matmul_gflops(64, 64, 64, min_time_s=0.01)
    assert 0.01 < rate < 1e5


def test_profile_summary_self_inclusive_and_processes(tmp_path: Path) -> None:
    raw = tmp_path / "p.txt"
    raw.write_text(
        'process 1:"python -m trillm serve";main (a/cli.py:3);step (b/core.py:10) 30\n'
        'process 1:"python -m trillm serve";main (a/cli.py:3);step (b/core.py:12) 10\n'
        'process 1:"python -m trillm serve";main (a/cli.py:3) 20\n'
        'process 1:"x";process 2:"worker";run (w.py:5);fwd (m.py:9) 40\n'
    )
    prof = frontend_headroom.summarize_profile(raw)
    assert prof["samples"] == 100
    self_share = {r["function"]: r["share"] for r in prof["top_self"]}
    assert self_share == {"step (core.py)": 0.4, "main (cli.py)": 0.2, "fwd (m.py)": 0.4}
    incl = {r["function"]: r["share"] for r in prof["top_inclusive"]}
    assert incl["main (cli.py)"] == pytest.approx(0.6)
    procs = {r["function"]: r["share"] for r in prof["processes"]}
    assert procs == {'process 1:"python -m trillm serve"': 0.6, 'process 2:"worker"': 0.4}


def test_overhead_summary_uses_full_batch_steps_only() -> None:
    # (start, step_time_s, model_time_s, num_outputs): a prefill of 2, then decodes of 4.
    records = [
        (0.0, 0.5, 0.4, 2),
        (1.0, 0.003, 0.001, 4),
        (1.01, 0.005, 0.001, 4),
        (1.03, 0.004, 0.002, 4),
    ]
    s = engine_overhead.summarize(records, batch=4, tokens=12, wall=2.0)
    # The last full step has no next step to measure its period, so two steady steps remain.
    assert s["steady_steps"] == 2
    assert s["core_overhead_us"] == pytest.approx(3000.0)  # median of 2000 and 4000
    assert s["period_us"] == pytest.approx(15000.0)  # median of 10 ms and 20 ms
    assert s["tok_s"] == 6.0
