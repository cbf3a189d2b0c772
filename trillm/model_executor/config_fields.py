"""The config fields every transformers checkpoint carries beside its family's own (the
``PretrainedConfig`` attributes, and the MoE families' training-only ones), with what trillm
does with each: one table that each family's ``FIELDS`` (``*_config.py``) takes in."""

from __future__ import annotations

READ = "read"
INERT = "no effect on inference in transformers either"

COMMON_FIELDS: dict[str, str] = {
    "pad_token_id": "read by the tokenizer side, as in transformers' generate",
    "dtype": "read (--dtype auto)",
    "architectures": READ,
    "initializer_range": INERT,
    "attention_dropout": INERT,
    "output_router_logits": INERT,
    "use_cache": INERT,
    "output_hidden_states": INERT,
    "return_dict": INERT,
    "chunk_size_feed_forward": INERT,
    "transformers_version": INERT,
    "is_encoder_decoder": "must be false: refused otherwise",
    "id2label": "read for sequence classifiers only",
    "label2id": INERT,
    "problem_type": INERT,
}
