"""A ``ModelRunner`` driven without the engine: ``MiniScheduler`` (every active request
every step, blocks from a free list), the runner built on a tiny checkpoint, and transformers'
greedy tokens and logprobs to compare with."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trillm.config import EngineArgs
from trillm.engine.config_builder import build_config
from trillm.messages import CachedRequestData, NewRequestData, SchedulerOutput
from trillm.sampling_params import SamplingParams
from trillm.worker.model_runner import ModelRunner

BLOCK_SIZE = 8
NUM_BLOCKS = 256
MAX_NEW = 12


@dataclass
class Req:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    output: list[int] = field(default_factory=list)
    sent: bool = False
    new_blocks: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)


class MiniScheduler:
    """Just enough scheduling to drive the runner: every active request every step, prefill
    chunks of ``chunk`` tokens, blocks from a free list (never reused, so cached K/V stays)."""

    def __init__(self, runner: ModelRunner, chunk: int | None = None) -> None:
        self.runner = runner
        self.chunk = chunk
        self.free = list(range(NUM_BLOCKS))
        self.active: list[Req] = []
        self.finished: list[str] = []
        self.step_id = 0

    def add(self, req: Req, prefix_blocks: list[int] = (), num_computed: int = 0) -> None:
        req.blocks = list(prefix_blocks)
        req.num_computed = num_computed
        self.active.append(req)

    def _grow(self, req: Req, upto: int) -> None:
        while len(req.blocks) * BLOCK_SIZE < upto:
            block = self.free.pop(0)
            req.blocks.append(block)
            req.new_blocks.append(block)

    def step(self, bitmask: dict[str, list[int]] | None = None) -> None:
        new_reqs, cached, scheduled = [], CachedRequestData(), {}
        for req in self.active:
            n = req.num_tokens - req.num_computed
            if self.chunk is not None:
                n = min(n, self.chunk)
            req.new_blocks = []
            self._grow(req, req.num_computed + n)
            scheduled[req.req_id] = n
            if not req.sent:
                req.sent = True
                new_reqs.append(
                    NewRequestData(
                        req.req_id, req.prompt, [], req.params, list(req.blocks), req.num_computed
                    )
                )
            else:
                cached.req_ids.append(req.req_id)
                cached.new_block_ids.append(req.new_blocks)
                cached.num_computed_tokens.append(req.num_computed)
        sched = SchedulerOutput(
            step_id=self.step_id,
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            finished_req_ids=self.finished,
        )
        self.finished = []
        self.step_id += 1
        self.runner.execute_model(sched)
        out = self.runner.sample_tokens(bitmask)
        assert out.req_ids == list(scheduled)
        by_id = {r.req_id: r for r in self.active}
        for req_id, tokens in zip(out.req_ids, out.sampled_token_ids):
            req = by_id[req_id]
            req.num_computed += scheduled[req_id]
            req.output.extend(tokens)
            if req_id in out.logprobs:
                req.logprobs.append(out.logprobs[req_id])
            if req_id in out.prompt_logprobs:
                req.prompt_logprobs.append(out.prompt_logprobs[req_id])
            if len(req.output) >= req.max_tokens:
                self.active.remove(req)
                self.finished.append(req_id)

    def run(self) -> None:
        while self.active:
            self.step()


def random_prompts(lens: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 4096, (n,), generator=g).tolist() for n in lens]


def load_hf(path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def transformers_greedy(hf, prompt: list[int], max_new: int) -> tuple[list[int], torch.Tensor]:
    """transformers generate (greedy, EOS disabled): tokens and the raw logits per step."""
    from transformers import GenerationConfig

    gen = GenerationConfig(
        do_sample=False, max_new_tokens=max_new, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            generation_config=gen,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, torch.cat(out.logits).float()  # [max_new, V]


def load_runner(path, **overrides) -> ModelRunner:
    """A CPU fp32 runner with the model loaded and no KV cache yet; ``overrides`` are
    EngineArgs fields (dtype included)."""
    fields = {"dtype": "float32", "device": "cpu", "block_size": BLOCK_SIZE, **overrides}
    runner = ModelRunner(build_config(EngineArgs(model=str(path), **fields)))
    runner.load_model()
    return runner


def make_runner(path, **overrides) -> ModelRunner:
    """``load_runner`` with room for 16 sequences of 256 tokens and its KV cache allocated."""
    runner = load_runner(
        path,
        **{
            "max_num_seqs": 16,
            "max_model_len": 256,
            "num_gpu_blocks_override": NUM_BLOCKS,
            "distributed_executor_backend": "uni",
            **overrides,
        },
    )
    runner.initialize_kv_cache(runner.determine_num_blocks())
    return runner


def greedy_params(max_tokens: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def run_requests(
    runner: ModelRunner,
    prompts: list[list[int]],
    max_new: int,
    *,
    chunk: int | None = None,
    tag: str = "r",
    **params,
) -> list[Req]:
    """Each prompt a greedy request (``greedy_params(max_new, **params)``, id tag + index),
    all added at once to a MiniScheduler over ``runner`` (prefill in ``chunk``-token pieces)
    and run to the end."""
    sched = MiniScheduler(runner, chunk=chunk)
    reqs = [
        Req(f"{tag}{i}", p, greedy_params(max_new, **params), max_new)
        for i, p in enumerate(prompts)
    ]
    for req in reqs:
        sched.add(req)
    sched.run()
    return reqs


def check_logprobs(hf, reqs: list[Req], max_new: int, k_prompt: int, k: int) -> None:
    """Each request's greedy tokens, sample and prompt logprobs (top-k, ranks) equal
    transformers' on the same prompt."""
    for req in reqs:
        tokens, gen_logits = transformers_greedy(hf, req.prompt, max_new)
        assert req.output == tokens
        with torch.no_grad():
            prompt_logits = hf(torch.tensor([req.prompt])).logits[0].float()  # [P, V]
        check_logprob_rows(req.prompt_logprobs, prompt_logits[:-1], req.prompt[1:], k=k_prompt)
        check_logprob_rows(req.logprobs, gen_logits, tokens, k=k)


LOGPROB_ATOL = 1e-4


def check_logprob_rows(chunks, logits: torch.Tensor, targets: list[int], k: int) -> None:
    token_ids = [row for c in chunks for row in c.token_ids]
    logprobs = torch.tensor([row for c in chunks for row in c.logprobs])
    ranks = [r for c in chunks for r in c.ranks]
    ref = torch.log_softmax(logits, dim=-1)  # [n, V]
    assert len(token_ids) == len(targets) == ref.shape[0]
    assert [row[0] for row in token_ids] == targets
    assert all(len(row) == 1 + k for row in token_ids)
    top_lp, _ = ref.topk(k, dim=-1)
    target_lp = ref.gather(1, torch.tensor(targets)[:, None])
    torch.testing.assert_close(
        logprobs, torch.cat([target_lp, top_lp], 1), atol=LOGPROB_ATOL, rtol=0
    )
    # A rank counts the logprobs above the target's: one within the tolerance of it may fall
    # either side (fp32 noise: prefill chunked or whole), so the rank lies between the count
    # surely above and the count possibly above.
    surely = ((ref > target_lp + LOGPROB_ATOL).sum(-1) + 1).tolist()
    possibly = ((ref > target_lp - LOGPROB_ATOL).sum(-1) + 1).tolist()
    assert all(lo <= r <= hi for r, lo, hi in zip(ranks, surely, possibly, strict=True)), (
        ranks,
        surely,
        possibly,
    )
