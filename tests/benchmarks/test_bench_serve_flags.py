"""``trillm bench serve``'s vLLM flags beyond the basic ones: each checked on what the client
sends (the stub server records every body and header), on the result files it writes, or on
its argparse refusal; and the count of ``vllm bench serve``'s flags this parser honours.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from bench_stub import MODEL, REPO, StubServer, bench_env, common_args, load, run_bench
from server_harness import free_port

TOKENIZER = str(REPO / "trillm" / "default_model")

# ``vllm bench serve``'s flags: its serve.py ``add_cli_args`` and its dataset parser
# (``add_dataset_parser``), without the flags of later versions (probe requests, trace replay).
VLLM_FLAGS = (
    # dataset parser
    "--seed --num-prompts --dataset-name --no-stream --dataset-path --no-oversample "
    "--skip-chat-template --disable-shuffle --custom-output-len --spec-bench-output-len "
    "--spec-bench-category --sonnet-input-len --sonnet-output-len --sonnet-prefix-len "
    "--sharegpt-output-len --blazedit-min-distance --blazedit-max-distance --random-input-len "
    "--random-output-len --random-range-ratio --random-prefix-len --random-batch-size "
    "--no-reranker --random-mm-base-items-per-request --random-mm-num-mm-items-range-ratio "
    "--random-mm-limit-mm-per-prompt --random-mm-bucket-config --hf-subset --hf-split "
    "--hf-name --hf-output-len --prefix-repetition-prefix-len --prefix-repetition-suffix-len "
    "--prefix-repetition-num-prefixes --prefix-repetition-output-len "
    # serve.py
    "--label --backend --base-url --host --port --endpoint --header --max-concurrency --model "
    "--input-len --output-len --tokenizer --tokenizer-mode --use-beam-search --logprobs "
    "--request-rate --burstiness --disable-tqdm --num-warmups --profile --save-result "
    "--save-detailed --append-result --metadata --result-dir --result-filename --ignore-eos "
    "--percentile-metrics --metric-percentiles --goodput --request-id-prefix --top-p --top-k "
    "--min-p --temperature --frequency-penalty --presence-penalty --repetition-penalty "
    "--served-model-name --lora-modules --ramp-up-strategy --ramp-up-start-rps "
    "--ramp-up-end-rps --ready-check-timeout-sec --extra-body --skip-tokenizer-init --insecure "
    "--plot-timeline --timeline-itl-thresholds --plot-dataset-stats --trust-remote-code"
).split()


def _serve_parser():
    import argparse

    from trillm.bench.cli import add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p


def parse_error(flags: list[str], capsys) -> str:
    """The argparse error (exit code 2) ``trillm bench serve FLAGS`` stops with, in-process."""
    from trillm.bench import serve_flags

    parser = _serve_parser()
    with pytest.raises(SystemExit) as info:
        args = parser.parse_args(flags)
        serve_flags.check(parser, args)
    assert info.value.code == 2
    return capsys.readouterr().err


def test_vllm_flag_count_and_the_refused_ones():
    from trillm.bench.serve_flags import REFUSED

    ours = {o for a in _serve_parser()._actions for o in a.option_strings}
    honoured = [f for f in VLLM_FLAGS if f in ours and f not in REFUSED]
    missing = [f for f in VLLM_FLAGS if f not in ours]
    refused = [f for f in VLLM_FLAGS if f in REFUSED]
    print(
        f"vllm bench serve flags honoured: {len(honoured)}/{len(VLLM_FLAGS)}; "
        f"refused: {refused}; missing: {missing}"
    )
    assert len(VLLM_FLAGS) == 86 and len(set(VLLM_FLAGS)) == 86
    assert not missing  # every one is honoured or refused with a reason
    assert len(honoured) >= 69


def test_request_shaping_flags_reach_every_body(tmp_path: Path) -> None:
    n = 4
    with StubServer(models=(MODEL, "lora-a", "lora-b")) as stub:
        proc = run_bench(
            [
                *common_args(stub.url, tmp_path, n, 2),
                "--header",
                "X-Team=ml",
                "Y=2",
                "--extra-body",
                '{"foo": 1, "temperature": 0.5}',
                "--request-id-prefix",
                "rq-",
                "--top-p",
                "0.9",
                "--top-k",
                "5",
                "--min-p",
                "0.1",
                "--temperature",
                "0.7",
                "--frequency-penalty",
                "0.2",
                "--presence-penalty",
                "0.3",
                "--repetition-penalty",
                "1.1",
                "--logprobs",
                "2",
                "--num-warmups",
                "3",
                "--lora-modules",
                "lora-a",
                "lora-b",
                "--lora-assignment",
                "round-robin",
                "--max-concurrency",
                "1",
            ]
        )
        bodies, headers = stub.bodies, stub.headers
    assert proc.returncode == 0, proc.output
    assert len(bodies) == 1 + 3 + n  # the test request, --num-warmups, the benchmark
    assert load(tmp_path / "r.json")["completed"] == n  # warm-ups are not measured
    timed, timed_headers = bodies[4:], headers[4:]
    assert sorted(b["request_id"] for b in timed) == [f"rq-{i}" for i in range(n)]
    assert sorted(h["x-request-id"] for h in timed_headers) == [f"rq-{i}" for i in range(n)]
    assert all("request_id" not in b for b in bodies[:4])  # only measured requests are named
    assert all(h["x-team"] == "ml" and h["y"] == "2" for h in headers)
    for b in bodies:
        assert (b["top_p"], b["top_k"], b["min_p"]) == (0.9, 5, 0.1)
        assert (b["frequency_penalty"], b["presence_penalty"], b["repetition_penalty"]) == (
            0.2,
            0.3,
            1.1,
        )
        assert b["temperature"] == 0.5 and b["foo"] == 1  # --extra-body is merged last
        assert b["logprobs"] == 2
    by_id = {b["request_id"]: b["model"] for b in timed}
    assert [by_id[f"rq-{i}"] for i in range(n)] == ["lora-a", "lora-b"] * 2


def test_use_beam_search_reaches_every_body(tmp_path: Path) -> None:
    with StubServer(models=(MODEL,)) as stub:
        proc = run_bench([*common_args(stub.url, tmp_path, 2, 2), "--use-beam-search"])
        bodies = stub.bodies
    assert proc.returncode == 0, proc.output
    assert bodies and all(b["use_beam_search"] is True for b in bodies)


def test_chat_logprobs_and_random_lora_choice(tmp_path: Path) -> None:
    with StubServer(models=("x", "y")) as stub:
        proc = run_bench(
            [
                *common_args(stub.url, tmp_path, 12, 2),
                "--backend",
                "openai-chat",
                "--tokenizer",
                TOKENIZER,
                "--logprobs",
                "3",
                "--lora-modules",
                "x",
                "y",
                "--model",
                "x",
            ]
        )
        bodies = stub.bodies
    assert proc.returncode == 0, proc.output
    assert all(b["logprobs"] is True and b["top_logprobs"] == 3 for b in bodies)
    assert {b["model"] for b in bodies[1:]} == {"x", "y"}  # random: both drawn in 12


def test_input_and_output_len_set_the_dataset_lengths(tmp_path: Path, capsys) -> None:
    with StubServer() as stub:
        args = [*common_args(stub.url, tmp_path, 3, 9), "--input-len", "8", "--output-len", "3"]
        proc = run_bench(args)
        bodies = stub.bodies[1:]
    assert proc.returncode == 0, proc.output
    assert load(tmp_path / "r.json")["input_lens"] == [8, 8, 8]
    assert [b["max_tokens"] for b in bodies] == [3, 3, 3] and len(bodies[0]["prompt"]) == 8
    assert "--input-len does not apply" in parse_error(
        ["--dataset-name", "sharegpt", "--input-len", "8"], capsys
    )


def test_ramp_up_schedule_and_its_checks(tmp_path: Path, capsys) -> None:
    from trillm.bench.serve import ramp_offsets

    rng = np.random.default_rng(0)
    offsets = ramp_offsets(2001, "linear", 1, 100, 1e6, rng)  # burstiness huge: exact gaps
    gaps = np.diff(offsets)
    assert gaps[0] == pytest.approx(1 / (1 + 99 / 2000), rel=1e-2)  # the rate starts near 1
    assert gaps[-1] == pytest.approx(1 / 100, rel=1e-2)  # and ends at 100 req/s
    exp = np.diff(ramp_offsets(3, "exponential", 2, 8, 1e6, rng))
    assert exp == pytest.approx([1 / 4, 1 / 8], rel=1e-2)  # 2 * 4**0.5, 2 * 4**1
    with StubServer() as stub:
        args = common_args(stub.url, tmp_path, 6, 2)
        args = args[: args.index("--result-filename")] + args[args.index("--save-result") :]
        proc = run_bench(
            [
                *args,
                "--ramp-up-strategy",
                "linear",
                "--ramp-up-start-rps",
                "5",
                "--ramp-up-end-rps",
                "50",
            ]
        )
    assert proc.returncode == 0, proc.output
    (path,) = tmp_path.glob("openai-ramp-up-linear-5qps-50qps-*.json")
    r = load(path)
    assert (r["ramp_up_strategy"], r["ramp_up_start_rps"], r["ramp_up_end_rps"]) == (
        "linear",
        5,
        50,
    )
    for bad, message in (
        (["--ramp-up-strategy", "linear"], "needs --ramp-up-start-rps"),
        (
            [
                "--ramp-up-strategy",
                "linear",
                "--ramp-up-start-rps",
                "1",
                "--ramp-up-end-rps",
                "2",
                "--request-rate",
                "3",
            ],
            "remove --request-rate",
        ),
        (
            [
                "--ramp-up-strategy",
                "exponential",
                "--ramp-up-start-rps",
                "0",
                "--ramp-up-end-rps",
                "2",
            ],
            "cannot start at 0",
        ),
        (["--ramp-up-start-rps", "1"], "need --ramp-up-strategy"),
    ):
        assert message in parse_error(bad, capsys)


def test_result_files_label_metadata_append_and_detail(tmp_path: Path, capsys) -> None:
    with StubServer() as stub:
        base = [
            "--base-url",
            stub.url,
            "--num-prompts",
            "2",
            "--random-input-len",
            "4",
            "--random-output-len",
            "2",
            "--result-dir",
            str(tmp_path),
            "--disable-tqdm",
        ]
        proc = run_bench([*base, "--save-result", "--label", "mylab"])
        assert proc.returncode == 0, proc.output
        (labelled,) = tmp_path.glob("mylab-infqps-*.json")
        r = load(labelled)
        assert r["label"] == "mylab" and "ttfts" not in r and "errors" not in r  # no detail
        for _ in range(2):
            proc = run_bench(
                [
                    *base,
                    "--result-filename",
                    "runs.jsonl",
                    "--append-result",
                    "--metadata",
                    "version=0.3",
                    "tp=1",
                    "--save-detailed",
                ]
            )
            assert proc.returncode == 0, proc.output
    from trillm.bench.results_io import load_json_lines

    runs = load_json_lines(tmp_path / "runs.jsonl")
    assert len(runs) == 2
    assert all(run["version"] == "0.3" and run["tp"] == "1" for run in runs)
    assert all(len(run["ttfts"]) == 2 for run in runs)  # --save-detailed
    assert "KEY=VALUE" in parse_error(["--metadata", "novalue"], capsys)


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_custom_dataset_template_output_len_shuffle_and_oversample(tmp_path: Path) -> None:
    prompts = [f"Question number {i}: what is {i} plus {i}?" for i in range(3)]
    data = _write_jsonl(tmp_path / "c.jsonl", [{"prompt": p} for p in prompts])
    custom = [
        "--dataset-name",
        "custom",
        "--dataset-path",
        str(data),
        "--tokenizer",
        TOKENIZER,
        "--custom-output-len",
        "7",
        "--max-concurrency",
        "1",
    ]
    with StubServer() as stub:
        proc = run_bench([*common_args(stub.url, tmp_path, 5, 2), *custom])
        oversampled = stub.bodies[1:]
        stub.bodies.clear()
        proc2 = run_bench(
            [
                *common_args(stub.url, tmp_path, 2, 2),
                *custom,
                "--no-oversample",
                "--disable-shuffle",
                "--skip-chat-template",
            ]
        )
        plain = stub.bodies[1:]
    assert proc.returncode == 0 and proc2.returncode == 0, proc.output + proc2.output
    assert len(oversampled) == 5 and {b["max_tokens"] for b in oversampled} == {7}
    # the chat template wraps each prompt (/v1/completions); 5 drawn from 3: repeats
    assert all(any(q in b["prompt"] and b["prompt"] != q for q in prompts) for b in oversampled)
    assert len({b["prompt"] for b in oversampled}) == 3
    # --disable-shuffle: the file's first two (seed 0 shuffled would pick prompts 2 and 0)
    assert sorted(b["prompt"] for b in plain) == prompts[:2]


def test_hf_dataset_files_on_disk(tmp_path: Path) -> None:
    def conv(q: str, a: str) -> dict:
        return {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}

    root = tmp_path / "hf"
    train = [
        conv(f"Tell me about topic {i} in detail.", "It is a topic of note.") for i in range(3)
    ]
    _write_jsonl(root / "sub" / "train-00000.jsonl", train)
    _write_jsonl(root / "sub" / "test-00000.jsonl", [conv("A test question here?", "Yes.")])
    hf = [
        "--dataset-name",
        "hf",
        "--dataset-path",
        str(root),
        "--tokenizer",
        TOKENIZER,
        "--hf-subset",
        "sub",
        "--hf-split",
        "train",
        "--no-oversample",
    ]
    with StubServer() as stub:
        proc = run_bench(
            [
                *common_args(stub.url, tmp_path, 10, 2),
                *hf,
                "--hf-output-len",
                "4",
                "--hf-name",
                "Aeala/ShareGPT_Vicuna_unfiltered",
            ]
        )
        bodies = stub.bodies[1:]
    assert proc.returncode == 0, proc.output
    assert sorted(b["prompt"] for b in bodies) == sorted(
        c["conversations"][0]["value"] for c in train
    )
    assert {b["max_tokens"] for b in bodies} == {4}
    proc = run_bench(["--base-url", "http://127.0.0.1:1", *hf, "--hf-name", "org/other"])
    assert proc.returncode == 1 and "only the ShareGPT-format" in proc.output
    proc = run_bench(
        [
            "--base-url",
            "http://127.0.0.1:1",
            "--dataset-name",
            "hf",
            "--dataset-path",
            "org/remote",
            "--tokenizer",
            TOKENIZER,
        ]
    )
    assert proc.returncode == 1 and "files on disk only" in proc.output


def test_timeline_and_dataset_stats_plots(tmp_path: Path, capsys) -> None:
    from trillm.bench.metrics import RequestResult
    from trillm.bench.timeline import COLORS, PREFILL_COLOR, timeline_segments

    r = RequestResult(prompt_len=1, start_time=10.0, success=True, ttft=0.1, itl=[0.01, 0.03, 0.08])
    (row,) = timeline_segments([r], 10.0, (25.0, 50.0))
    assert [color for *_, color in row] == [PREFILL_COLOR, *COLORS]
    assert row[-1][1] == pytest.approx(0.1 + 0.12)
    with StubServer() as stub:
        proc = run_bench(
            [
                *common_args(stub.url, tmp_path, 3, 3),
                "--plot-timeline",
                "--timeline-itl-thresholds",
                "1,2",
                "--plot-dataset-stats",
            ]
        )
    assert proc.returncode == 0, proc.output
    page = (tmp_path / "r_timeline.html").read_text()
    assert page.count("<rect") == 3 * 3  # per request: the first-token wait and 2 gaps
    assert COLORS[2] in page and COLORS[0] not in page  # 50 ms gaps: above 2 ms
    assert (tmp_path / "r_dataset_stats.png").stat().st_size > 10_000
    assert "two values" in parse_error(["--timeline-itl-thresholds", "5"], capsys)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--profile"], "/start_profile"),
        (["--sonnet-input-len", "5"], "sonnet dataset is not implemented"),
        (["--no-reranker"], "reranker"),
        (["--tokenizer-mode", "mistral"], "invalid choice"),
        (["--extra-body", "[1]"], "JSON object"),
        (["--num-warmups", "-1"], "--num-warmups"),
        (["--header", "novalue"], "KEY=VALUE"),
    ],
)
def test_flags_that_cannot_be_honoured_are_argparse_errors(flags, message, capsys):
    assert message in parse_error(flags, capsys)


def test_insecure_needs_the_httpx_client(tmp_path: Path) -> None:
    proc = run_bench(["--insecure", "--base-url", "https://127.0.0.1:1"])
    assert proc.returncode == 1 and "needs --http-client httpx" in proc.output
    from trillm.bench.transport import make_transport

    client = make_transport("httpx", verify=False)
    assert client.client._transport._pool._ssl_context.verify_mode.name == "CERT_NONE"  # type: ignore[union-attr]


def test_ready_check_waits_for_the_server(tmp_path: Path) -> None:
    port = free_port()
    args = common_args(f"http://127.0.0.1:{port}", tmp_path, 2, 2)
    proc = subprocess.Popen(
        [sys.executable, "-m", "trillm.bench", "serve", *args, "--ready-check-timeout-sec", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=bench_env(),
    )
    time.sleep(3.0)  # the benchmark is polling a port nobody listens on yet
    assert proc.poll() is None
    with StubServer(port=port):
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert load(tmp_path / "r.json")["completed"] == 2


def test_skip_tokenizer_init_and_tokenizer_mode(tmp_path: Path) -> None:
    with StubServer() as stub:
        proc = run_bench(
            [
                *common_args(stub.url, tmp_path, 2, 2),
                "--model",
                TOKENIZER,
                "--served-model-name",
                MODEL,
            ]
        )
        with_tok = stub.bodies[1:]
        stub.bodies.clear()
        proc2 = run_bench(
            [
                *common_args(stub.url, tmp_path, 2, 2),
                "--model",
                TOKENIZER,
                "--served-model-name",
                MODEL,
                "--skip-tokenizer-init",
            ]
        )
        without = stub.bodies[1:]
    assert proc.returncode == 0 and proc2.returncode == 0, proc.output + proc2.output
    assert all(isinstance(b["prompt"], str) for b in with_tok)  # the tokenizer makes text
    assert all(isinstance(b["prompt"], list) for b in without)  # token ids: no tokenizer
    from trillm.bench.datasets import BenchTokenizer

    slow = BenchTokenizer(TOKENIZER, mode="slow")
    fast = BenchTokenizer(TOKENIZER)
    assert slow._hf is not None and fast._fast is not None
    assert slow.encode("In the beginning") == fast.encode("In the beginning")
