"""Encoder-only checkpoints of the BERT family (``BertModel``, ``XLMRobertaModel``,
``ModernBertModel`` and their ``*ForSequenceClassification`` cross-encoders): which
architectures they are, what their config.json may ask, and what trillm refuses (ModernBERT's
own fields: ``modernbert_config.py``). Read without torch (the frontend checks a
config with it; ``models/bert.py`` computes them).

An encoder attends both ways over the whole prompt and keeps no KV cache: it only pools
(embeddings, or a cross-encoder's score), never generates (``worker/encoder_runner.py``).
"""

from __future__ import annotations

from typing import Any

from trillm.model_executor import modernbert_config

# SamplingParams.extra_args keys a pooling request carries to the encoder runner (vLLM's
# names): a pair's first segment-1 row, and False to return a cross-encoder's raw logit.
TOKEN_TYPE_KEY = "compressed_token_type_ids"
ACTIVATION_KEY = "use_activation"
EMBEDDERS = ("BertModel", "XLMRobertaModel", modernbert_config.EMBEDDER)
CROSS_ENCODERS = (
    "BertForSequenceClassification",
    "XLMRobertaForSequenceClassification",
    modernbert_config.CROSS_ENCODER,
)
ARCHITECTURES = EMBEDDERS + CROSS_ENCODERS
# computed by models/bert.py (ModernBERT by models/modernbert.py)
BERT_ARCHITECTURES = tuple(a for a in ARCHITECTURES if not modernbert_config.is_modernbert(a))
# the activations models/bert.py computes (transformers' ACT2FN names)
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
# sentence-transformers' cross-encoder activation (config.json) -> the score's function
_ST_ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "identity",
}


def is_encoder(architecture: str) -> bool:
    return architecture in ARCHITECTURES


def is_roberta(architecture: str) -> bool:
    return architecture.startswith("XLMRoberta")


def position_offset(hf: dict[str, Any], architecture: str) -> int:
    """Position rows a prompt cannot use: RoBERTa's positions start after its padding id
    (transformers' ``create_position_ids_from_input_ids``), so 514 rows hold 512 tokens."""
    if not is_roberta(architecture):
        return 0
    return int(hf.get("pad_token_id", 1)) + 1


def check(hf: dict[str, Any], architecture: str) -> None:
    """Refuse, by name, what config.json asks that models/bert.py does not compute."""
    if modernbert_config.is_modernbert(architecture):
        modernbert_config.check(hf, architecture)
    else:
        _check_bert(hf, architecture)
    if architecture in CROSS_ENCODERS:
        score_activation(hf)


def _check_bert(hf: dict[str, Any], architecture: str) -> None:
    kind = hf.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(
            f"{architecture}: position_embedding_type {kind!r} is not implemented "
            "(absolute position embeddings are)."
        )
    for name in ("is_decoder", "add_cross_attention"):
        if hf.get(name):
            raise ValueError(f"{architecture}: {name}=true is not supported (an encoder only).")


def score_activation(hf: dict[str, Any]) -> str:
    """What turns a one-label cross-encoder's logit into its score, as vLLM reads it:
    sentence-transformers' ``activation_fn`` (or ``sbert_ce_default_activation_function``)
    when config.json names one, else the sigmoid. Several labels: the softmax."""
    st = hf.get("sentence_transformers") or {}
    name = st.get("activation_fn") or hf.get("sbert_ce_default_activation_function")
    if name is None:
        return "sigmoid"
    if name not in _ST_ACTIVATIONS:
        raise ValueError(
            f"The cross-encoder's activation function {name!r} is not implemented "
            f"(supported: {', '.join(_ST_ACTIVATIONS)})."
        )
    return _ST_ACTIVATIONS[name]
