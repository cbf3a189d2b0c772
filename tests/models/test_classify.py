"""Sequence classifiers (vLLM's classify task): a tiny ``Qwen2ForSequenceClassification``
built by the test. ``LLM.classify`` and ``/classify`` give transformers' softmax of the score
head's logits at the last token, with the checkpoint's labels; what is not implemented (or
contradicts the checkpoint) is refused by name."""

from __future__ import annotations

import httpx
import pytest
import torch
from server_harness import ServerProcess

from trillm import LLM
from trillm.config import EngineArgs
from trillm.engine.config_builder import build_config
from trillm.engine.preprocess import InvalidRequestError
from trillm.model_executor.classification import class_probs
from trillm.testing.tiny_models import build_tiny_model

LABELS = {0: "negative", 1: "neutral", 2: "positive"}
TEXTS = ["In the beginning", "A", "Copyright holders may"]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    base = build_tiny_model("qwen2", tmp_path_factory.mktemp("base"))  # tied embeddings
    model = AutoModelForSequenceClassification.from_pretrained(
        base,
        num_labels=3,
        id2label=LABELS,
        label2id={v: k for k, v in LABELS.items()},
        dtype=torch.float32,
    )
    torch.manual_seed(0)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.5)  # transformers' init is tiny: spread the classes
    path = tmp_path_factory.mktemp("classifier")
    model.save_pretrained(path)
    tok = AutoTokenizer.from_pretrained(base)
    tok.save_pretrained(path)
    refs = []
    for text in TEXTS:
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            refs.append((ids[0].tolist(), torch.softmax(model.eval()(ids).logits[0], -1)))
    return path, refs


def test_llm_classify_equals_transformers(classifier):
    path, refs = classifier
    with LLM(
        str(path), max_model_len=128, kv_cache_memory="8MiB", distributed_executor_backend="uni"
    ) as llm:
        outs = llm.classify(TEXTS, use_tqdm=False)
        assert llm.engine.config.pooler.labels == list(LABELS.values())
        with pytest.raises(InvalidRequestError, match="task is 'classify'"):
            llm.embed("hi", use_tqdm=False)
        with pytest.raises(InvalidRequestError, match="pooling model"):
            llm.generate("hi", use_tqdm=False)
    for out, (ids, want) in zip(outs, refs, strict=True):
        assert out.prompt_token_ids == ids and out.outputs.num_classes == 3
        torch.testing.assert_close(torch.tensor(out.outputs.probs), want, rtol=1e-5, atol=1e-6)
    assert (refs[0][1] - refs[1][1]).abs().max() > 0.1  # the inputs are told apart


def test_pp2_classifies_as_transformers_does(classifier):
    """Pipeline parallelism (issue 14): only the last stage holds the score head (its LM
    head's place) and applies it to the prompt's last row."""
    path, refs = classifier
    with LLM(str(path), max_model_len=128, kv_cache_memory="8MiB", pipeline_parallel_size=2) as llm:
        outs = llm.classify(TEXTS, use_tqdm=False)
    for out, (ids, want) in zip(outs, refs, strict=True):
        assert out.prompt_token_ids == ids
        torch.testing.assert_close(torch.tensor(out.outputs.probs), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pp", [1, 2])
def test_tp2_classifies_as_tp1_does(classifier, pp):
    """Tensor parallelism (issue 14), alone and with two pipeline stages: the decoder is
    sharded, the score head [num_labels, H] is read whole on every rank of the last stage and
    applied to the whole last row (the all-reduces add in another order than one rank: a
    tight tolerance, not bit equality)."""
    path, refs = classifier
    with LLM(
        str(path), max_model_len=128, kv_cache_memory="8MiB", distributed_executor_backend="uni"
    ) as llm:
        tp1 = [torch.tensor(o.outputs.probs) for o in llm.classify(TEXTS, use_tqdm=False)]
    with LLM(
        str(path),
        max_model_len=128,
        kv_cache_memory="8MiB",
        tensor_parallel_size=2,
        pipeline_parallel_size=pp,
    ) as llm:
        outs = llm.classify(TEXTS, use_tqdm=False)
    for out, want, (ids, _) in zip(outs, tp1, refs, strict=True):
        assert out.prompt_token_ids == ids
        torch.testing.assert_close(torch.tensor(out.outputs.probs), want, rtol=1e-5, atol=1e-6)


def test_one_label_is_a_sigmoid_and_more_a_softmax():
    torch.testing.assert_close(class_probs(torch.tensor([0.3])), torch.sigmoid(torch.tensor([0.3])))
    logits = torch.tensor([1.0, -2.0, 0.5])
    torch.testing.assert_close(class_probs(logits), torch.softmax(logits, -1))


@pytest.mark.parametrize(
    "args,match",
    [
        (dict(runner="generate"), "sequence classifier"),
        (dict(convert="embed"), "sequence classifier"),
        (dict(pooler_config={"pooling_type": "MEAN"}), "pooler_config with a sequence classifier"),
    ],
)
def test_what_a_classifier_does_not_do_is_refused(classifier, args, match):
    with pytest.raises(ValueError, match=match):
        build_config(EngineArgs(model=str(classifier[0]), **args))


def test_convert_classify_needs_a_score_head(tiny_model_factory):
    with pytest.raises(ValueError, match="convert='classify' needs a .*ForSequenceClassification"):
        build_config(EngineArgs(model=str(tiny_model_factory("llama")), convert="classify"))


@pytest.fixture(scope="module")
def server(classifier, tmp_path_factory):
    log = tmp_path_factory.mktemp("classify-serve") / "server.log"
    srv = ServerProcess(
        ["--model", str(classifier[0]), "--convert", "classify", "--disable-log-stats"], log
    ).start()
    yield srv
    assert srv.stop() == 0, srv.log()


def test_classify_route_answers_in_vllms_shape(server, classifier):
    _, refs = classifier
    r = httpx.post(server.url + "/classify", json={"input": TEXTS}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("classify-")
    assert body["usage"]["prompt_tokens"] == sum(len(ids) for ids, _ in refs)
    for i, (item, (_, want)) in enumerate(zip(body["data"], refs, strict=True)):
        assert item["index"] == i and item["num_classes"] == 3
        torch.testing.assert_close(torch.tensor(item["probs"]), want, rtol=1e-5, atol=1e-6)
        assert item["label"] == LABELS[int(want.argmax())]
    one = httpx.post(server.url + "/classify", json={"input": refs[1][0]}, timeout=60).json()
    torch.testing.assert_close(
        torch.tensor(one["data"][0]["probs"]), refs[1][1], rtol=1e-5, atol=1e-6
    )  # token ids in: the same answer


def test_truncate_prompt_tokens_keeps_the_last_tokens(server, classifier):
    _, refs = classifier
    ids = refs[2][0]
    body = {"input": [9, 9, 9, *ids], "truncate_prompt_tokens": len(ids)}
    got = httpx.post(server.url + "/classify", json=body, timeout=60).json()
    assert got["usage"]["prompt_tokens"] == len(ids)
    torch.testing.assert_close(
        torch.tensor(got["data"][0]["probs"]), refs[2][1], rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/classify", {"input": []}, "input"),
        ("/classify", {"input": "x", "model": "another"}, "model"),
        ("/v1/embeddings", {"input": "x"}, "model"),
    ],
)
def test_what_the_classify_server_refuses(server, path, body, param):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param
