"""The parallelism tests' shared reference (tensor, pipeline, data parallel, several nodes):
the prompts, the greedy parameters, the model that covers the sharding cases, and the greedy
tokens of one in-process engine (TP = PP = DP = 1, "uni") that every layout must equal; and
``abort_the_second``, two data-parallel cores' streams, the second aborted mid-stream.

``reference_tokens`` runs that engine once per process for each (model, prompts, length,
limits): test modules sharing the model (tensor parallel, several nodes, data parallel) share
the run instead of each starting its own.
"""

from __future__ import annotations

from typing import Any

import httpx

from trillm.engine.llm import LLM
from trillm.sampling_params import SamplingParams

PROMPTS = ["Hello there, how", "The capital of France is", "1 2 3 4 5"]
MAX_TOKENS = 10
LIMITS = {"max_model_len": 256, "kv_cache_memory": "16MiB"}
# A Llama with one KV head (replicated on two ranks, each with half the query heads), biases
# on every projection (the row-parallel biases must be added once), 4099 vocabulary rows (the
# last rank's shard is padded) and tied embeddings (the vocabulary shard is the head's too).
SHARDED_LLAMA: dict[str, Any] = {
    "num_key_value_heads": 1,
    "attention_bias": True,
    "mlp_bias": True,
    "vocab_size": 4099,
    "tie_word_embeddings": True,
}

_tokens: dict[tuple, list[list[int]]] = {}


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def reference_tokens(
    model: str, prompts: list[str] = PROMPTS, max_tokens: int = MAX_TOKENS, **limits: Any
) -> list[list[int]]:
    """Greedy tokens of each prompt from one in-process engine (``limits``: engine arguments,
    ``LIMITS`` when none), computed once per process."""
    limits = limits or LIMITS
    key = (model, tuple(prompts), max_tokens, tuple(sorted(limits.items())))
    if key not in _tokens:
        with LLM(model, distributed_executor_backend="uni", **limits) as llm:
            outs = llm.generate(prompts, greedy(max_tokens), use_tqdm=False)
        _tokens[key] = [o.outputs[0].token_ids for o in outs]
    return [list(tokens) for tokens in _tokens[key]]


def limit_flags(limits: dict[str, Any] = LIMITS) -> list[str]:
    """``limits`` as ``trillm serve`` flags."""
    return [
        arg for name, value in limits.items() for arg in ("--" + name.replace("_", "-"), str(value))
    ]


def greedy_body(prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    """A /v1/completions body: greedy, ``max_tokens`` past any EOS, with its token ids."""
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


def http_greedy_tokens(
    base_url: str, prompts: list[str] = PROMPTS, max_tokens: int = MAX_TOKENS
) -> list[list[int]]:
    """Greedy tokens of each prompt from a server's /v1/completions (``base_url``: its /v1)."""
    got = []
    for prompt in prompts:
        r = httpx.post(base_url + "/completions", json=greedy_body(prompt, max_tokens), timeout=120)
        assert r.status_code == 200, r.text
        got.append(r.json()["choices"][0]["token_ids"])
    return got


async def abort_the_second(engine, params: SamplingParams) -> tuple[list, list]:
    """Under -dp 2, request "A" streams on core 0; "B", sent after A's first token, lands on
    core 1 and is aborted after its own first token -> (B's outputs after the abort, A's
    outputs, A run to its end)."""
    async with engine.generate("one two", params, "A") as a:
        first_a = await a.__anext__()
        async with engine.generate("three four", params, "B") as b:
            await b.__anext__()
            assert (engine.engine_index_of("A"), engine.engine_index_of("B")) == (0, 1)
            await engine.abort("B")
            rest_b = [out async for out in b]
        outs_a = [first_a] + [out async for out in a]
    return rest_b, outs_a
