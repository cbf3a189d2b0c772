"""ModernBERT (``ModernBertModel`` embeddings, ``ModernBertForSequenceClassification``
cross-encoders) built here from transformers configs (``build_tiny_modernbert``: 3 layers,
global / sliding / global with a window of 8 tokens, their own rotary bases, norm biases):
embeddings and scores equal transformers' on prompts longer than the window, batched and split
over chunked-prefill steps, from transformers 5's config.json and from the released
checkpoints' transformers 4 keys; every config field is decided, what is not computed is
refused by name."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from bert_reference import hf_embeddings, hf_pair_logits

from trillm import LLM
from trillm.config import EngineArgs
from trillm.engine.config_builder import build_config
from trillm.model_executor import modernbert_config
from trillm.testing.tiny_bert import build_tiny_modernbert, write_pooling_files

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris",
    "Machine learning models turn text into vectors for search, and a cross encoder scores "
    "a query and a document together.",
]
QUERY = "what is the capital of france"
DOCS = [
    "Paris is the capital of France.",
    "The weather today is sunny.",
    "A fox jumps over the lazy dog in the sunny weather today.",
]
TOL = dict(rtol=0, atol=1e-4)
# a chunk budget below the longest prompt: it is split over steps, the rest batched
ENGINE = dict(distributed_executor_backend="uni", max_num_batched_tokens=16, max_num_seqs=4)


def _edit_config(path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def _as_transformers_4(path) -> None:
    """config.json as the released checkpoints carry it: no layer_types or rope_parameters."""
    _edit_config(
        path,
        layer_types=None,
        rope_parameters=None,
        global_attn_every_n_layers=2,
        global_rope_theta=1000.0,
        local_rope_theta=50.0,
    )


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    path = build_tiny_modernbert("ModernBertModel", tmp_path_factory.mktemp("mb"))
    write_pooling_files(path, "mean", normalize=True)
    return path


def test_every_transformers_config_field_is_decided():
    from transformers import ModernBertConfig

    fields = {f.name for f in dataclasses.fields(ModernBertConfig)}
    assert fields - set(modernbert_config.FIELDS) == set()


def test_the_torch_free_activation_list_is_what_the_model_computes():
    from trillm.model_executor.models import modernbert

    assert set(modernbert_config.ACTIVATIONS) == set(modernbert._ACTIVATIONS)


def test_embeddings_equal_transformers_mean_pooling(embedder):
    with LLM(str(embedder), **ENGINE) as llm:
        outs = llm.embed(TEXTS, use_tqdm=False)
    got = torch.tensor([o.outputs.embedding for o in outs])
    torch.testing.assert_close(got, hf_embeddings(embedder, TEXTS, "mean", True), **TOL)


def test_the_window_and_the_local_rotary_base_change_the_answer(tmp_path, embedder):
    """The long prompt's reference moves with a wider window or another local base, so the
    equality above checks both."""
    want = hf_embeddings(embedder, TEXTS, "mean", True)
    for name, change in (
        ("window", {"local_attention": 1024}),
        ("theta", {"local_rope_theta": 1e4}),
    ):
        other = build_tiny_modernbert("ModernBertModel", tmp_path / name, **change)
        assert (hf_embeddings(other, TEXTS, "mean", True) - want)[2].abs().max() > 1e-3


def test_transformers_4_config_keys_give_the_same_embeddings(tmp_path):
    path = build_tiny_modernbert("ModernBertModel", tmp_path, seed=2)
    _as_transformers_4(path)
    with LLM(str(path), **ENGINE) as llm:
        outs = llm.embed(TEXTS, use_tqdm=False)
    got = torch.tensor([o.outputs.embedding for o in outs])
    torch.testing.assert_close(got, hf_embeddings(path, TEXTS, "cls", True), **TOL)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_cross_encoder_scores_equal_transformers(tmp_path, pooling):
    path = build_tiny_modernbert(
        "ModernBertForSequenceClassification", tmp_path, seed=3, classifier_pooling=pooling
    )
    firsts = ["a fox", "paris", "sunny weather"]
    with LLM(str(path), **ENGINE) as llm:
        one_to_n = llm.score(QUERY, DOCS, use_tqdm=False)
        n_to_n = llm.score(firsts, DOCS, use_tqdm=False)
    for outs, queries in ((one_to_n, [QUERY] * 3), (n_to_n, firsts)):
        want = torch.sigmoid(hf_pair_logits(path, queries, DOCS))
        torch.testing.assert_close(torch.tensor([o.outputs.score for o in outs]), want, **TOL)
    assert float(torch.tensor([o.outputs.score for o in one_to_n]).std()) > 1e-2


def test_a_transformers_4_cross_encoder_with_mean_pooling(tmp_path):
    path = build_tiny_modernbert(
        "ModernBertForSequenceClassification", tmp_path, seed=4, classifier_pooling="mean"
    )
    _as_transformers_4(path)
    with LLM(str(path), **ENGINE) as llm:
        outs = llm.score(QUERY, DOCS, use_tqdm=False)
    want = torch.sigmoid(hf_pair_logits(path, [QUERY] * 3, DOCS))
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in outs]), want, **TOL)


@pytest.mark.parametrize(
    ("arch", "edit", "args", "match"),
    [
        ("ModernBertModel", {}, {"runner": "generate"}, "encoder-only model.*runner='generate'"),
        ("ModernBertModel", {}, {"tensor_parallel_size": 2}, "tensor parallelism"),
        ("ModernBertModel", {"hidden_activation": "quick_gelu"}, {}, "Activation 'quick_gelu'"),
        ("ModernBertModel", {"layer_types": ["full_attention"]}, {}, "layer_types"),
        (
            "ModernBertModel",
            {"layer_types": ["full_attention", "chunked_attention", "full_attention"]},
            {},
            "layer_types",
        ),
        ("ModernBertModel", {"head_dim": 8}, {}, "head_dim must be"),
        (
            "ModernBertModel",
            {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0}}},
            {},
            r"rope_parameters\['full_attention'\].rope_type 'linear'",
        ),
        (
            "ModernBertModel",
            {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            {},
            r"rope_scaling.rope_type 'dynamic'",
        ),
        (
            "ModernBertForSequenceClassification",
            {"classifier_pooling": "max"},
            {},
            "classifier_pooling 'max' is not implemented",
        ),
        (
            "ModernBertForSequenceClassification",
            {"classifier_activation": "tanh"},
            {},
            "classifier_activation 'tanh' is not implemented",
        ),
    ],
)
def test_what_modernbert_cannot_do_is_refused(tmp_path, arch, edit, args, match):
    path = build_tiny_modernbert(arch, tmp_path)
    _edit_config(path, **edit)
    with pytest.raises(ValueError, match=match):
        build_config(EngineArgs.from_kwargs(str(path), device="cpu", **args))


def test_without_pooling_files_it_pools_cls_normalized(tmp_path):
    path = build_tiny_modernbert("ModernBertModel", tmp_path)
    pooler = build_config(EngineArgs.from_kwargs(str(path))).pooler
    assert (pooler.pooling_type, pooler.normalize, pooler.task) == ("CLS", True, "embed")
