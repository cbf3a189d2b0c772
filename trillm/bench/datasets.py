"""Benchmark prompts: random, ShareGPT and prefix-repetition datasets (vLLM's flag names).

Every builder returns ``list[BenchRequest]``. A random prompt is a list of token ids when no
tokenizer is given (the completions endpoint accepts token-id prompts, so its length is exact);
with a tokenizer the ids are decoded to text and re-encoded until the length is exact.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

# Without a tokenizer, random ids are drawn from this range: ordinary (non-special) tokens in
# every vocabulary we target, including the tiny test models (vocab 4096).
NO_TOKENIZER_ID_RANGE = (100, 1000)
# ShareGPT filter, as vLLM: drop pairs too short to measure or too long to serve.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


class DatasetError(ValueError):
    """A dataset cannot be built from what the user gave (missing file, bad format, ...)."""


class TokenizerLike(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(slots=True)
class BenchRequest:
    prompt: str | list[int]  # text, or token ids for the completions endpoint
    prompt_len: int
    expected_output_len: int
    # chat content parts after the text (random-mm's images: image_url data URLs)
    mm_content: tuple[dict[str, Any], ...] = ()

    def content(self) -> str | list[int] | list[dict[str, Any]]:
        """What the request sends: the prompt, or a chat message's parts (text, then items)."""
        if not self.mm_content:
            return self.prompt
        return [{"type": "text", "text": self.prompt}, *self.mm_content]


def sample_range(rng: np.random.Generator, length: int, ratio: float, n: int) -> np.ndarray:
    """n integer lengths in [length*(1-ratio), length*(1+ratio)], at least 1 (vLLM's rule)."""
    if not 0.0 <= ratio < 1.0:
        raise DatasetError(f"--random-range-ratio must be in [0, 1), got {ratio}.")
    low = max(1, int(np.floor(length * (1 - ratio))))
    high = max(low, int(np.ceil(length * (1 + ratio))))
    return rng.integers(low, high + 1, size=n)


def _exact_text(tok: TokenizerLike, ids: list[int], target: int) -> tuple[str, int]:
    """Decode ids to text whose re-encoding is exactly ``target`` tokens where possible."""
    text = tok.decode(ids)
    encoded = tok.encode(text)
    for _ in range(4):
        if len(encoded) == target:
            break
        # NOTE: decode/encode is not a bijection; trim or pad with the re-encoded ids.
        encoded = (
            encoded[:target] if len(encoded) > target else encoded + ids[: target - len(encoded)]
        )
        text = tok.decode(encoded)
        encoded = tok.encode(text)
    return text, len(encoded)


def _random_ids(rng: np.random.Generator, n: int, vocab: tuple[int, int]) -> list[int]:
    return rng.integers(vocab[0], vocab[1], size=n).tolist()


def _vocab_range(tok: TokenizerLike | None) -> tuple[int, int]:
    if tok is None:
        return NO_TOKENIZER_ID_RANGE
    return (min(100, tok.vocab_size // 4), tok.vocab_size)


def _as_prompt(
    tok: TokenizerLike | None, ids: list[int], as_text: bool
) -> tuple[str | list[int], int]:
    if not as_text:
        return ids, len(ids)
    if tok is None:
        raise DatasetError("A text prompt needs a tokenizer: pass --tokenizer PATH.")
    return _exact_text(tok, ids, len(ids))


def build_random(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    *,
    seed: int = 0,
    tokenizer: TokenizerLike | None = None,
    as_text: bool = False,
) -> list[BenchRequest]:
    """Random prompts of ``prefix_len`` shared + ``input_len``(+-ratio) own tokens."""
    rng = np.random.default_rng(seed)
    vocab = _vocab_range(tokenizer)
    in_lens = sample_range(rng, input_len, range_ratio, num_prompts)
    out_lens = sample_range(rng, output_len, range_ratio, num_prompts)
    prefix = _random_ids(rng, prefix_len, vocab)
    requests = []
    for in_len, out_len in zip(in_lens, out_lens):
        ids = prefix + _random_ids(rng, int(in_len), vocab)
        prompt, n = _as_prompt(tokenizer, ids, as_text)
        requests.append(BenchRequest(prompt, n, int(out_len)))
    return requests


def build_prefix_repetition(
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    *,
    seed: int = 0,
    tokenizer: TokenizerLike | None = None,
    as_text: bool = False,
) -> list[BenchRequest]:
    """``num_prefixes`` shared prefixes, each followed by fresh random suffixes, shuffled."""
    if num_prefixes < 1:
        raise DatasetError(f"--prefix-repetition-num-prefixes must be >= 1, got {num_prefixes}.")
    rng = np.random.default_rng(seed)
    vocab = _vocab_range(tokenizer)
    prefixes = [_random_ids(rng, prefix_len, vocab) for _ in range(num_prefixes)]
    requests = []
    for i in range(num_prompts):
        ids = prefixes[i % num_prefixes] + _random_ids(rng, suffix_len, vocab)
        prompt, n = _as_prompt(tokenizer, ids, as_text)
        requests.append(BenchRequest(prompt, n, output_len))
    order = rng.permutation(len(requests))
    return [requests[i] for i in order]


def _first_turns(path: Path) -> list[tuple[str, str]]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise DatasetError(f"ShareGPT file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise DatasetError(f"ShareGPT file {path} is not valid JSON: {e}") from None
    if not isinstance(data, list):
        raise DatasetError(f"ShareGPT file {path} must hold a JSON list of conversations.")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        pairs.append((str(turns[0].get("value", "")), str(turns[1].get("value", ""))))
    return pairs


def build_sharegpt(
    path: str | Path,
    num_prompts: int,
    tokenizer: TokenizerLike,
    *,
    output_len: int | None = None,
    seed: int = 0,
    shuffle: bool = True,
) -> list[BenchRequest]:
    """First human turn as prompt, the reply's token length as output length (vLLM filter);
    ``shuffle`` false (--disable-shuffle): in the file's order."""
    return requests_from_pairs(
        _first_turns(Path(path)), num_prompts, tokenizer, output_len, seed, shuffle, str(path)
    )


def requests_from_pairs(
    pairs: list[tuple[str, str]],
    num_prompts: int,
    tokenizer: TokenizerLike,
    output_len: int | None,
    seed: int,
    shuffle: bool,
    source: str,
) -> list[BenchRequest]:
    """(prompt, reply) pairs as requests, through vLLM's ShareGPT length filter."""
    rng = np.random.default_rng(seed)
    requests = []
    order = rng.permutation(len(pairs)) if shuffle else range(len(pairs))
    for i in order:
        prompt, reply = pairs[int(i)]
        prompt_len = len(tokenizer.encode(prompt))
        out_len = output_len if output_len is not None else len(tokenizer.encode(reply))
        if _sharegpt_keep(prompt_len, out_len, output_len is not None):
            requests.append(BenchRequest(prompt, prompt_len, out_len))
        if len(requests) == num_prompts:
            break
    if not requests:
        raise DatasetError(f"No usable conversations in {source} (after vLLM's length filter).")
    return requests


def _sharegpt_keep(prompt_len: int, output_len: int, fixed_output: bool) -> bool:
    if prompt_len < SHAREGPT_MIN_LEN or (not fixed_output and output_len < SHAREGPT_MIN_LEN):
        return False
    return (
        prompt_len <= SHAREGPT_MAX_PROMPT_LEN and prompt_len + output_len <= SHAREGPT_MAX_TOTAL_LEN
    )


class BenchTokenizer:
    """A local Hugging Face tokenizer: ``tokenizer.json`` through ``tokenizers`` (fast to
    import), else the folder through ``transformers.AutoTokenizer`` (e.g. sentencepiece)."""

    def __init__(
        self, path: str | Path, mode: str = "auto", trust_remote_code: bool = False
    ) -> None:
        folder = Path(path)
        file = folder / "tokenizer.json" if folder.is_dir() else folder
        self.folder = folder if folder.is_dir() else folder.parent
        self.trust_remote_code = trust_remote_code
        self._fast: Any = None
        self._hf: Any = None
        if mode == "slow":  # --tokenizer-mode slow: transformers' Python tokenizer
            self._hf = _auto_tokenizer(self.folder, use_fast=False, trust=trust_remote_code)
            self.vocab_size = len(self._hf)
        elif file.is_file():
            from tokenizers import Tokenizer

            self._fast = Tokenizer.from_file(str(file))
            self.vocab_size = self._fast.get_vocab_size()
        elif folder.is_dir():
            self._hf = _auto_tokenizer(folder, trust=trust_remote_code)
            self.vocab_size = len(self._hf)
        else:
            raise DatasetError(f"Tokenizer folder not found: {path}")

    def special_ids(self) -> set[int]:
        """The ids of the special tokens (a multimodal model's placeholders among them)."""
        if self._fast is not None:
            added = self._fast.get_added_tokens_decoder()
            return {i for i, token in added.items() if token.special}
        return set(self._hf.all_special_ids)

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=False).ids
        return self._hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=False)
        return self._hf.decode(ids, skip_special_tokens=False)

    def apply_chat_template(self, prompt: str) -> str:
        """The prompt as one user turn through the tokenizer's chat template (custom dataset,
        as vLLM renders it for /v1/completions)."""
        hf = self._hf or _auto_tokenizer(self.folder, trust=self.trust_remote_code)
        if not getattr(hf, "chat_template", None):
            raise DatasetError(
                f"The tokenizer in {self.folder} has no chat template; pass "
                "--skip-chat-template to send the prompts as they are."
            )
        messages = [{"role": "user", "content": prompt}]
        return str(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


def _auto_tokenizer(folder: Path, use_fast: bool = True, trust: bool = False) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            str(folder), local_files_only=True, use_fast=use_fast, trust_remote_code=trust
        )
    except (OSError, ValueError) as e:
        raise DatasetError(f"Cannot load a tokenizer from {folder}: {e}") from None


def find_tokenizer(
    tokenizer: str | None, model: str | None, mode: str = "auto", trust_remote_code: bool = False
) -> BenchTokenizer | None:
    """--tokenizer, else --model when it is a local folder holding a tokenizer, else None."""
    if tokenizer is not None:
        return BenchTokenizer(tokenizer, mode, trust_remote_code)
    if model is not None and any(
        (Path(model) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")
    ):
        return BenchTokenizer(model, mode, trust_remote_code)
    return None
