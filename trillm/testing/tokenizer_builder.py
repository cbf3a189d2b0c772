"""Train the project's byte-level BPE tokenizer (Qwen2's split regex, ChatML special tokens).

It is trained once on local text and shipped in ``trillm/default_model/``; tests and the
embedded default model both use the shipped files, so nothing here runs at test time. Run
``python -m trillm.testing.tokenizer_builder`` to rebuild it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# Qwen2's pre-tokenizer regex: transformers 5 rebuilds a qwen2 tokenizer's pre-tokenizer from
# it, so training with the same split keeps token ids identical whichever loader is used.
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
VOCAB_SIZE = 4096
DEFAULT_CORPUS = "/usr/share/common-licenses"


def corpus_files(root: str = DEFAULT_CORPUS) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(root):
        for name in sorted(names):
            path = os.path.join(dirpath, name)
            if os.path.isfile(path) and not os.path.islink(path):
                out.append(path)
    return sorted(out)


def train_tokenizer(files: list[str], vocab_size: int = VOCAB_SIZE):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Sprinkle in non-ASCII text so merges over multi-byte UTF-8 exist (CJK, accents, emoji).
    extra = "naïve café déjà vu — 你好，世界。日本語のテキスト 🙂🚀 Ünïcödé ñandú ".split()
    tok.train_from_iterator(_iter_text(files, extra), trainer=trainer)
    return tok


def _iter_text(files: list[str], extra: list[str]):
    for path in files:
        with open(path, encoding="utf-8", errors="ignore") as f:
            yield f.read()
    for _ in range(50):
        yield " ".join(extra)


def write_tokenizer_files(tok, out_dir: str | Path) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 32768,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t in SPECIAL_TOKENS
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE + "\n")


def main() -> None:
    here = Path(__file__).resolve().parent.parent / "default_model"
    tok = train_tokenizer(corpus_files())
    write_tokenizer_files(tok, here)
    print(f"wrote {here}/tokenizer.json with {tok.get_vocab_size()} tokens")


if __name__ == "__main__":
    main()
