"""vLLM's ``hf_overrides`` (fields laid over config.json) and ``load_format='dummy'`` (random
weights in the checkpoint's shapes, none read), through the engine as a user calls it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from trillm.config import EngineArgs
from trillm.engine.llm import LLM
from trillm.model_executor.layers.linear import loaded_parameters
from trillm.model_executor.loader import DUMMY_RANGE, build_model
from trillm.model_executor.model_config import apply_hf_overrides, load_model_config
from trillm.sampling_params import SamplingParams
from trillm.testing.tiny_models import build_tiny_model

PROMPTS = ["The quick brown fox", "One two three four five six"]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
LIMITS = {"max_model_len": 128, "distributed_executor_backend": "uni"}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def _greedy(model, **kwargs) -> list[list[int]]:
    with LLM(str(model), **LIMITS, **kwargs) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_overrides_replace_keys_and_merge_into_sub_configs():
    hf = {"rope_theta": 1e4, "text_config": {"hidden_size": 8, "vocab_size": 5}, "x": {"a": 1}}
    merged = apply_hf_overrides(hf, {"rope_theta": 5e5, "text_config": {"vocab_size": 7}, "x": 2})
    assert merged == {"rope_theta": 5e5, "text_config": {"hidden_size": 8, "vocab_size": 7}, "x": 2}
    assert hf["text_config"]["vocab_size"] == 5  # the file's dict is left as read
    with pytest.raises(ValueError, match="hf_overrides must be a JSON object"):
        apply_hf_overrides(hf, ["rope_theta"])  # type: ignore[arg-type]


def test_an_override_acts_as_editing_config_json(llama, tmp_path):
    """rope_theta overridden (inside transformers 5's rope_parameters: merged, rope_type kept)
    gives the tokens of a copy whose config.json says the same, and not the original's."""
    edited = shutil.copytree(llama, tmp_path / "edited")
    cfg = json.loads((edited / "config.json").read_text())
    cfg["rope_parameters"]["rope_theta"] = 31.0
    (edited / "config.json").write_text(json.dumps(cfg))
    overridden = _greedy(llama, hf_overrides={"rope_parameters": {"rope_theta": 31.0}})
    assert overridden == _greedy(edited)
    assert overridden != _greedy(llama)
    config = load_model_config(EngineArgs(str(llama), hf_overrides={"max_position_embeddings": 64}))
    assert config.max_position_embeddings == 64 and config.max_model_len == 64


def test_dummy_weights_need_no_checkpoint(llama, tmp_path):
    """A folder with config.json and the tokenizer only: load_format='dummy' serves it (random
    weights in [-1e-3, 1e-3], the same on every load); without 'dummy' it is refused."""
    folder = shutil.copytree(llama, tmp_path / "no-weights")
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    cfg = load_model_config(EngineArgs(str(folder), load_format="dummy"))
    first, second = (build_model(cfg, None, "cpu") for _ in range(2))
    pairs = zip(loaded_parameters(first), loaded_parameters(second), strict=True)
    for (name, a), (_, b) in pairs:
        assert torch.equal(a, b), name
        assert a.abs().max() <= DUMMY_RANGE and a.abs().max() > 0, name
    outputs = _greedy(folder, load_format="dummy")
    assert [len(tokens) for tokens in outputs] == [8, 8]
    with pytest.raises(Exception, match="safetensors"):
        _greedy(folder)


def test_dummy_is_refused_for_a_gguf_file(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")  # found by its name; the check comes before any read
    with pytest.raises(ValueError, match="load_format='dummy'.*GGUF"):
        load_model_config(EngineArgs(str(gguf), load_format="dummy"))
