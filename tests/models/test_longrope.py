"""Long-RoPE (Phi-3.5-mini, Phi-4-mini) as transformers computes it.

transformers' rotary embedding takes the long factors for a forward whose ``max(position_ids)
+ 1`` exceeds ``original_max_position_embeddings``; in Phi-3's ``generate`` a prompt is one
forward (all of its tokens rotate by the table its length picks), the decode token at position
p a forward of ``p + 1``, and at the step where the sequence first grows past the original
context the cache is dropped and the whole sequence computed again (on the long table). A tiny
random Phi-3 (partial rotary, as Phi-4-mini) with an original context of 32 positions, in fp32,
greedy, equals transformers token for token: a short prompt that decodes past 32, a long prompt
prefilled in 16-token chunks, and both in one engine. The same engine with the table chosen per
batch, with a long prompt's first chunk on the short table, or keeping the short keys at the
crossing, gives other tokens: the test sees each of those mistakes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trillm.model_executor.layers.rotary import LongRopeIndex, RotaryEmbedding
from trillm.model_executor.model_config import parse_rope
from trillm.worker.longrope_state import LongRopeState

ORIGINAL = 32  # original_max_position_embeddings
MAX_POS = 128  # max_position_embeddings (the factor 4 gives the attention factor)
HEAD_DIM, ROTARY = 32, 24  # partial_rotary_factor 0.75, as Phi-4-mini
SHORT = [1.0 + 0.05 * i for i in range(ROTARY // 2)]
LONG = [2.0 + 1.5 * i for i in range(ROTARY // 2)]
CHUNK = 16  # long_prefill_token_threshold: a request's prefill chunk
SHORT_PROMPT, SHORT_NEW = 20, 24  # decodes past position 32
LONG_PROMPT, LONG_NEW = 50, 8  # prefilled in chunks of 16, 16, 16, 2
CONFIG = dict(
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    partial_rotary_factor=0.75,
    sliding_window=None,
    max_position_embeddings=MAX_POS,
    original_max_position_embeddings=ORIGINAL,
    rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG},
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _hf_config(**overrides):
    from transformers import Phi3Config

    return Phi3Config(**{**CONFIG, **overrides})


# ---------------------------------------------------------------- tables and config


def test_tables_equal_transformers_rotary_in_both_regimes():
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    hf_config = _hf_config()
    theta, scaling = parse_rope(hf_config.to_dict())
    ours = RotaryEmbedding(ROTARY, theta, scaling, MAX_POS, max_positions=MAX_POS)
    assert ours.longrope == LongRopeIndex(ORIGINAL, MAX_POS)
    assert ours.cos_sin_cache.shape == (2 * MAX_POS, ROTARY)
    hf = Phi3RotaryEmbedding(hf_config)
    assert hf.attention_scaling != 1.0  # sqrt(1 + ln 4 / ln 32)
    x = torch.zeros(1, dtype=torch.float32)
    for seq_len, offset in ((ORIGINAL, 0), (ORIGINAL + 1, MAX_POS), (MAX_POS, MAX_POS)):
        cos, sin = hf(x, torch.arange(seq_len)[None])  # its forward picks by max(ids) + 1
        table = ours.cos_sin_cache[offset : offset + seq_len]
        assert torch.equal(table[:, : ROTARY // 2], cos[0, :, : ROTARY // 2])
        assert torch.equal(table[:, ROTARY // 2 :], sin[0, :, : ROTARY // 2])
    # the short table is not the long one: the regimes differ past position 0
    assert not torch.equal(ours.cos_sin_cache[1:MAX_POS], ours.cos_sin_cache[MAX_POS + 1 :])


def test_rope_positions_pick_the_table_per_token():
    index = LongRopeIndex(original_max_position_embeddings=ORIGINAL, long_offset=MAX_POS)
    # a short request decoding at 31 then 32; a long prompt's first chunk; a prompt of exactly
    # 32 tokens; a request recomputed after a preemption (40 tokens known): long only where
    # max(known tokens, p + 1) > 32
    positions = np.array([31, 32, 0, 15, 0, 31, 0])
    num_tokens = np.array([32, 33, 50, 50, 32, 32, 40])
    got = index.rope_positions(positions, num_tokens)
    assert got.tolist() == [31, 32 + MAX_POS, MAX_POS, 15 + MAX_POS, 0, 31, MAX_POS]


@pytest.mark.parametrize(
    ("top_level", "in_rope", "rope_type", "expected"),
    [
        (64, 32, "longrope", 64),  # Phi3Config: the top-level key wins
        (None, 32, "longrope", 4096),  # ... and defaults to 4096
        (64, None, "su", 64),  # Phi-3's older names are its longrope
        (64, None, "yarn", 64),
    ],
)
def test_phi3_original_max_as_transformers_reads_it(top_level, in_rope, rope_type, expected):
    from transformers import Phi3Config

    rope = {"type": rope_type, "short_factor": SHORT, "long_factor": LONG}
    if in_rope is not None:
        rope["original_max_position_embeddings"] = in_rope
    hf = {**CONFIG, "model_type": "phi3", "rope_scaling": rope}
    del hf["original_max_position_embeddings"]
    if top_level is not None:
        hf["original_max_position_embeddings"] = top_level
    reference = Phi3Config.from_dict(hf).rope_parameters
    assert reference["rope_type"] == "longrope"
    assert reference["original_max_position_embeddings"] == expected
    _, scaling = parse_rope(hf)
    assert scaling is not None
    assert scaling["rope_type"] == "longrope"
    assert scaling["original_max_position_embeddings"] == expected


def test_longrope_of_other_models_is_refused():
    rope = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG}
    with pytest.raises(ValueError, match="Phi-3 models"):
        parse_rope({**CONFIG, "model_type": "llama", "rope_scaling": rope})


def test_prefix_caching_is_off(model):
    from trillm.config import EngineArgs
    from trillm.engine.config_builder import build_config

    path, _ = model
    config = build_config(EngineArgs(model=path, device="cpu", max_model_len=MAX_POS))
    assert config.model.rope_scaling["rope_type"] == "longrope"
    assert not config.cache.enable_prefix_caching


def test_factors_of_the_wrong_length_are_refused():
    theta, scaling = parse_rope(_hf_config().to_dict())
    with pytest.raises(ValueError, match="short_factor as a list of 16 numbers"):
        RotaryEmbedding(HEAD_DIM, theta, scaling, MAX_POS, max_positions=MAX_POS)


# ---------------------------------------------------------------- greedy vs transformers


def _prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(5)
    return {
        "short": torch.randint(3, 4096, (SHORT_PROMPT,), generator=g).tolist(),
        "long": torch.randint(3, 4096, (LONG_PROMPT,), generator=g).tolist(),
    }


MAX_NEW = {"short": SHORT_NEW, "long": LONG_NEW}


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    import transformers

    path = tiny_model_factory("phi3", **CONFIG)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    refs = {}
    with torch.no_grad():
        for name, prompt in _prompts().items():  # each prompt alone, one prefill forward
            gen = transformers.GenerationConfig(
                do_sample=False, max_new_tokens=MAX_NEW[name], eos_token_id=None, pad_token_id=0
            )
            out = hf.generate(torch.tensor([prompt]), generation_config=gen)
            refs[name] = out[0, len(prompt) :].tolist()
    return path, refs


@pytest.fixture(scope="module")
def llm(model):
    from trillm import LLM

    path, _ = model
    engine = LLM(
        path,
        dtype="float32",
        max_model_len=MAX_POS,
        max_num_seqs=4,
        max_num_batched_tokens=2 * CHUNK,  # both requests' chunks fit one step
        long_prefill_token_threshold=CHUNK,
        kv_cache_memory="16MiB",
        distributed_executor_backend="uni",  # in process: the rules below can be swapped
    )
    yield engine
    engine.shutdown()


def _generate(llm, names: list[str]) -> dict[str, list[int]]:
    from trillm import SamplingParams

    prompts = _prompts()
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW[n], ignore_eos=True) for n in names
    ]
    outs = llm.generate([{"prompt_token_ids": prompts[n]} for n in names], params, use_tqdm=False)
    return {n: list(o.outputs[0].token_ids) for n, o in zip(names, outs, strict=True)}


@pytest.mark.parametrize(
    "names", [["short"], ["long"], ["short", "long"]], ids=["short", "long", "batched"]
)
def test_greedy_equals_transformers(model, llm, names):
    _, refs = model
    assert _generate(llm, names) == {n: refs[n] for n in names}


def test_prompt_logprobs_are_not_repeated_at_the_crossing(model, llm):
    from trillm import SamplingParams

    _, refs = model
    params = SamplingParams(
        temperature=0.0, max_tokens=SHORT_NEW, ignore_eos=True, prompt_logprobs=1
    )
    (out,) = llm.generate([{"prompt_token_ids": _prompts()["short"]}], params, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == refs["short"]
    assert len(out.prompt_logprobs) == SHORT_PROMPT


def _per_batch(self, positions, num_tokens):
    """A mistake: one table for the whole step (long if any token's request needs it)."""
    long = self.is_long(num_tokens, positions + 1)
    return positions + bool(long.any()) * self.long_offset


def _first_chunk_short(self, positions, num_tokens):
    """A mistake: a long prompt's first prefill chunk on the short table."""
    rows = LongRopeIndex.rope_positions(self, positions, num_tokens)
    return np.where(positions < CHUNK, positions, rows)


def _keep_short_keys(self, batch, slots, num_scheduled):
    """A mistake: the short keys kept when a request grows past the original context."""
    return num_scheduled, np.zeros(len(slots), dtype=bool)


@pytest.mark.parametrize(
    ("target", "rule", "names", "wrong"),
    [
        (LongRopeIndex, _per_batch, ["short", "long"], "short"),
        (LongRopeIndex, _first_chunk_short, ["long"], "long"),
        (LongRopeState, _keep_short_keys, ["short"], "short"),
    ],
    ids=["per-batch", "first-chunk-short", "keep-short-keys"],
)
def test_the_wrong_rules_give_other_tokens(model, llm, monkeypatch, target, rule, names, wrong):
    """The cases above see these mistakes: with them the tokens differ from transformers'."""
    _, refs = model
    name = "rope_positions" if target is LongRopeIndex else "widen_step"
    monkeypatch.setattr(target, name, rule)
    assert _generate(llm, names)[wrong] != refs[wrong]


@pytest.mark.parametrize("reference", [False, True], ids=["kernel", "torch"])
def test_rotation_equals_transformers_on_both_tables(reference):
    """The native kernel (trillm.kernels.dispatch) and the torch reference rotate by rows of
    the long table as transformers' apply_rotary_pos_emb does with its long cos/sin."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    hf_config = _hf_config()
    theta, scaling = parse_rope(hf_config.to_dict())
    ours = RotaryEmbedding(ROTARY, theta, scaling, MAX_POS, max_positions=MAX_POS)
    ours.reference = reference
    g = torch.Generator().manual_seed(0)
    for seq_len, offset in ((ORIGINAL, 0), (MAX_POS, MAX_POS)):
        q = torch.randn(seq_len, 4, HEAD_DIM, generator=g)
        k = torch.randn(seq_len, 2, HEAD_DIM, generator=g)
        cos, sin = Phi3RotaryEmbedding(hf_config)(q, torch.arange(seq_len)[None])
        q_ref, k_ref = apply_rotary_pos_emb(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
        )
        ours(torch.arange(seq_len) + offset, q, k)
        if reference:
            assert torch.equal(q, q_ref[0].transpose(0, 1))
            assert torch.equal(k, k_ref[0].transpose(0, 1))
        else:
            torch.testing.assert_close(q, q_ref[0].transpose(0, 1), rtol=0, atol=1e-6)
            torch.testing.assert_close(k, k_ref[0].transpose(0, 1), rtol=0, atol=1e-6)
