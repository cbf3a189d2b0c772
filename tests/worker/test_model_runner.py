"""ModelRunner numerics against Hugging Face transformers on the same tiny random weights.

A small in-test scheduler allocates blocks and builds SchedulerOutput diffs, so the runner is
driven exactly as the engine drives it: all at once, in 7-token prefill chunks, and with a
shared prefix whose K/V another request left in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from trillm.config import EngineArgs
from trillm.engine.config_builder import build_config
from trillm.messages import CachedRequestData, NewRequestData, SchedulerOutput
from trillm.sampling_params import SamplingParams
from trillm.testing.tiny_models import build_tiny_model
from trillm.worker.model_runner import ModelRunner

BLOCK_SIZE = 8
NUM_BLOCKS = 256
MAX_NEW = 12
PROMPT_LENS = [3, 60, 17, 8, 33, 5, 41, 24, 9]

ARCHES = ["llama", "mistral", "qwen2", "qwen3"]
# Rope scaling variants: checked in the plain batched run (the rope is per position, so the
# chunked and prefix-cached paths exercise nothing rope-specific).
ROPE_VARIANTS = {
    "llama-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-llama3": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "llama-yarn": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 512,
            }
        },
    ),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass
class _Req:
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
        self.active: list[_Req] = []
        self.finished: list[str] = []
        self.step_id = 0

    def add(self, req: _Req, prefix_blocks: list[int] = (), num_computed: int = 0) -> None:
        req.blocks = list(prefix_blocks)
        req.num_computed = num_computed
        self.active.append(req)

    def _grow(self, req: _Req, upto: int) -> None:
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


def _prompts(lens: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 4096, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module", params=ARCHES)
def tiny(request, tmp_path_factory):
    path = build_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    return path, _load_hf(path)


def _load_hf(path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def _hf_greedy(hf, prompt: list[int], max_new: int) -> tuple[list[int], torch.Tensor]:
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


def _make_runner(path) -> ModelRunner:
    args = EngineArgs(
        model=str(path),
        dtype="float32",
        device="cpu",
        block_size=BLOCK_SIZE,
        max_num_seqs=16,
        max_model_len=256,
        num_gpu_blocks_override=NUM_BLOCKS,
        distributed_executor_backend="uni",
    )
    runner = ModelRunner(build_config(args))
    runner.load_model()
    runner.initialize_kv_cache(runner.determine_num_blocks())
    return runner


def _greedy(max_tokens: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


@pytest.fixture(scope="module")
def reference(tiny):
    _, hf = tiny
    return [_hf_greedy(hf, p, MAX_NEW)[0] for p in _prompts(PROMPT_LENS)]


def _run_batch(path, chunk: int | None) -> list[list[int]]:
    sched = MiniScheduler(_make_runner(path), chunk=chunk)
    reqs = [_Req(f"r{i}", p, _greedy(), MAX_NEW) for i, p in enumerate(_prompts(PROMPT_LENS))]
    for req in reqs:
        sched.add(req)
    sched.run()
    return [r.output for r in reqs]


@pytest.mark.parametrize("chunk", [None, 7], ids=["whole", "chunk7"])
def test_greedy_matches_transformers(tiny, reference, chunk):
    path, _ = tiny
    assert _run_batch(path, chunk) == reference


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_rope_scaling_greedy_matches_transformers(variant, tmp_path):
    arch, overrides = ROPE_VARIANTS[variant]
    path = build_tiny_model(arch, tmp_path / variant, **overrides)
    hf = _load_hf(path)
    reference = [_hf_greedy(hf, p, MAX_NEW)[0] for p in _prompts(PROMPT_LENS)]
    assert _run_batch(path, None) == reference


def test_shared_prefix_from_cache(tiny):
    path, hf = tiny
    runner = _make_runner(path)
    sched = MiniScheduler(runner, chunk=16)
    shared = _prompts([24], seed=7)[0]  # 3 full blocks
    first = _Req("first", shared + [5, 6, 7], _greedy(2), 2)
    sched.add(first)
    sched.run()
    prefix_blocks = first.blocks[: len(shared) // BLOCK_SIZE]
    suffixes = _prompts([1, 9, 30, 4, 16, 2, 11, 20], seed=3)
    reqs = [_Req(f"s{i}", shared + s, _greedy(), MAX_NEW) for i, s in enumerate(suffixes)]
    for req in reqs:
        sched.add(req, prefix_blocks=prefix_blocks, num_computed=len(shared))
    sched.run()
    expected = [_hf_greedy(hf, r.prompt, MAX_NEW)[0] for r in reqs]
    assert [r.output for r in reqs] == expected


def test_logprobs_match_transformers(tiny):
    path, hf = tiny
    runner = _make_runner(path)
    sched = MiniScheduler(runner, chunk=7)
    prompts = _prompts([19, 6, 30], seed=11)
    reqs = [
        _Req(f"l{i}", p, _greedy(6, logprobs=3, prompt_logprobs=2), 6)
        for i, p in enumerate(prompts)
    ]
    plain = _Req("plain", _prompts([10], seed=12)[0], _greedy(6), 6)
    for req in [*reqs, plain]:
        sched.add(req)
    sched.run()
    assert plain.logprobs == [] and plain.prompt_logprobs == []
    check_logprobs(hf, reqs, 6, k_prompt=2, k=3)


def check_logprobs(hf, reqs: list[_Req], max_new: int, k_prompt: int, k: int) -> None:
    """Each request's greedy tokens, sample and prompt logprobs (top-k, ranks) equal
    transformers' on the same prompt."""
    for req in reqs:
        tokens, gen_logits = _hf_greedy(hf, req.prompt, max_new)
        assert req.output == tokens
        with torch.no_grad():
            prompt_logits = hf(torch.tensor([req.prompt])).logits[0].float()  # [P, V]
        _check_rows(req.prompt_logprobs, prompt_logits[:-1], req.prompt[1:], k=k_prompt)
        _check_rows(req.logprobs, gen_logits, tokens, k=k)


def _check_rows(chunks, logits: torch.Tensor, targets: list[int], k: int) -> None:
    token_ids = [row for c in chunks for row in c.token_ids]
    logprobs = torch.tensor([row for c in chunks for row in c.logprobs])
    ranks = [r for c in chunks for r in c.ranks]
    ref = torch.log_softmax(logits, dim=-1)  # [n, V]
    assert len(token_ids) == len(targets) == ref.shape[0]
    assert [row[0] for row in token_ids] == targets
    assert all(len(row) == 1 + k for row in token_ids)
    top_lp, _ = ref.topk(k, dim=-1)
    target_lp = ref.gather(1, torch.tensor(targets)[:, None])
    torch.testing.assert_close(logprobs, torch.cat([target_lp, top_lp], 1), atol=1e-4, rtol=0)
    expected_ranks = ((ref > target_lp).sum(-1) + 1).tolist()
    assert ranks == expected_ranks


def test_step_with_only_finished_requests(tiny):
    path, _ = tiny
    runner = _make_runner(path)
    sched = MiniScheduler(runner)
    reqs = [_Req(f"f{i}", p, _greedy(2), 2) for i, p in enumerate(_prompts([4, 9]))]
    for req in reqs:
        sched.add(req)
    sched.run()
    assert len(runner.batch) == 2  # finished, but the runner hears of it next step
    sched.step()  # nothing scheduled: only the finished ids travel
    assert len(runner.batch) == 0
    assert runner.sampling_state.num_active == 0


def test_bitmask_restricts_only_its_request(tiny, reference):
    path, _ = tiny
    sched = MiniScheduler(_make_runner(path))
    words = [0] * (4096 // 32)
    words[77 // 32] = 1 << (77 % 32)  # only token 77 allowed
    prompts = _prompts(PROMPT_LENS)
    masked = _Req("masked", prompts[0], _greedy(3), 3)
    free = _Req("free", prompts[1], _greedy(3), 3)
    sched.add(masked)
    sched.add(free)
    while sched.active:
        sched.step(bitmask={"masked": words})
    assert masked.output == [77, 77, 77]
    assert free.output == reference[1][:3]


def test_a_request_that_makes_the_sampler_fail_fails_alone(tiny, reference):
    # A sampler failure caused by one request's row (injected here: the real sampler refuses
    # nothing that SamplingParams lets through) is retried row by row: that request alone is
    # reported failed, the others get exactly the tokens they get alone.
    path, _ = tiny
    runner = _make_runner(path)
    real = runner.token_sampler.sampler

    def sampler(logits, state, slots, bitmask=None):
        if runner.batch.slot_of("bad") in slots.tolist():
            raise FloatingPointError("this row's parameters broke the sampler")
        return real(logits, state, slots, bitmask)

    runner.token_sampler.sampler = sampler
    prompts = _prompts(PROMPT_LENS)
    good = _Req("good", prompts[1], _greedy(3), 3)
    bad = _Req("bad", prompts[0], _greedy(3), 3)
    sched = MiniScheduler(runner)
    sched.add(bad)
    sched.add(good)
    runner.execute_model(sched_output := _first_step(sched))
    out = runner.sample_tokens(None)
    assert list(out.failed) == ["bad"] and "FloatingPointError" in out.failed["bad"]
    by_id = dict(zip(out.req_ids, out.sampled_token_ids))
    assert by_id["bad"] == [] and by_id["good"] == reference[1][:1]
    assert sorted(out.req_ids) == sorted(sched_output.num_scheduled_tokens)


def _first_step(sched: MiniScheduler) -> SchedulerOutput:
    """The scheduler's first step as a SchedulerOutput, without running it."""
    new_reqs, scheduled = [], {}
    for req in sched.active:
        sched._grow(req, req.num_tokens)
        scheduled[req.req_id] = req.num_tokens
        req.sent = True
        new_reqs.append(NewRequestData(req.req_id, req.prompt, [], req.params, list(req.blocks), 0))
    return SchedulerOutput(0, new_reqs, CachedRequestData(), scheduled, sum(scheduled.values()))
