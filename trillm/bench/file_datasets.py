"""The file datasets beside ShareGPT: ``custom`` (JSONL) and ``hf`` (a Hugging Face dataset's
files on disk; nothing is downloaded), and vLLM's oversampling to --num-prompts.

- custom: one JSON object a line with a ``prompt``; each asks for --custom-output-len tokens.
  For /v1/completions the prompt goes through the tokenizer's chat template as one user turn
  (vLLM's default) unless --skip-chat-template; a chat endpoint renders it server-side.
- hf: the ShareGPT-format conversation datasets (rows with ``conversations``), read from
  ``.json`` / ``.jsonl`` files under --dataset-path (--hf-subset: a sub-folder, --hf-split: the
  files whose name starts with it). --hf-name must be one of ``CONVERSATION_DATASETS`` when
  given; other datasets' row formats are not implemented and are refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from trillm.bench.datasets import (
    BenchRequest,
    BenchTokenizer,
    DatasetError,
    requests_from_pairs,
)

# vLLM's ConversationDataset ids: ShareGPT-format rows ({"conversations": [{"from", "value"}]}).
CONVERSATION_DATASETS = (
    "Aeala/ShareGPT_Vicuna_unfiltered",
    "anon8231489123/ShareGPT_Vicuna_unfiltered",
    "RyokoAI/ShareGPT52K",
)
_DATA_SUFFIXES = (".json", ".jsonl")


def oversample(requests: list[BenchRequest], num_prompts: int, seed: int) -> list[BenchRequest]:
    """vLLM's rule: a dataset with fewer prompts than --num-prompts is filled up with prompts
    drawn from it again (with replacement)."""
    missing = num_prompts - len(requests)
    if missing <= 0 or not requests:
        return requests
    rng = np.random.default_rng(seed + 1)
    extra = [requests[int(i)] for i in rng.integers(len(requests), size=missing)]
    return requests + extra


def _json_lines(path: Path) -> list[Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise DatasetError(f"Dataset file not found: {path}") from None
    if path.suffix == ".json" or text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path} is not valid JSON: {e}") from None
        return data if isinstance(data, list) else [data]
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path} line {number} is not valid JSON: {e}") from None
    return rows


def build_custom(
    path: str | Path,
    num_prompts: int,
    tokenizer: BenchTokenizer,
    output_len: int,
    *,
    chat_template: bool,
    seed: int = 0,
    shuffle: bool = True,
) -> list[BenchRequest]:
    if output_len < 1:
        raise DatasetError(f"--custom-output-len must be at least 1, got {output_len}.")
    rows = _json_lines(Path(path))
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise DatasetError(f"{path} entry {number} has no 'prompt' string.")
    order = np.random.default_rng(seed).permutation(len(rows)) if shuffle else range(len(rows))
    requests = []
    for i in list(order)[:num_prompts]:
        prompt = rows[int(i)]["prompt"]
        if chat_template:
            prompt = tokenizer.apply_chat_template(prompt)
        requests.append(BenchRequest(prompt, len(tokenizer.encode(prompt)), output_len))
    if not requests:
        raise DatasetError(f"{path} holds no prompts.")
    return requests


def _data_files(path: Path, subset: str | None, split: str | None) -> list[Path]:
    root = path / subset if subset else path
    if not root.exists():
        raise DatasetError(
            f"hf datasets are read from files on disk only (no download): {root} does not exist."
        )
    if root.is_file():
        return [root]
    files = sorted(
        f
        for f in root.rglob("*")
        if f.is_file()
        and f.suffix in _DATA_SUFFIXES
        and (split is None or f.name.startswith(split))
    )
    if not files:
        other = sorted(f.suffix for f in root.rglob("*") if f.suffix in (".parquet", ".arrow"))
        hint = " (Parquet/Arrow files need pyarrow, which is not used here)" if other else ""
        where = f" starting with {split!r}" if split else ""
        raise DatasetError(f"No .json/.jsonl data files{where} under {root}{hint}.")
    return files


def build_hf(
    path: str | Path,
    num_prompts: int,
    tokenizer: BenchTokenizer,
    *,
    output_len: int | None,
    subset: str | None,
    split: str | None,
    name: str | None,
    seed: int = 0,
    shuffle: bool = True,
) -> list[BenchRequest]:
    if name is not None and name not in CONVERSATION_DATASETS:
        raise DatasetError(
            f"--hf-name {name!r}: only the ShareGPT-format conversation datasets are "
            f"implemented ({', '.join(CONVERSATION_DATASETS)})."
        )
    pairs = []
    for file in _data_files(Path(path), subset, split):
        for row in _json_lines(file):
            turns = row.get("conversations") if isinstance(row, dict) else None
            if not isinstance(turns, list):
                raise DatasetError(
                    f"{file}: rows without 'conversations' (ShareGPT format); other Hugging "
                    "Face dataset formats are not implemented."
                )
            if len(turns) >= 2:
                pairs.append((str(turns[0].get("value", "")), str(turns[1].get("value", ""))))
    return requests_from_pairs(pairs, num_prompts, tokenizer, output_len, seed, shuffle, str(path))
