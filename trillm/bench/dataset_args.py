"""``trillm bench serve``'s dataset flags -> its prompts (``build_dataset``): random,
random-mm (``mm_dataset.py``) and prefix-repetition built here, sharegpt / custom / hf from
files, shuffled unless --disable-shuffle and oversampled to --num-prompts unless
--no-oversample (vLLM's rules)."""

from __future__ import annotations

import argparse

from trillm.bench import datasets
from trillm.bench.file_datasets import build_custom, build_hf, oversample
from trillm.bench.mm_dataset import build_random_mm


def build_dataset(
    args: argparse.Namespace, tokenizer: datasets.BenchTokenizer | None, chat: bool
) -> list[datasets.BenchRequest]:
    # NOTE: the chat endpoint takes text only; completions takes token ids when no tokenizer.
    as_text = chat or tokenizer is not None
    common = dict(seed=args.seed, tokenizer=tokenizer, as_text=as_text)
    if args.dataset_name == "random":
        return datasets.build_random(
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.random_prefix_len,
            **common,
        )
    if args.dataset_name == "random-mm":
        return build_random_mm(args, tokenizer, chat)
    if args.dataset_name == "prefix-repetition":
        return datasets.build_prefix_repetition(
            args.num_prompts,
            args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len,
            **common,
        )
    return build_file_dataset(args, tokenizer, chat)


def build_file_dataset(
    args: argparse.Namespace, tokenizer: datasets.BenchTokenizer | None, chat: bool
) -> list[datasets.BenchRequest]:
    """sharegpt, custom and hf: prompts from files, shuffled unless --disable-shuffle, and
    repeated (sampled again) up to --num-prompts unless --no-oversample (vLLM's rules)."""
    name = args.dataset_name
    if args.dataset_path is None:
        raise datasets.DatasetError(f"--dataset-name {name} needs --dataset-path.")
    if tokenizer is None:
        raise datasets.DatasetError(
            f"--dataset-name {name} needs a tokenizer: pass --tokenizer PATH."
        )
    shuffle = not args.disable_shuffle
    if name == "sharegpt":
        requests = datasets.build_sharegpt(
            args.dataset_path,
            args.num_prompts,
            tokenizer,
            output_len=args.sharegpt_output_len,
            seed=args.seed,
            shuffle=shuffle,
        )
    elif name == "custom":
        template = not (args.skip_chat_template or chat)  # a chat endpoint renders it itself
        requests = build_custom(
            args.dataset_path,
            args.num_prompts,
            tokenizer,
            args.custom_output_len,
            chat_template=template,
            seed=args.seed,
            shuffle=shuffle,
        )
    else:
        requests = build_hf(
            args.dataset_path,
            args.num_prompts,
            tokenizer,
            output_len=args.hf_output_len,
            subset=args.hf_subset,
            split=args.hf_split,
            name=args.hf_name,
            seed=args.seed,
            shuffle=shuffle,
        )
    if args.no_oversample:
        return requests
    return oversample(requests, args.num_prompts, args.seed)
