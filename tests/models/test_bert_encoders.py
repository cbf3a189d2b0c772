"""BERT-family encoders (``BertModel``, ``XLMRobertaModel``) and cross-encoders
(``*ForSequenceClassification`` with one label), built here from transformers configs with
tokenizers trained by ``trillm/testing/tiny_bert.py`` (WordPiece, Unigram). Embeddings equal
transformers' hidden states pooled as sentence-transformers pools them (computed with torch),
scores equal transformers' logits through the sigmoid, with prompts of different lengths in
one batch and split over chunked-prefill steps; what an encoder cannot do is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from bert_reference import hf_embeddings, hf_pair_logits, hf_pair_logits_one_segment

from trillm import LLM
from trillm.config import EngineArgs
from trillm.engine.config_builder import build_config
from trillm.engine.preprocess import InvalidRequestError
from trillm.testing.tiny_bert import build_tiny_encoder, write_pooling_files

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris",
    "Machine learning models turn text into vectors for search, and a cross encoder scores "
    "a query and a document together.",
]
QUERY = "what is the capital of france"
DOCS = ["Paris is the capital of France.", "The weather today is sunny.", "A fox jumps."]
TOL = dict(rtol=0, atol=1e-4)
# a chunk budget below the longest prompt: it is split over steps, the rest batched
ENGINE = dict(distributed_executor_backend="uni", max_num_batched_tokens=16, max_num_seqs=4)


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    path = build_tiny_encoder("BertModel", tmp_path_factory.mktemp("bert"))
    write_pooling_files(path, "mean", normalize=True)
    return path


@pytest.fixture(scope="module")
def xlmr(tmp_path_factory):
    path = build_tiny_encoder("XLMRobertaModel", tmp_path_factory.mktemp("xlmr"), seed=1)
    write_pooling_files(path, "cls", normalize=False)
    return path


@pytest.fixture(
    scope="module", params=["BertForSequenceClassification", "XLMRobertaForSequenceClassification"]
)
def cross_encoder(request, tmp_path_factory):
    return build_tiny_encoder(request.param, tmp_path_factory.mktemp("ce"), seed=3)


def test_bert_embeddings_equal_sentence_transformers_mean_pooling(bert):
    with LLM(str(bert), **ENGINE) as llm:
        outs = llm.embed(TEXTS, use_tqdm=False)
        with pytest.raises(InvalidRequestError, match="pooling model"):
            llm.generate("hi", use_tqdm=False)
    got = torch.tensor([o.outputs.embedding for o in outs])
    torch.testing.assert_close(got, hf_embeddings(bert, TEXTS, "mean", True), **TOL)


def test_xlm_roberta_embeddings_equal_cls_pooling(xlmr):
    with LLM(str(xlmr), **ENGINE) as llm:
        outs = llm.embed(TEXTS, use_tqdm=False)
        assert llm.engine.config.model.max_model_len == 128  # 130 rows from pad_id + 1
    got = torch.tensor([o.outputs.embedding for o in outs])
    want = hf_embeddings(xlmr, TEXTS, "cls", False)
    torch.testing.assert_close(got, want, **TOL)
    assert want.norm(dim=-1).sub(1).abs().max() > 0.1  # not normalized, as the folder says


def test_cross_encoder_scores_equal_transformers(cross_encoder):
    firsts = ["a fox", "paris", "sunny weather"]
    with LLM(str(cross_encoder), **ENGINE) as llm:
        one_to_n = llm.score(QUERY, DOCS, use_tqdm=False)
        n_to_n = llm.score(firsts, DOCS, use_tqdm=False)
        classified = llm.classify([TEXTS[0]], use_tqdm=False)
    for outs, queries in ((one_to_n, [QUERY] * 3), (n_to_n, firsts)):
        want = torch.sigmoid(hf_pair_logits(cross_encoder, queries, DOCS))
        torch.testing.assert_close(torch.tensor([o.outputs.score for o in outs]), want, **TOL)
    assert float(torch.tensor([o.outputs.score for o in one_to_n]).std()) > 1e-2
    assert classified[0].outputs.num_classes == 1  # /classify serves it too


def test_a_pair_carries_its_segment_ids(tmp_path):
    """BERT's second text is segment 1: the score differs from the all-zeros one."""
    path = build_tiny_encoder("BertForSequenceClassification", tmp_path, seed=3)
    with LLM(str(path), **ENGINE) as llm:
        (out,) = llm.score(QUERY, DOCS[0], use_tqdm=False)
    want = float(torch.sigmoid(hf_pair_logits(path, [QUERY], [DOCS[0]]))[0])
    zeros = float(torch.sigmoid(torch.tensor(hf_pair_logits_one_segment(path, QUERY, DOCS[0]))))
    assert out.outputs.score == pytest.approx(want, abs=1e-4)
    assert abs(zeros - want) > 1e-3


def test_score_with_an_embedding_model_is_the_cosine_similarity(bert):
    with LLM(str(bert), **ENGINE) as llm:
        outs = llm.score(QUERY, DOCS, use_tqdm=False)
        with pytest.raises(InvalidRequestError, match="1:1, 1:N or N:N"):
            llm.score(["a", "b"], DOCS, use_tqdm=False)
    vecs = hf_embeddings(bert, [QUERY, *DOCS], "mean", True)
    want = torch.nn.functional.cosine_similarity(vecs[:1], vecs[1:])
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in outs]), want, **TOL)


def test_sentence_transformers_identity_activation_gives_the_raw_logit(tmp_path):
    path = build_tiny_encoder("BertForSequenceClassification", tmp_path, seed=4)
    cfg = json.loads((path / "config.json").read_text())
    cfg["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (path / "config.json").write_text(json.dumps(cfg))
    with LLM(str(path), **ENGINE) as llm:
        outs = llm.score(QUERY, DOCS, use_tqdm=False)
    want = hf_pair_logits(path, [QUERY] * 3, DOCS)
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in outs]), want, **TOL)


def test_an_encoder_without_pooling_files_pools_cls_normalized(tmp_path):
    path = build_tiny_encoder("BertModel", tmp_path)
    pooler = build_config(EngineArgs.from_kwargs(str(path))).pooler
    assert (pooler.pooling_type, pooler.normalize, pooler.task) == ("CLS", True, "embed")


@pytest.mark.parametrize(
    ("edit", "args", "match"),
    [
        ({}, {"runner": "generate"}, "encoder-only model.*runner='generate'"),
        ({}, {"tensor_parallel_size": 2}, "tensor parallelism does not support BertModel"),
        ({}, {"quantization": "fp8"}, "quantization='fp8' is not supported"),
        ({}, {"pipeline_parallel_size": 2}, "pipeline_parallel_size=2 is not supported"),
        ({}, {"data_parallel_size": 2}, "data_parallel_size=2 is not supported"),
        ({"position_embedding_type": "relative_key"}, {}, "position_embedding_type"),
        ({"is_decoder": True}, {}, "is_decoder=true"),
        ({"hidden_act": "silu"}, {}, "Activation 'silu'"),
    ],
)
def test_what_an_encoder_cannot_do_is_refused(tmp_path, edit, args, match):
    path = build_tiny_encoder("BertModel", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(ValueError, match=match):
        build_config(EngineArgs.from_kwargs(str(path), device="cpu", **args))


def test_an_unknown_cross_encoder_activation_is_refused(tmp_path):
    path = build_tiny_encoder("XLMRobertaForSequenceClassification", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["sbert_ce_default_activation_function"] = "torch.nn.modules.activation.Tanh"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="activation function 'torch.nn.modules.activation.Tanh'"):
        build_config(EngineArgs.from_kwargs(str(path)))
