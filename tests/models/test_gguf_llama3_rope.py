"""Llama 3.x GGUF files: llama.cpp's converter stores the ``llama3`` rope scaling as a
``rope_freqs`` tensor (each rotary pair's frequency divisor); trillm reads it back into the
config's ``rope_scaling`` and serves the file. A tiny random Llama with llama3 scaling, written
as a GGUF, must give transformers' greedy tokens on the same folder (with its scaling), which
differ from the tokens without it at these positions."""

from __future__ import annotations

import numpy as np
import pytest
from hf_reference import hf_greedy

from trillm import LLM, SamplingParams
from trillm.model_executor import gguf_loader
from trillm.testing.gguf_models import write_tiny_gguf
from trillm.testing.tiny_models import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# head_dim 32, theta 10,000: pairs of wavelength 112 and 199 lie in the smooth band (64..256)
TINY_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


@pytest.mark.parametrize(
    ("theta", "dim", "factor", "high", "original"),
    [
        (500000.0, 64, 32.0, 4.0, 8192),  # Llama 3.2 1B / 3B
        (500000.0, 128, 8.0, 4.0, 8192),  # Llama 3.1 8B / 70B
        (10000.0, 32, 8.0, 4.0, 256),  # the tiny model below
        (10000.0, 32, 4.0, 1.5, 1000),  # no pair in the smooth band: the edges are guessed
    ],
)
def test_rope_freqs_read_back_as_the_scaling_that_made_them(theta, dim, factor, high, original):
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }
    factors = gguf_loader.llama3_factors(scaling, theta, dim).astype(np.float32)
    got = gguf_loader.llama3_scaling(factors.astype(np.float64), theta, dim)
    assert got is not None
    np.testing.assert_allclose(gguf_loader.llama3_factors(got, theta, dim), factors, rtol=1e-5)
    if (factors[(factors > 1) & (factors < factor)]).size >= 2:  # the real models: exact
        assert got == scaling


def test_other_rope_freqs_are_refused_and_ones_mean_no_scaling():
    assert gguf_loader.llama3_scaling(np.ones(16), 10000.0, 32) is None
    bumpy = np.linspace(1.0, 4.0, 16)[::-1].copy()  # decreasing with wavelength: not llama3
    with pytest.raises(gguf_loader.GGUFError, match="rope_freqs.*Llama 3"):
        gguf_loader.llama3_scaling(bumpy, 10000.0, 32)
    with pytest.raises(gguf_loader.GGUFError, match="rope_freqs"):
        gguf_loader.llama3_scaling(np.full(8, 2.0), 10000.0, 32)  # wrong length


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    hf = build_tiny_model("llama", tmp_path_factory.mktemp("hf"), rope_scaling=dict(TINY_SCALING))
    plain = build_tiny_model("llama", tmp_path_factory.mktemp("hf-plain"))  # same weights
    return write_tiny_gguf(hf, tmp_path_factory.mktemp("gguf"), {}), plain


def test_a_llama3_gguf_runs_with_its_rope_scaling(scaled):
    path, plain = scaled
    file = gguf_loader.GGUFFile(path)
    assert file.hf_config()["rope_scaling"] == TINY_SCALING
    assert "rope_freqs.weight" not in {t.name for t in file.tensors()}
    folder = path.parent / "dequantized"  # the F32 folder, its config with the scaling
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 4000, size=n).tolist() for n in (120, 200)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(str(path), max_model_len=256, kv_cache_memory="8MiB") as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [hf_greedy(str(folder), p, 8) for p in prompts]
    assert got != [hf_greedy(str(plain), p, 8) for p in prompts]  # the scaling matters here
