"""Tensor and pipeline parallelism on the hybrid state-space families (Mamba-2 layers beside
attention): TP=2 greedy tokens equal the one-rank engine's for Bamba (2 groups of B and C: one
per rank), GraniteMoeHybrid with RoPE and experts (1 group: replicated on both ranks, the
gated norm's one group spanning them) and Nemotron-H (M * - M, random biases: a row-parallel
one added on both ranks would change the tokens; M * E M: each rank its share of every
expert's and the shared MLP's intermediate size), and so do PP=2's (layers mamba, attention |
mamba; Nemotron-H's M * | - M: each stage keeps its own Mamba layers' states), 2 prompts
longer than an SSD chunk (8 positions) x 8 tokens. Sizes TP cannot split exactly are refused
by name before any worker starts.
"""

from __future__ import annotations

import pytest
import torch
from parallel_models import MAX_TOKENS
from parallel_reference import greedy, reference_tokens
from safetensors.torch import load_file

from trillm.config import EngineArgs
from trillm.engine.config_builder import build_config
from trillm.engine.llm import LLM
from trillm.testing.tiny_bamba import build_tiny_bamba, build_tiny_granite_hybrid
from trillm.testing.tiny_nemotron_h import MOE, build_tiny_nemotron_h

# Both longer than one SSD chunk of 8 positions, of different lengths.
PROMPTS = [
    "The capital of France is a city on the river Seine",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14",
]
# Few batch slots: each holds a request's Mamba states, taken from the KV cache's budget.
LIMITS = {"max_model_len": 64, "kv_cache_memory": "4MiB", "max_num_seqs": 4}
BUILDERS = {
    "bamba": lambda out: build_tiny_bamba(out),
    "granite_one_group": lambda out: build_tiny_granite_hybrid(out, mamba_n_groups=1),
    "nemotron_h": lambda out: build_tiny_nemotron_h(out),
    "nemotron_h_moe": lambda out: build_tiny_nemotron_h(out, **MOE),
}


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    paths: dict[str, str] = {}

    def build(name: str) -> str:
        if name not in paths:
            paths[name] = str(BUILDERS[name](tmp_path_factory.mktemp(name)))
        return paths[name]

    return build


@pytest.mark.parametrize("layout", ["tensor_parallel_size", "pipeline_parallel_size"])
@pytest.mark.parametrize("name", list(BUILDERS))
def test_parallel_matches_one_rank(hybrid, name, layout):
    path = hybrid(name)
    expected = reference_tokens(path, PROMPTS, MAX_TOKENS, **LIMITS)
    # A reference that only repeats one token per prompt could not tell a wrong split apart.
    assert all(len(set(t)) > 1 for t in expected), expected
    with LLM(path, **{layout: 2}, **LIMITS) as llm:
        outs = llm.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected


def test_each_rank_reads_its_heads_and_groups(hybrid):
    """The two ranks' gate, x, B, C and dt rows of in_proj are the halves of the whole
    tensor's; with one group, each rank reads B and C whole."""
    from trillm.distributed.sharding import RankShapes
    from trillm.model_executor.loader import iterate_weights, safetensors_files

    name = "model.layers.0.mamba.in_proj.weight"
    for model, groups_split in (("bamba", True), ("granite_one_group", False)):
        path = hybrid(model)
        cfg = build_config(EngineArgs(path, tensor_parallel_size=2)).model
        hf = cfg.hf_config
        inner, bc = 2 * cfg.hidden_size, int(hf["mamba_n_groups"]) * int(hf["mamba_d_state"])
        heads = int(hf["mamba_n_heads"])
        whole = load_file(safetensors_files(path)[0])[name].split([inner, inner, bc, bc, heads])
        rank_bc = bc // 2 if groups_split else bc
        sizes = [inner // 2, inner // 2, rank_bc, rank_bc, heads // 2]
        ranks = [
            dict(iterate_weights(path, shard=(cfg, RankShapes.of(cfg, r, 2))))[name].split(sizes)
            for r in (0, 1)
        ]
        for i, part in enumerate(whole):
            if sizes[i] == part.shape[0]:  # B or C of the one group: whole on each rank
                assert torch.equal(ranks[0][i], part) and torch.equal(ranks[1][i], part)
            else:
                assert torch.equal(torch.cat([ranks[0][i], ranks[1][i]]), part)


def test_sizes_tp_cannot_split_are_refused(hybrid):
    """2 groups of B and C over 4 ranks: neither split nor one group to share."""
    args = EngineArgs(hybrid("bamba"), device="cpu", tensor_parallel_size=4, max_model_len=64)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 .*mamba_n_groups=2"):
        build_config(args)


def test_each_pipeline_stage_holds_its_own_layers_states(hybrid):
    """Layers mamba | attention, mamba: stage 0 one Mamba state and no KV layer, stage 1 one of
    each; their Mamba layers' rows in the stage's state cache both 0."""
    from trillm.distributed.pipeline import PipelineGroup, get_pp_group, set_pp_group
    from trillm.model_executor.models.mamba2 import hybrid_state_layout, mixer_rows

    cfg = build_config(EngineArgs(hybrid("bamba"), device="cpu", max_model_len=64)).model
    kinds = cfg.hf_config["layer_types"]
    saved = get_pp_group()
    try:
        for stage, (start, end), kv_layers, row in ((0, (0, 1), 0, 0), (1, (1, 3), 1, 2)):
            set_pp_group(PipelineGroup(stage, 2, start_layer=start, end_layer=end))
            layout = hybrid_state_layout(cfg)
            assert (layout.num_layers, layout.kv_layers) == (1, kv_layers)
            assert mixer_rows(kinds)[row] == 0
    finally:
        set_pp_group(saved)


def test_nemotron_h_stages_hold_only_their_mamba_layers_states(hybrid):
    """M * | - M: each stage one Mamba state; stage 0 the one KV layer; the MLP layer holds
    neither, so stage 1's Mamba layer (layer 3) takes row 0."""
    from trillm.distributed.pipeline import PipelineGroup, get_pp_group, set_pp_group
    from trillm.model_executor.models.mamba2 import hybrid_state_layout, mixer_rows

    cfg = build_config(EngineArgs(hybrid("nemotron_h"), device="cpu", max_model_len=64)).model
    kinds = cfg.hf_config["layer_types"]
    saved = get_pp_group()
    try:
        for stage, kv_layers, rows in ((0, 1, [0, None, None, 1]), (1, 0, [0, None, None, 0])):
            set_pp_group(PipelineGroup(stage, 2, start_layer=2 * stage, end_layer=2 * stage + 2))
            layout = hybrid_state_layout(cfg)
            assert (layout.num_layers, layout.kv_layers) == (1, kv_layers)
            assert mixer_rows(kinds) == rows
    finally:
        set_pp_group(saved)
