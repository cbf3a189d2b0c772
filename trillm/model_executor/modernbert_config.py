"""ModernBERT's config.json (``ModernBertModel`` and its ``ForSequenceClassification``
cross-encoder), read without torch: which layers attend globally and which within a window,
the rotary base of each kind, the classifier head's settings, and what trillm refuses.

transformers 5 writes ``layer_types`` and a per-layer-type ``rope_parameters``; the released
checkpoints carry transformers 4's ``global_attn_every_n_layers``, ``global_rope_theta`` and
``local_rope_theta`` instead. Both are read as ``ModernBertConfig`` reads them (the new keys
win where both are present). ``FIELDS`` says what trillm does with every config field.
"""

from __future__ import annotations

from typing import Any

from trillm.model_executor.config_fields import COMMON_FIELDS, INERT, READ
from trillm.model_executor.layer_types import FULL, SLIDING

EMBEDDER = "ModernBertModel"
CROSS_ENCODER = "ModernBertForSequenceClassification"
ARCHITECTURES = (EMBEDDER, CROSS_ENCODER)
# transformers' ACT2FN names models/modernbert.py computes (MLP and classifier head)
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu")
POOLINGS = ("cls", "mean")
_DEFAULT_THETA = {FULL: 160_000.0, SLIDING: 10_000.0}  # ModernBertConfig.default_theta
_DEFAULT_GLOBAL_EVERY = 3

FIELDS: dict[str, str] = {
    **dict.fromkeys(
        (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
            "norm_eps",
            "norm_bias",
            "attention_bias",
            "mlp_bias",
            "classifier_bias",
            "local_attention",
        ),
        READ,
    ),  # fmt: skip
    "hidden_activation": f"read ({', '.join(ACTIVATIONS)}; others refused by name)",
    "classifier_activation": f"read ({', '.join(ACTIVATIONS)}; others refused by name)",
    "classifier_pooling": "read (cls, mean; others refused by name)",
    "layer_types": "read (full_attention / sliding_attention; others refused by name)",
    "global_attn_every_n_layers": "read when layer_types is absent (transformers 4 configs)",
    "rope_parameters": "read per layer type (default rope only; others refused by name)",
    "global_rope_theta": "read when rope_parameters does not set it",
    "local_rope_theta": "read when rope_parameters does not set it",
    "rope_scaling": "a rope type other than default refused by name",
    "head_dim": "must be hidden_size / num_attention_heads, as transformers computes it",
    "num_labels": READ,
    "bos_token_id": "read by the tokenizer side",
    "eos_token_id": "read by the tokenizer side",
    "cls_token_id": "read by the tokenizer side",
    "sep_token_id": "read by the tokenizer side",
    "model_type": READ,
    "_name_or_path": INERT,
    "initializer_cutoff_factor": INERT,
    "embedding_dropout": INERT,
    "mlp_dropout": INERT,
    "classifier_dropout": INERT,
    "output_attentions": INERT,
    "deterministic_flash_attn": INERT,
    "reference_compile": INERT,
    # the masked-LM head's (ModernBertForMaskedLM), which these architectures do not have
    "decoder_bias": INERT,
    "sparse_prediction": INERT,
    "sparse_pred_ignore_index": INERT,
    "tie_word_embeddings": INERT,
    **COMMON_FIELDS,
}


def is_modernbert(architecture: str) -> bool:
    return architecture in ARCHITECTURES


def layer_types(hf: dict[str, Any]) -> list[str]:
    """Each layer's attention: ``layer_types``, else every ``global_attn_every_n_layers``-th
    layer global (the first one included) and the others sliding."""
    n = int(hf["num_hidden_layers"])
    if hf.get("layer_types"):
        return [str(t) for t in hf["layer_types"]]
    every = int(hf.get("global_attn_every_n_layers") or _DEFAULT_GLOBAL_EVERY)
    return [SLIDING if i % every else FULL for i in range(n)]


def half_window(hf: dict[str, Any]) -> int:
    """A sliding layer's token sees those at most this far on either side
    (``local_attention`` is the whole window, as transformers' ``sliding_window`` halves it)."""
    return int(hf.get("local_attention", 128)) // 2


def rope_theta(hf: dict[str, Any], kind: str) -> float:
    """The rotary base of ``kind`` (FULL or SLIDING) layers."""
    params = (hf.get("rope_parameters") or {}).get(kind) or {}
    old_key = "global_rope_theta" if kind == FULL else "local_rope_theta"
    return float(params.get("rope_theta", hf.get(old_key, _DEFAULT_THETA[kind])))


def classifier_pooling(hf: dict[str, Any]) -> str:
    return str(hf.get("classifier_pooling", "cls"))


def check(hf: dict[str, Any], architecture: str) -> None:
    """Refuse, by name, what config.json asks that models/modernbert.py does not compute."""
    kinds = layer_types(hf)
    if len(kinds) != int(hf["num_hidden_layers"]) or set(kinds) - {FULL, SLIDING}:
        raise ValueError(
            f"{architecture}: layer_types {kinds!r} must name {FULL!r} or {SLIDING!r} for each "
            "of the num_hidden_layers layers."
        )
    _check_rope(hf, architecture)
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    if hidden % heads or int(hf.get("head_dim") or hidden // heads) != hidden // heads:
        raise ValueError(
            f"{architecture}: head_dim must be hidden_size / num_attention_heads "
            f"({hidden} / {heads})."
        )
    if architecture == CROSS_ENCODER:
        _check_choice(architecture, "classifier_pooling", classifier_pooling(hf), POOLINGS)
        act = str(hf.get("classifier_activation", "gelu"))
        _check_choice(architecture, "classifier_activation", act, ACTIVATIONS)


def _check_rope(hf: dict[str, Any], architecture: str) -> None:
    params = hf.get("rope_parameters") or {}
    for kind in (FULL, SLIDING):
        rope_type = (params.get(kind) or {}).get("rope_type", "default")
        _check_choice(architecture, f"rope_parameters[{kind!r}].rope_type", rope_type, ("default",))
    scaling = hf.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    _check_choice(architecture, "rope_scaling.rope_type", rope_type, ("default",))


def _check_choice(architecture: str, name: str, value: Any, supported: tuple[str, ...]) -> None:
    if value not in supported:
        raise ValueError(
            f"{architecture}: {name} {value!r} is not implemented (supported: "
            f"{', '.join(supported)})."
        )
