"""Tiny BERT-family checkpoints for tests: random weights from a transformers config and a
tokenizer built here with ``tokenizers`` from a few sentences' words and characters
(WordPiece for BERT with ``[CLS] a [SEP] b [SEP]`` and segment ids 0 / 1; Unigram for XLM-R
with ``<s> a </s></s> b </s>``, one segment), the same on every run; optionally with
sentence-transformers' pooling files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CORPUS = [
    "In the beginning God created the heaven and the earth.",
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France and a city of art.",
    "Machine learning models turn text into vectors for search.",
    "A cross encoder scores a query and a document together.",
    "Copyright holders may grant permission to copy and modify software.",
    "The weather today is sunny with a light breeze from the west.",
    "Embeddings of similar sentences lie close to each other.",
] * 4
SIZES = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "initializer_range": 0.2,  # transformers' 0.02 makes every text's [CLS] row alike
}


def _words(pre_tokenizer: Any, lowercase: bool) -> list[str]:
    """The corpus' pre-tokenized pieces, sorted: the vocabulary is built from them, not
    trained (``tokenizers``' trainers order ties by hash, so each run would differ)."""
    pieces = set()
    for text in CORPUS:
        pieces |= {
            w for w, _ in pre_tokenizer.pre_tokenize_str(text.lower() if lowercase else text)
        }
    return sorted(pieces)


def _bert_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = _words(pre_tokenizers.BertPreTokenizer(), lowercase=True)
    chars = sorted({c for w in words for c in w})
    pieces = [*special, *chars, *(f"##{c}" for c in chars), "##s", "##ing", "##ed"]
    pieces += [w for w in words if w not in pieces]
    tok = Tokenizer(models.WordPiece({p: i for i, p in enumerate(pieces)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    names = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
    return tok, names


def _xlmr_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    special = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    words = _words(pre_tokenizers.Metaspace(), lowercase=False)
    chars = sorted({c for w in words for c in w})
    # a whole word scores above its pieces; characters cover the rest
    vocab = [(p, 0.0) for p in special] + [(c, -8.0) for c in chars]
    vocab += [(w, -2.0 - 0.1 * len(w)) for w in words if w not in chars]
    tok = Tokenizer(models.Unigram(vocab, unk_id=special.index("<unk>")))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", bos), ("</s>", eos)],
    )
    names = {"pad": "<pad>", "unk": "<unk>", "cls": "<s>", "sep": "</s>", "mask": "<mask>"}
    return tok, names


def _save_tokenizer(tok: Any, names: dict[str, str], out: Path, roberta: bool) -> Any:
    from transformers import PreTrainedTokenizerFast

    inputs = ["input_ids", "attention_mask"]  # XLM-R's: one segment
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_input_names=inputs if roberta else ["input_ids", "token_type_ids", *inputs[1:]],
        **{f"{k}_token": v for k, v in names.items()},
    )
    fast.save_pretrained(out)
    return fast


def write_pooling_files(out: Path, mode: str, normalize: bool) -> None:
    """sentence-transformers' modules.json and 1_Pooling/config.json (``mode``: mean, cls,
    lasttoken)."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize",
             "type": "sentence_transformers.models.Normalize"}
        )  # fmt: skip
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir(exist_ok=True)
    keys = ("mean_tokens", "cls_token", "lasttoken", "max_tokens")
    cfg = {f"pooling_mode_{k}": k.startswith(mode) for k in keys}
    (out / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, **cfg})
    )


def build_tiny_encoder(
    architecture: str, out_dir: str | Path, *, seed: int = 0, **overrides: Any
) -> Path:
    """``BertModel``, ``XLMRobertaModel`` or their ``*ForSequenceClassification`` (one label
    unless ``num_labels`` says otherwise), random weights, saved with its tokenizer."""
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    roberta = architecture.startswith("XLMRoberta")
    tok, names = _xlmr_tokenizer() if roberta else _bert_tokenizer()
    fast = _save_tokenizer(tok, names, out, roberta)
    family = {"pad_token_id": fast.pad_token_id, "vocab_size": tok.get_vocab_size()}
    if roberta:
        family |= {"max_position_embeddings": 130, "type_vocab_size": 1}
    else:
        family |= {"max_position_embeddings": 128, "type_vocab_size": 2}
    if architecture.endswith("ForSequenceClassification"):
        family["num_labels"] = 1
    config_class = transformers.XLMRobertaConfig if roberta else transformers.BertConfig
    config = config_class(**{**SIZES, **family, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config)
    if architecture.endswith("ForSequenceClassification"):
        with torch.no_grad():  # transformers' init is tiny: spread the scores
            for p in model.classifier.parameters():
                p.normal_(0.0, 0.15)
    model.save_pretrained(out, safe_serialization=True)
    return out


def build_tiny_modernbert(
    architecture: str, out_dir: str | Path, *, seed: int = 0, **overrides: Any
) -> Path:
    """``ModernBertModel`` or ``ModernBertForSequenceClassification`` (one label unless
    ``num_labels`` says otherwise): 3 layers, global / sliding / global (a window of 8
    tokens), rotary bases 1000 / 50, norms with biases, random weights, saved with the BERT
    WordPiece tokenizer (``[CLS] a [SEP] b [SEP]``, no segment ids, as ModernBERT's)."""
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok, names = _bert_tokenizer()
    fast = _save_tokenizer(tok, names, out, roberta=True)
    ids = {f"{k}_token_id": fast.convert_tokens_to_ids(names[k]) for k in ("pad", "cls", "sep")}
    family = {
        **SIZES,
        **ids,
        "bos_token_id": ids["cls_token_id"],
        "eos_token_id": ids["sep_token_id"],
        "vocab_size": tok.get_vocab_size(),
        "num_hidden_layers": 3,
        "intermediate_size": 96,
        "max_position_embeddings": 128,
        "local_attention": 8,
        "global_attn_every_n_layers": 2,
        "global_rope_theta": 1000.0,
        "local_rope_theta": 50.0,
        "norm_bias": True,
    }
    if architecture.endswith("ForSequenceClassification"):
        family["num_labels"] = 1
    config = transformers.ModernBertConfig(**{**family, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config)
    with torch.no_grad():  # transformers' init leaves the norms' biases at zero
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(out, safe_serialization=True)
    return out
