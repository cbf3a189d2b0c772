"""The rest of ``vllm bench serve``'s flags for ``trillm bench serve``, with vLLM's meanings:
request shaping (headers, extra body, request ids, sampling, logprobs, LoRA names), warm-up,
ramp-up, result files (label, metadata, detailed, append), plots, the file datasets (custom,
hf, their output lengths, shuffling, oversampling) and the tokenizer options.

Flags whose mechanism trillm does not have (the server profiler, embedding datasets, ...)
are still registered so that using one stops at once with an argparse error that says why
(``REFUSED``), never a silent no-op.
"""

from __future__ import annotations

import argparse
import json
import math
import uuid
from typing import Any

# The random-mm dataset's defaults (vLLM's), as its flags take them (``mm_dataset.py`` parses
# them): here, so that building the parser does not import numpy.
DEFAULT_LIMITS = '{"image": 255, "video": 0}'
DEFAULT_BUCKETS = "{(256, 256, 1): 0.5, (720, 1280, 1): 0.5, (720, 1280, 16): 0.0}"
# flag -> why trillm bench serve cannot honour it (the argparse error's text)
REFUSED = {
    "--profile": "trillm serve has no /start_profile and /stop_profile endpoints",
    "--probe-request-rate": "probe requests beside the workload are not implemented",
    "--self-timed": "trace replay (timed_trace) is not implemented",
    "--chat-template-kwargs": "no dataset here renders a chat template with extra kwargs",
    "--random-batch-size": "embedding benchmarks are not implemented (no embeddings endpoint)",
    "--no-reranker": "reranker benchmarks are not implemented (no rerank endpoint)",
    "--blazedit-min-distance": "the blazedit dataset (Hugging Face Hub) is not available offline",
    "--blazedit-max-distance": "the blazedit dataset (Hugging Face Hub) is not available offline",
    "--spec-bench-output-len": "the spec_bench dataset is not implemented",
    "--spec-bench-category": "the spec_bench dataset is not implemented",
    "--sonnet-input-len": "the sonnet dataset is not implemented",
    "--sonnet-output-len": "the sonnet dataset is not implemented",
    "--sonnet-prefix-len": "the sonnet dataset is not implemented",
}
TOKENIZER_MODES = ("auto", "hf", "slow")
RAMP_UP_STRATEGIES = ("linear", "exponential")


class _Refuse(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        kwargs.pop("nargs", None)
        super().__init__(option_strings, dest, nargs="?", **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: Any,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        flag = option_string or self.option_strings[0]
        parser.error(f"{flag} is not supported by trillm bench serve: {REFUSED[flag]}.")


def add_flags(p: argparse.ArgumentParser) -> None:
    """Register the flags (the sampling and dataset groups beside the existing ones)."""
    p.add_argument(
        "--label", default=None, help="prefix of the result file name (default: --backend)"
    )
    p.add_argument(
        "--header",
        metavar="KEY=VALUE",
        nargs="*",
        default=None,
        help="headers sent with every request",
    )
    p.add_argument(
        "--input-len",
        type=int,
        default=None,
        help="the dataset's input length (--random-input-len)",
    )
    p.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="the dataset's output length (--random-output-len, --custom-output-len, "
        "--hf-output-len, --sharegpt-output-len, --prefix-repetition-output-len)",
    )
    p.add_argument(
        "--num-warmups",
        type=int,
        default=0,
        help="requests sent (and not measured) before the benchmark",
    )
    p.add_argument(
        "--save-detailed",
        action="store_true",
        help="keep the per-request lists (ttfts, itls, texts, errors) in the result",
    )
    p.add_argument(
        "--append-result",
        action="store_true",
        help="append the result to the result file (one JSON object a line)",
    )
    p.add_argument(
        "--metadata", metavar="KEY=VALUE", nargs="*", default=None, help="saved in the result JSON"
    )
    p.add_argument(
        "--request-id-prefix",
        default=f"bench-{uuid.uuid4().hex[:8]}-",
        help="request ids are PREFIX + index (x-request-id header and request_id)",
    )
    p.add_argument(
        "--extra-body",
        type=json.loads,
        default=None,
        help="a JSON object merged into every request body",
    )
    p.add_argument("--logprobs", type=int, default=None, help="logprobs per token to request")
    p.add_argument(
        "--use-beam-search",
        action="store_true",
        help="send use_beam_search: true (greedy beams; the server answers when they end)",
    )
    p.add_argument("--ramp-up-strategy", choices=RAMP_UP_STRATEGIES, default=None)
    p.add_argument("--ramp-up-start-rps", type=int, default=None)
    p.add_argument("--ramp-up-end-rps", type=int, default=None)
    p.add_argument(
        "--ready-check-timeout-sec",
        type=int,
        default=0,
        help="wait up to this long for the server to answer (0: no wait)",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        help="model names (LoRA adapters) sent as 'model', one per request",
    )
    p.add_argument("--lora-assignment", choices=["random", "round-robin"], default="random")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="do not verify TLS certificates (with --http-client httpx)",
    )
    p.add_argument(
        "--plot-timeline",
        action="store_true",
        help="an HTML timeline of the requests next to the result JSON",
    )
    p.add_argument(
        "--timeline-itl-thresholds",
        default="25,50",
        help="two ITL thresholds (ms) that color the timeline",
    )
    p.add_argument(
        "--plot-dataset-stats",
        action="store_true",
        help="a PNG of the dataset's prompt and output lengths next to the result",
    )
    p.add_argument("--tokenizer-mode", choices=TOKENIZER_MODES, default="auto")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="load no tokenizer (token-id prompts; output tokens from usage)",
    )
    s = p.add_argument_group("sampling parameters (beside --temperature --top-p --top-k)")
    for flag in ("--min-p", "--frequency-penalty", "--presence-penalty", "--repetition-penalty"):
        s.add_argument(flag, type=float, default=None)
    _add_random_mm_flags(p)
    d = p.add_argument_group("file datasets (sharegpt, custom, hf)")
    d.add_argument(
        "--no-oversample",
        action="store_true",
        help="fewer prompts than --num-prompts when the file has fewer",
    )
    d.add_argument("--disable-shuffle", action="store_true", help="the file's order")
    d.add_argument(
        "--skip-chat-template",
        action="store_true",
        help="custom dataset: send the prompt as is to /v1/completions",
    )
    d.add_argument(
        "--no-stream", action="store_true", help="load the dataset whole (always so: local files)"
    )
    d.add_argument("--custom-output-len", type=int, default=256)
    d.add_argument("--hf-subset", default=None, help="a sub-folder of --dataset-path")
    d.add_argument("--hf-split", default=None, help="the data files whose name starts so")
    d.add_argument("--hf-name", default=None, help="the dataset id when the path is local")
    d.add_argument("--hf-output-len", type=int, default=None)
    for flag in REFUSED:
        p.add_argument(flag, action=_Refuse, help=argparse.SUPPRESS)


def _add_random_mm_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's random-mm dataset (``mm_dataset.py``): its flags and defaults."""
    g = p.add_argument_group("random-mm dataset (random prompts with random images)")
    g.add_argument("--random-mm-base-items-per-request", type=int, default=1)
    g.add_argument(
        "--random-mm-num-mm-items-range-ratio",
        type=float,
        default=0.0,
        help="items a request within this ratio of the base, in [0, 1]",
    )
    g.add_argument(
        "--random-mm-limit-mm-per-prompt",
        default=DEFAULT_LIMITS,
        help="JSON: the most items of each modality a request carries",
    )
    g.add_argument(
        "--random-mm-bucket-config",
        default=DEFAULT_BUCKETS,
        help="(height, width, frames) -> probability; one frame: an image (videos refused)",
    )


def _pairs(items: list[str] | None, flag: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"Invalid {flag} {item!r}: use KEY=VALUE.")
        out[key.strip()] = value.strip()
    return out


def check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """vLLM's checks of the combinations (argparse errors), then the length aliases."""
    try:
        args.headers = _pairs(args.header, "--header")
        args.metadata_pairs = _pairs(args.metadata, "--metadata")
        args.itl_thresholds = _thresholds(args.timeline_itl_thresholds)
    except ValueError as e:
        p.error(str(e))
    if args.num_warmups < 0:
        p.error(f"--num-warmups must be >= 0, got {args.num_warmups}.")
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        p.error("--extra-body must be a JSON object.")
    if args.logprobs is not None and args.logprobs < 0:
        p.error(f"--logprobs must be >= 0, got {args.logprobs}.")
    _check_ramp_up(p, args)
    if args.dataset_name == "prefix_repetition":  # vLLM's spelling
        args.dataset_name = "prefix-repetition"
    _apply_lengths(p, args)


def _thresholds(text: str) -> tuple[float, float]:
    try:
        values = [float(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"Invalid --timeline-itl-thresholds {text!r}.") from None
    if len(values) != 2:
        raise ValueError(f"--timeline-itl-thresholds takes two values, got {text!r}.")
    return values[0], values[1]


def _check_ramp_up(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.ramp_up_strategy is None:
        if args.ramp_up_start_rps is not None or args.ramp_up_end_rps is not None:
            p.error("--ramp-up-start-rps/--ramp-up-end-rps need --ramp-up-strategy.")
        return
    if args.request_rate != [float("inf")]:
        p.error("With --ramp-up-strategy the ramp sets the rate: remove --request-rate.")
    start, end = args.ramp_up_start_rps, args.ramp_up_end_rps
    if start is None or end is None:
        p.error("--ramp-up-strategy needs --ramp-up-start-rps and --ramp-up-end-rps.")
    if start < 0 or end <= 0 or start > end:
        p.error(f"The ramp must go from a rate >= 0 up to a rate > 0, got {start} -> {end}.")
    if args.ramp_up_strategy == "exponential" and start == 0:
        p.error("An exponential ramp cannot start at 0 req/s.")


def _apply_lengths(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--input-len / --output-len set the chosen dataset's own length flags (vLLM's rule)."""
    name = args.dataset_name
    if args.input_len is not None:
        if name != "random":
            p.error(f"--input-len does not apply to --dataset-name {name} (its prompts set it).")
        args.random_input_len = args.input_len
    if args.output_len is not None:
        target = {
            "random": "random_output_len",
            "sharegpt": "sharegpt_output_len",
            "custom": "custom_output_len",
            "hf": "hf_output_len",
            "prefix-repetition": "prefix_repetition_output_len",
        }[name]
        setattr(args, target, args.output_len)


def parse_rates(text: str) -> list[float]:
    """'4' or '1,2,4,inf' -> [1.0, 2.0, 4.0, inf]."""
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid request rate {text!r}: use a number, inf, or a comma list like 1,2,inf"
        ) from None
    if not rates or any(r <= 0 or math.isnan(r) for r in rates):
        raise argparse.ArgumentTypeError(f"request rates must be positive or inf, got {text!r}")
    return rates


def parse_percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid percentile list {text!r}") from None
    if not values or any(not 0 < p <= 100 for p in values):
        raise argparse.ArgumentTypeError(f"percentiles must be in (0, 100], got {text!r}")
    return values
