"""``vllm serve`` flags a deployment commonly sets, on ``trillm serve``.

Three kinds, never a flag accepted and ignored in silence:

- honoured with vLLM's meaning: TLS (``--ssl-*``), CORS (``--allowed-*``), ``--root-path``
  (applied to the server by ``entrypoints/openai/http/deployment.py``), ``--download-dir``, request and stats logging, ``--config FILE.yaml`` (and
  ``--enforce-eager``, an EngineArgs field: no step-program replay of small CPU decode steps,
  which ``startup_notes`` logs);
- accepted where trillm has no such mechanism (``--enable-chunked-prefill``,
  ``--swap-space``): what they ask is already so, or means nothing here, and
  ``startup_notes`` says so once in the log;
- refused (argparse error, exit 2) where the feature is not implemented yet: tokenizer modes,
  multimodal input, multi-node data parallelism, the expert-parallel load balancer (EPLB).
  (Quantization methods, KV-cache dtypes, load formats and speculative decoding methods are
  EngineArgs fields: their flags, with the same refusals, come from ``engine_flags.py`` and
  ``flag_types.py``.)
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from trillm.config.scheduler_checks import check_given


def _json_list(value: str) -> list[str]:
    """vLLM's CORS flags take a JSON list, e.g. '["https://a.example"]'."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
        raise argparse.ArgumentTypeError(
            f"expected a JSON list of strings such as '[\"*\"]', got {value!r}"
        )
    return parsed


def _not_implemented(what: str, allowed: str | None = None) -> Any:
    """A ``type=`` that refuses every value but ``allowed`` (the no-op setting)."""

    def check(value: str) -> str:
        if allowed is not None and value.strip() == allowed:
            return allowed
        only = f"; only {allowed} is accepted" if allowed is not None else ""
        raise argparse.ArgumentTypeError(f"{what} is not implemented yet{only}, got {value!r}.")

    return check


class _Refuse(argparse.Action):
    """A switch whose feature is not implemented yet: an argparse error naming it."""

    def __init__(self, option_strings: list[str], dest: str, what: str = "", **kwargs: Any) -> None:
        kwargs.setdefault("nargs", 0)
        super().__init__(option_strings, dest, **kwargs)
        self.what = what

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        parser.error(f"argument {option_string}: {self.what} is not implemented yet.")


def _non_negative_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not number >= 0 or number == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value!r}")
    return number


def _positive_float(value: str) -> float:
    number = _non_negative_float(value)
    if number == 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value!r}")
    return number


def add_http_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("HTTP: TLS, CORS, proxy (vLLM's flags)")
    g.add_argument("--ssl-keyfile", help="TLS private key file (PEM); needs --ssl-certfile.")
    g.add_argument("--ssl-certfile", help="TLS certificate file (PEM): serve HTTPS.")
    g.add_argument("--ssl-ca-certs", help="CA certificates file to verify client certificates.")
    g.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        choices=[0, 1, 2],
        help="Client certificates: 0 none (default), 1 optional, 2 required (Python's "
        "ssl.CERT_* values, as vLLM).",
    )
    g.add_argument(
        "--allowed-origins",
        type=_json_list,
        default=["*"],
        help='CORS: origins allowed, a JSON list (default: ["*"], as vLLM).',
    )
    g.add_argument(
        "--allowed-methods",
        type=_json_list,
        default=["*"],
        help='CORS: methods allowed, a JSON list (default: ["*"]).',
    )
    g.add_argument(
        "--allowed-headers",
        type=_json_list,
        default=["*"],
        help='CORS: request headers allowed, a JSON list (default: ["*"]).',
    )
    g.add_argument(
        "--allow-credentials",
        action="store_true",
        help="CORS: allow credentials (cookies, Authorization) in cross-origin requests.",
    )
    g.add_argument(
        "--uds",
        metavar="PATH",
        help="Serve on a Unix domain socket at PATH instead of --host / --port (a socket file "
        "left there by an earlier server is replaced).",
    )
    g.add_argument(
        "--root-path",
        default="",
        help="The path prefix a path-based routing proxy serves this server under.",
    )
    g.add_argument(
        "--enable-server-load-tracking",
        action="store_true",
        help="Accepted for vLLM compatibility: trillm always tracks the in-flight requests "
        "/load reports.",
    )


def add_logging_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging and metrics")
    g.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="Log one line per request received (prompt truncated to --max-log-len) and "
        "one when it finishes. Off by default: prompts are never logged unless asked.",
    )
    g.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="Do not log requests (the default; vLLM's older flag).",
    )
    g.add_argument(
        "--max-log-len",
        type=int,
        default=256,
        help="Characters of a prompt (and prompt token ids) a request log line shows "
        "(default: 256).",
    )
    g.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="Do not log the periodic stats line (throughput, running/waiting, KV usage, "
        "prefix-cache hit rate).",
    )
    g.add_argument(
        "--log-stats-interval",
        type=_positive_float,
        default=10.0,
        help="Seconds between stats lines; a line is logged only after activity (default: 10).",
    )
    g.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="text (default) or json: one JSON object per log record (time, level, logger, "
        "message, exception). TRILLM_LOGGING_CONFIG_PATH / VLLM_LOGGING_CONFIG_PATH (a "
        "dictConfig JSON file) and TRILLM_CONFIGURE_LOGGING=0 / VLLM_CONFIGURE_LOGGING=0 "
        "take precedence.",
    )
    g.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="No HTTP access log lines, even at --log-level debug.",
    )
    g.add_argument(
        "--metrics-prefix",
        choices=["both", "vllm", "trillm"],
        default="both",
        help="/metrics names: vllm:* (for vLLM's dashboards), trillm:*, or both (default).",
    )


def add_engine_compat_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vLLM engine flags")
    g.add_argument(
        "--api-server-count",
        "-asc",
        type=_not_implemented("more than one API server process", "1"),
        metavar="N",
        help="API server processes: trillm serves HTTP from one process (1, the default); "
        "more are not implemented (refused).",
    )
    g.add_argument(
        "--show-hidden-metrics-for-version",
        metavar="VERSION",
        help="vLLM shows metrics it deprecated after VERSION; trillm hides none, so every "
        "metric is already shown (accepted, said once in the log).",
    )
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="trillm always chunks long prefills within --max-num-batched-tokens; "
        "--no-enable-chunked-prefill is not implemented yet.",
    )
    g.add_argument(
        "--swap-space",
        type=_non_negative_float,
        metavar="GiB",
        help="CPU swap space per GPU in vLLM; trillm preempts by recomputation and never "
        "swaps, so the value is unused (accepted, said once in the log).",
    )
    g.add_argument(
        "--download-dir",
        help="Where hub downloads go and are looked up (default: the Hugging Face cache).",
    )
    g.add_argument(
        "--max-seq-len-to-capture",
        type=int,
        metavar="N",
        help="CUDA-graph capture length in vLLM; trillm captures no graphs (unused, said once).",
    )
    g.add_argument(
        "--disable-custom-all-reduce",
        action="store_true",
        help="Accepted: trillm has no custom all-reduce; torch.distributed's is always used.",
    )
    g.add_argument(
        "--tokenizer-mode",
        type=_not_implemented("tokenizer mode other than auto", "auto"),
        help="auto (the Hugging Face fast tokenizer); slow/mistral/custom are not implemented.",
    )
    # All --data-parallel-size engine cores run on this machine; vLLM's multi-node data
    # parallelism (a core per node, external or hybrid load balancing) is refused by name.
    for flags in (
        ("--data-parallel-size-local", "-dpl"),
        ("--data-parallel-start-rank", "-dpr"),
        ("--data-parallel-address", "-dpa"),
        ("--data-parallel-rpc-port", "-dpp"),
        ("--data-parallel-backend", "-dpb"),
    ):
        g.add_argument(
            *flags,
            type=_not_implemented("multi-node data parallelism"),
            help="Data parallelism across machines is not implemented: refused "
            "(--data-parallel-size runs every engine core on this machine).",
        )
    for flag in ("--data-parallel-hybrid-lb", "--data-parallel-external-lb"):
        g.add_argument(
            flag,
            action=_Refuse,
            what="multi-node data parallelism (load balancing outside this server)",
            help="Not implemented: refused.",
        )
    _add_expert_parallel_refusals(g)


def _add_expert_parallel_refusals(g: argparse._ArgumentGroup) -> None:
    """--enable-expert-parallel places the experts linearly (rank r: the r-th block) and
    exchanges tokens with torch.distributed's all-to-all; vLLM's load balancer (EPLB), which
    moves and replicates experts by load, and its other all-to-all kernels are refused."""
    eplb = "the expert-parallel load balancer (EPLB)"
    g.add_argument("--enable-eplb", action=_Refuse, what=eplb, help="Not implemented: refused.")
    for flag in ("--eplb-config", "--num-redundant-experts", "--all2all-backend"):
        what = eplb if flag != "--all2all-backend" else "choosing the experts' all-to-all kernel"
        g.add_argument(flag, type=_not_implemented(what), help="Not implemented: refused.")
    g.add_argument(
        "--expert-placement-strategy",
        type=_not_implemented("expert placements other than linear", allowed="linear"),
        help="linear (rank r holds the r-th block of experts) is the one accepted.",
    )


def check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Cross-flag checks argparse cannot express (exit 2 with the flag named)."""
    if args.enable_chunked_prefill is False:
        parser.error(
            "argument --no-enable-chunked-prefill: turning chunked prefill off is not "
            "implemented yet; trillm always chunks long prefills."
        )
    try:  # the scheduler's and cache's values given (the engine checks the limits again, resolved)
        check_given(vars(args))
    except ValueError as exc:
        parser.error(str(exc))
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        parser.error("--ssl-keyfile and --ssl-certfile go together.")
    if (args.ssl_ca_certs or args.ssl_cert_reqs) and not args.ssl_certfile:
        parser.error(
            "--ssl-ca-certs / --ssl-cert-reqs verify clients of an HTTPS server: they "
            "need --ssl-keyfile and --ssl-certfile."
        )
    for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(args, name)
        if path and not Path(path).is_file():
            parser.error(f"argument --{name.replace('_', '-')}: no such file {path!r}.")
    if args.uds and (args.host, args.port) != (
        parser.get_default("host"),
        parser.get_default("port"),
    ):
        parser.error(
            "argument --uds: the server listens on the socket file only; drop --host / --port."
        )
    if args.root_path and not args.root_path.startswith("/"):
        parser.error(f"argument --root-path: must start with '/', got {args.root_path!r}.")
    if args.enable_log_requests and args.disable_log_requests:
        parser.error("--enable-log-requests and --disable-log-requests contradict each other.")
    if args.max_log_len < 0:
        parser.error(f"argument --max-log-len: expected an integer >= 0, got {args.max_log_len}.")


def startup_notes(args: argparse.Namespace) -> list[str]:
    """What the accepted-but-moot flags do here: logged once at startup, never silent."""
    notes = []
    if args.enable_chunked_prefill:
        notes.append(
            "--enable-chunked-prefill: trillm always chunks long prefills (within "
            "--max-num-batched-tokens); nothing to change."
        )
    if args.enforce_eager:
        notes.append(
            "--enforce-eager: small CPU decode steps run eagerly (no step-program "
            "replay, trillm's counterpart of CUDA graphs)."
        )
    if args.swap_space is not None:
        notes.append(
            f"--swap-space {args.swap_space:g}: trillm preempts by recomputation and "
            "never swaps KV blocks to CPU memory; the value is unused."
        )
    if args.disable_log_requests:
        notes.append("--disable-log-requests: requests are not logged (the default).")
    if args.max_seq_len_to_capture is not None:
        notes.append(
            "--max-seq-len-to-capture: trillm captures no CUDA graphs; the value is unused."
        )
    if args.disable_custom_all_reduce:
        notes.append(
            "--disable-custom-all-reduce: trillm has no custom all-reduce "
            "(torch.distributed's is always used); nothing to change."
        )
    if args.show_hidden_metrics_for_version is not None:
        notes.append(
            f"--show-hidden-metrics-for-version {args.show_hidden_metrics_for_version}: "
            "trillm hides no metrics; all of them are on /metrics."
        )
    if args.enable_server_load_tracking:
        notes.append(
            "--enable-server-load-tracking: /load always reports the in-flight requests in trillm."
        )
    return notes


def apply_download_dir(download_dir: str | None) -> None:
    """--download-dir: the hub cache this process and its workers download to and read from
    (vLLM passes it as snapshot_download's cache_dir; the hub cache is the same layout)."""
    if not download_dir:
        return
    path = str(Path(download_dir).expanduser().resolve())
    os.makedirs(path, exist_ok=True)
    os.environ["HF_HUB_CACHE"] = path  # workers and anything importing the hub later
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_CACHE = path  # read at call time by snapshot_download
