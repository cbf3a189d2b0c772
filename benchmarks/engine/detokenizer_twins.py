"""Native vs Python incremental detokenizer: tokens/s on a decode-shaped workload.

256 concurrent requests, each primed with a prompt, then fed one token per step (as the
output handler does during decode) until every request has produced ``--tokens`` tokens.
``tokenizers``' DecodeStream (what vLLM uses) is timed as a reference.

    PYTHONPATH=. python benchmarks/engine/detokenizer_twins.py [--requests 256] [--tokens 256]
"""

from __future__ import annotations

import argparse
import glob
import random
import time

from transformers import AutoTokenizer

from trillm.engine.detokenizer import DetokenizerFactory, StreamDetokenizer
from trillm.engine.vocab_spec import backend_tokenizer
from trillm.testing.tiny_models import DEFAULT_MODEL_DIR

EXTRA = "naïve café déjà vu — 你好，世界。日本語のテキスト 🙂🚀 Ünïcödé ñandú "


def corpus_ids(tokenizer) -> list[int]:
    text = EXTRA * 20
    for path in sorted(glob.glob("/usr/share/common-licenses/*"))[:6]:
        with open(path, encoding="utf-8", errors="ignore") as f:
            text += f.read()
    return tokenizer.encode(text)


def workload(ids: list[int], requests: int, tokens: int, prompt_len: int, seed: int = 0):
    rng = random.Random(seed)
    jobs = []
    for _ in range(requests):
        start = rng.randrange(0, len(ids) - prompt_len - tokens)
        prompt = ids[start : start + prompt_len]
        jobs.append((prompt, ids[start + prompt_len : start + prompt_len + tokens]))
    return jobs


def run(make, jobs, tokens: int) -> tuple[float, list[str]]:
    """Seconds for all decode steps (detokenizer creation included) and the texts."""
    begin = time.perf_counter()
    detoks = [make(prompt) for prompt, _ in jobs]
    texts = [[] for _ in jobs]
    for step in range(tokens):
        for r, detok in enumerate(detoks):
            texts[r].append(detok.add_tokens(jobs[r][1][step : step + 1]))
    for r, detok in enumerate(detoks):
        texts[r].append(detok.flush())
    return time.perf_counter() - begin, ["".join(t) for t in texts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    jobs = workload(corpus_ids(tok), args.requests, args.tokens, args.prompt_len)
    total = args.requests * args.tokens
    native = DetokenizerFactory(tok, native=True)
    python = DetokenizerFactory(tok, native=False)
    backend = backend_tokenizer(tok)
    impls = {
        "native": lambda p: native.new(True, p),
        "python": lambda p: python.new(True, p),
        "DecodeStream": lambda p: StreamDetokenizer(backend, True, p),
    }
    if native.kind != "native":
        print("trillm._ext.detokenizer is not built: run `python setup.py build_ext --inplace`")
        impls.pop("native")
    # The harness's own loop (a detokenizer that does nothing), subtracted for the net rate.
    loop = min(run(lambda p: _Noop(), jobs, args.tokens)[0] for _ in range(args.repeat))
    print(f"harness loop alone: {loop * 1e3:.1f} ms for {total} tokens")
    results: dict[str, float] = {}
    reference: list[str] | None = None
    for name, make in impls.items():
        best = min(run(make, jobs, args.tokens)[0] for _ in range(args.repeat))
        _, texts = run(make, jobs, args.tokens)
        if name != "DecodeStream":
            reference = reference or texts
            if texts != reference:
                raise SystemExit(f"{name} produced different text than the other twin")
        net = max(best - loop, 1e-9)
        results[name] = net
        print(
            f"{name:>12}: {total / best:12,.0f} tokens/s with the loop, "
            f"{total / net:12,.0f} tokens/s net  ({best * 1e3:.1f} ms)"
        )
    if "native" in results:
        gross = (results["python"] + loop) / (results["native"] + loop)
        net = results["python"] / results["native"]
        print(f"native / python speed-up: {gross:.2f}x with the loop, {net:.2f}x net")
    print("whole output processor (DELTA, stop string, one token per request per step):")
    for native_flag in (True, False) if "native" in results else (False,):
        seconds = run_output_processor(tok, jobs, args.tokens, native_flag)
        name = "native" if native_flag else "python"
        print(f"{name:>12}: {total / seconds:12,.0f} tokens/s  ({seconds * 1e3:.1f} ms)")


def run_output_processor(tok, jobs, tokens: int, native: bool) -> float:
    from trillm.engine.output_processor import OutputProcessor
    from trillm.messages import EngineCoreOutput, FinishReason
    from trillm.sampling_params import RequestOutputKind, SamplingParams

    processor = OutputProcessor(tok, native=native)
    params = SamplingParams(output_kind=RequestOutputKind.DELTA, stop=["\x00never"])
    begin = time.perf_counter()
    collectors = [
        processor.add_request(f"r{r}", None, prompt, params) for r, (prompt, _) in enumerate(jobs)
    ]
    for step in range(tokens):
        finish = FinishReason.LENGTH if step == tokens - 1 else None
        batch = [
            EngineCoreOutput(f"r{r}", out[step : step + 1], finish_reason=finish)
            for r, (_, out) in enumerate(jobs)
        ]
        processor.process_outputs(batch)
        for collector in collectors:
            collector.get_nowait()
    return time.perf_counter() - begin


class _Noop:
    def add_tokens(self, ids) -> str:
        return ""

    def flush(self) -> str:
        return ""


if __name__ == "__main__":
    main()
