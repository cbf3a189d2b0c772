"""Custom logits processors with vLLM's interface (``--logits-processors``): vLLM's documented
``DummyLogitsProcessor``, unchanged but for its imports, keeps the requests whose extra_args
carry ``target_token`` on that token while the others equal a run without it: the processors'
batch diffs under random churn, then ``LLM`` with requests joining and leaving (different
prompt and output lengths, chunked prefill, preemption), ``vllm_xargs`` over HTTP, a raising
processor that ends only its requests, and the refusals (names that do not import, pooling,
speculative decoding, ``validate_params``)."""

from __future__ import annotations

import random

import openai
import pytest
import torch
from transformers import AutoTokenizer

from trillm import LLM, EngineArgs, SamplingParams
from trillm.engine.preprocess import InvalidRequestError
from trillm.sample.custom_batch import CustomLogitsProcessors
from trillm.sample.logits_processor import (
    AdapterLogitsProcessor,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
)
from trillm.sample.sampler import Sampler, SamplingState

VllmConfig = object  # vLLM's annotation; trillm hands its own config (docs/serving.md)


# vLLM's docs (features/custom_logitsprocs.md, "Example custom logits processor
# implementation"), as written there.
class DummyLogitsProcessor(LogitsProcessor):
    """Fake logit processor to support unit testing and examples"""

    @classmethod
    def validate_params(cls, params: SamplingParams):
        target_token: int | None = params.extra_args and params.extra_args.get("target_token")
        if target_token is not None and not isinstance(target_token, int):
            raise ValueError(f"target_token value {target_token} is not int")

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        self.req_info: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        """Never impacts greedy sampling"""
        return False

    def update_state(self, batch_update: BatchUpdate | None):
        if not batch_update:
            return

        # Process added requests.
        for index, params, _, _ in batch_update.added:
            assert params is not None
            self.validate_params(params)
            if params.extra_args and (target_token := params.extra_args.get("target_token")):
                self.req_info[index] = target_token
            else:
                self.req_info.pop(index, None)

        if self.req_info:
            # Process removed requests.
            for index in batch_update.removed:
                self.req_info.pop(index, None)

            # Process moved requests, unidirectional move (a->b) and swap
            # (a<->b)
            for adx, bdx, direct in batch_update.moved:
                a_val = self.req_info.pop(adx, None)
                b_val = self.req_info.pop(bdx, None)
                if a_val is not None:
                    self.req_info[bdx] = a_val
                if direct == MoveDirectionality.SWAP and b_val is not None:
                    self.req_info[adx] = b_val

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.req_info:
            return logits

        # Save target values before modification
        cols = torch.tensor(list(self.req_info.values()), dtype=torch.long, device=logits.device)
        rows = torch.tensor(list(self.req_info.keys()), dtype=torch.long, device=logits.device)
        values_to_keep = logits[rows, cols].clone()

        # Mask all but target tokens
        logits[rows] = float("-inf")
        logits[rows, cols] = values_to_keep

        return logits


class WrappedPerReqLogitsProcessor(AdapterLogitsProcessor):
    """vLLM's documented adapter: a per-request callable that adds its output count to
    column ``count_column`` (so each row shows the live output list it holds)."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params):
        column = (params.extra_args or {}).get("count_column")
        if column is None:
            return None

        def count_outputs(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            logits[column] += len(output_ids)
            return logits

        return count_outputs


class ExplodingLogitsProcessor(LogitsProcessor):
    """Raises in apply while a request with extra_args ``explode`` is in the batch."""

    def __init__(self, vllm_config, device, is_pin_memory):
        self.exploding: set[int] = set()

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update):
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.exploding.discard(index)
        for index, params, _, _ in batch_update.added:
            if (params.extra_args or {}).get("explode"):
                self.exploding.add(index)
            else:
                self.exploding.discard(index)
        for a, b, direction in batch_update.moved:
            at_a, at_b = a in self.exploding, b in self.exploding
            self.exploding.discard(a)
            self.exploding.discard(b)
            if at_a:
                self.exploding.add(b)
            if direction == MoveDirectionality.SWAP and at_b:
                self.exploding.add(a)

    def apply(self, logits):
        if self.exploding:
            raise RuntimeError("asked to explode")
        return logits


# ---------------------------------------------------------------- the batch diffs


def _processors(*classes) -> CustomLogitsProcessors:
    return CustomLogitsProcessors(classes, VllmConfig(), torch.device("cpu"))


def test_batch_updates_keep_vllm_processors_on_their_rows():
    """Requests join, leave, come back (a preemption), swap rows and take freed slots over
    300 random steps: every targeted row keeps only its target, every other row is left as
    it was, and the adapter's callables see their request's live output list."""
    rng = random.Random(0)
    vocab, slots = 50, 8
    custom = _processors(DummyLogitsProcessor, WrappedPerReqLogitsProcessor)
    held: dict[int, dict] = {}  # slot -> extra_args
    outputs: dict[int, int] = {}
    for _ in range(300):
        for slot in list(held):
            if rng.random() < 0.1:
                custom.remove_request(slot)
                del held[slot], outputs[slot]
        for slot in set(range(slots)) - set(held):
            if rng.random() < 0.3:
                extra = rng.choice([{"target_token": rng.randrange(1, vocab)}, {}, None])
                extra = {"count_column": 0} if extra == {} else extra
                params = SamplingParams(temperature=0.0, extra_args=extra)
                custom.add_request(slot, params, [1, 2, 3])
                held[slot], outputs[slot] = extra or {}, 0
        rows = [s for s in held if rng.random() < 0.8]
        rng.shuffle(rows)
        logits = torch.randn(len(rows), vocab)
        before = logits.clone()
        got = custom.apply_argmax_changing(logits, rows)
        for i, slot in enumerate(rows):
            extra = held[slot]
            if "target_token" in extra:
                target = extra["target_token"]
                assert got[i].isinf().sum() == vocab - 1, (i, slot)
                assert got[i, target] == before[i, target]
            elif "count_column" in extra:
                assert got[i, 0] == pytest.approx(before[i, 0] + outputs[slot])
                assert torch.equal(got[i, 1:], before[i, 1:])
            else:
                assert torch.equal(got[i], before[i])
        custom.append_tokens(rows, [7] * len(rows))
        for slot in rows:
            outputs[slot] += 1


def test_unchanged_batch_gives_none():
    seen: list[BatchUpdate | None] = []

    class Recorder(DummyLogitsProcessor):
        def update_state(self, batch_update):
            seen.append(batch_update)
            super().update_state(batch_update)

    custom = _processors(Recorder)
    for slot in (3, 5):
        custom.add_request(slot, SamplingParams(temperature=0.0), [1])
    custom.apply_argmax_changing(torch.zeros(2, 4), [5, 3])
    custom.apply_argmax_changing(torch.zeros(2, 4), [5, 3])
    custom.apply_argmax_changing(torch.zeros(2, 4), [3, 5])
    first, second, third = seen
    assert first is not None and first.batch_size == 2
    assert [a[0] for a in first.added] == [0, 1] and not first.removed
    assert second is None
    assert third is not None and third.moved == [(0, 1, MoveDirectionality.SWAP)]


class Recorder(LogitsProcessor):
    """Keeps a copy of the logits each apply receives; argmax-invariant or not by class."""

    invariant = False
    seen: list[torch.Tensor] = []

    def __init__(self, vllm_config, device, is_pin_memory):
        pass

    def is_argmax_invariant(self) -> bool:
        return self.invariant

    def update_state(self, batch_update):
        pass

    def apply(self, logits):
        self.seen.append(logits.clone())
        return logits


class InvariantRecorder(Recorder):
    invariant = True
    seen: list[torch.Tensor] = []


def test_sampler_applies_them_in_vllms_places():
    """Argmax-changing ones after logit_bias and before penalties; argmax-invariant ones
    after temperature, and not at all on an all-greedy step."""
    state = SamplingState(4, 8, torch.device("cpu"))
    state.custom = _processors(Recorder, InvariantRecorder)
    bias = SamplingParams(temperature=0.0, logit_bias={2: 5.0}, repetition_penalty=2.0)
    state.add_request(0, bias, prompt_token_ids=[3], output_token_ids=[])
    logits = torch.linspace(-1.0, 1.0, 8).unsqueeze(0)
    Sampler()(logits, state, torch.tensor([0]))
    (changing,) = Recorder.seen
    assert changing[0, 2] == pytest.approx(logits[0, 2] + 5.0)  # biased, not penalised
    assert changing[0, 3] == logits[0, 3]
    assert InvariantRecorder.seen == []  # all greedy: skipped
    state.add_request(1, SamplingParams(temperature=0.5), prompt_token_ids=[], output_token_ids=[])
    Sampler()(logits.repeat(2, 1), state, torch.tensor([0, 1]))
    (invariant,) = InvariantRecorder.seen
    assert torch.allclose(invariant[1], logits[0] / 0.5)


# ---------------------------------------------------------------- through LLM

# Prompts of different lengths (two longer than a step's 32-token budget: chunked prefill)
# and outputs of different lengths, 3 in flight at once and a KV cache too small for all of
# them (preemption): requests join and leave the processors' batch throughout.
TEXTS = [
    "Hello, my name is",
    "The president of the United States is " * 6,
    "The capital of France is",
    "The future of AI is " * 8,
    "In the beginning",
    "Copyright holders may not",
    "A",
    "The license grants you the right to copy, modify and merge",
]
TARGETS = {0: 42, 3: 7, 4: 300, 7: 9}  # prompt index -> target_token
ENGINE = dict(
    max_model_len=128,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    num_gpu_blocks_override=9,
)


def _params(i: int, **extra) -> SamplingParams:
    xargs = {"target_token": TARGETS[i]} if i in TARGETS else None
    return SamplingParams(
        temperature=0.0, max_tokens=12 + 3 * i, logprobs=2, extra_args=xargs, **extra
    )


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("llama")


def _seeded(i: int) -> SamplingParams:
    params = _params(i, seed=100 + i)
    params.temperature = 0.9
    return params


@pytest.fixture(scope="module")
def plain_outputs(model_path):
    """A run without processors: greedy, then seeded random."""
    llm = LLM(model_path, distributed_executor_backend="uni", **ENGINE)
    try:
        greedy = llm.generate(TEXTS, [_params(i) for i in range(len(TEXTS))], use_tqdm=False)
        seeded = llm.generate(TEXTS, [_seeded(i) for i in range(len(TEXTS))], use_tqdm=False)
        return greedy, seeded
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def llm(model_path):
    # The classes themselves: the model worker (another process) imports them from this file.
    processors = [DummyLogitsProcessor, ExplodingLogitsProcessor]
    engine = LLM(model_path, logits_processors=processors, **ENGINE)
    yield engine
    engine.shutdown()


def _same_as(got, want) -> float:
    """Tokens equal; returns the largest |logprob diff| over every entry."""
    assert got.token_ids == want.token_ids
    worst = 0.0
    for got_step, want_step in zip(got.logprobs, want.logprobs, strict=True):
        assert got_step.keys() == want_step.keys()
        for token, entry in got_step.items():
            worst = max(worst, abs(entry.logprob - want_step[token].logprob))
    return worst


def _check_against_plain(outs, plain) -> None:
    worst = 0.0
    for i, (out, ref) in enumerate(zip(outs, plain, strict=True)):
        got = out.outputs[0]
        assert got.finish_reason == "length"
        if i in TARGETS:
            assert got.token_ids == [TARGETS[i]] * (12 + 3 * i)
            assert ref.outputs[0].token_ids != got.token_ids
        else:
            worst = max(worst, _same_as(got, ref.outputs[0]))
    assert worst < 1e-4


def test_targeted_requests_output_their_token_others_unchanged(llm, plain_outputs):
    before = llm.engine.get_stats().num_preemptions
    outs = llm.generate(TEXTS, [_params(i) for i in range(len(TEXTS))], use_tqdm=False)
    assert llm.engine.get_stats().num_preemptions > before, "the small cache should preempt"
    _check_against_plain(outs, plain_outputs[0])


def test_seeded_random_requests(llm, plain_outputs):
    """A random request keeps to its target too; an untargeted seeded one draws the tokens
    it draws without the processors (its noise is its own, whatever the batch)."""
    outs = llm.generate(TEXTS, [_seeded(i) for i in range(len(TEXTS))], use_tqdm=False)
    _check_against_plain(outs, plain_outputs[1])


def test_validate_params_refuses_at_admission(llm):
    bad = SamplingParams(temperature=0.0, max_tokens=4, extra_args={"target_token": "x"})
    with pytest.raises(InvalidRequestError, match="target_token value x is not int"):
        llm.generate("Hello", bad, use_tqdm=False)


def test_a_raising_processor_ends_only_its_request(llm, plain_outputs):
    """The exploding request ends (finish_reason abort; the log names the processor and its
    error); the others in its batch, a targeted one included, complete as before."""
    params = [_params(i) for i in range(4)]
    params[2] = SamplingParams(temperature=0.0, max_tokens=8, extra_args={"explode": True})
    outs = llm.generate(TEXTS[:4], params, use_tqdm=False)
    assert [out.outputs[0].finish_reason for out in outs] == ["length", "length", "abort", "length"]
    assert outs[0].outputs[0].token_ids == [TARGETS[0]] * 12
    assert outs[1].outputs[0].token_ids == plain_outputs[0][1].outputs[0].token_ids
    assert outs[3].outputs[0].token_ids == [TARGETS[3]] * 21
    again = llm.generate(TEXTS, [_params(i) for i in range(len(TEXTS))], use_tqdm=False)
    _check_against_plain(again, plain_outputs[0])


# ---------------------------------------------------------------- over HTTP: vllm_xargs

NAME = "tiny"
THIS = "tests.sample.test_custom_logits_processors"  # importable from the repository root


@pytest.fixture(scope="module")
def client(model_path, tmp_path_factory):
    from server_harness import ServerProcess  # NOTE: here, so the server imports this file

    flags = ["--served-model-name", NAME, "--logits-processors", f"{THIS}:DummyLogitsProcessor"]
    flags += ["--distributed-executor-backend", "uni"]
    flags += [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    log = tmp_path_factory.mktemp("logits-processors") / "server.log"
    server = ServerProcess([model_path, *flags], log).start()
    yield openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    assert server.stop() == 0, server.log()


def test_vllm_xargs_over_http(client, plain_outputs, model_path):
    """Completions, chat and responses: a request whose vllm_xargs carry target_token
    outputs only it; one without equals the run without processors."""
    targeted = client.completions.create(
        model=NAME,
        prompt=TEXTS[0],
        max_tokens=12,
        temperature=0.0,
        extra_body={"vllm_xargs": {"target_token": TARGETS[0]}, "return_token_ids": True},
    )
    assert targeted.choices[0].model_extra["token_ids"] == [TARGETS[0]] * 12
    plain = client.completions.create(
        model=NAME,
        prompt=TEXTS[1],
        max_tokens=15,
        temperature=0.0,
        extra_body={"return_token_ids": True},
    )
    assert plain.choices[0].model_extra["token_ids"] == plain_outputs[0][1].outputs[0].token_ids
    chat = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0.0,
        extra_body={"vllm_xargs": {"target_token": 9}, "return_token_ids": True},
    )
    assert chat.choices[0].model_extra["token_ids"] == [9] * 5
    tok = AutoTokenizer.from_pretrained(model_path)
    response = client.responses.create(
        model=NAME,
        input="Hi",
        max_output_tokens=4,
        temperature=0.0,
        extra_body={"vllm_xargs": {"target_token": 9}},
    )
    assert response.output_text == tok.decode([9] * 4, skip_special_tokens=True)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"vllm_xargs": {"target_token": "x"}}, "target_token value x is not int"),
        ({"vllm_xargs": {"k": {"nested": 1}}}, "'vllm_xargs' values must be strings, numbers"),
        (
            {"vllm_xargs": {"target_token": 9}, "use_beam_search": True},
            "'vllm_xargs' cannot be combined with 'use_beam_search'",
        ),
    ],
)
def test_bad_vllm_xargs_are_400s(client, body, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.completions.create(model=NAME, prompt="Hi", max_tokens=2, extra_body=body)


# ---------------------------------------------------------------- refused at start


def _build(model_path, **kwargs):
    from trillm.engine.config_builder import build_config

    return build_config(EngineArgs(model=model_path, **kwargs))


def test_names_resolve_both_spellings(model_path):
    for name in (f"{THIS}:DummyLogitsProcessor", f"{THIS}.DummyLogitsProcessor"):
        (spec,) = _build(model_path, logits_processors=[name]).logits_processors
        assert spec.name.endswith(":DummyLogitsProcessor")


@pytest.mark.parametrize(
    ("given", "extra", "message"),
    [
        (["no_such_module:Thing"], {}, "cannot import 'no_such_module:Thing'"),
        ([f"{THIS}:NoSuchClass"], {}, "cannot import"),
        (["torch.nn:Linear"], {}, "torch.nn:Linear is not a subclass of LogitsProcessor"),
        ([DummyLogitsProcessor], {"runner": "pooling"}, "pooling models do not sample"),
        (
            [DummyLogitsProcessor],
            {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
            "not supported with speculative decoding",
        ),
    ],
)
def test_refused_at_start_naming_the_flag(model_path, given, extra, message):
    with pytest.raises(ValueError, match=r"logits_processors \(--logits-processors\)") as err:
        _build(model_path, logits_processors=given, **extra)
    assert message in str(err.value)


def test_entry_point_plugins_load_first(monkeypatch):
    """vLLM's entry-point group: each installed plugin is loaded, before the given classes;
    one that does not import is refused naming it."""
    import trillm.config.logits_processors as loading

    class EntryPoint:
        def __init__(self, value):
            self.name, self.value = "dummy", value

        def load(self):
            module, _, name = self.value.partition(":")
            return getattr(__import__(module, fromlist=[name]), name)

    plugins = [EntryPoint(f"{THIS}:DummyLogitsProcessor")]
    monkeypatch.setattr(
        loading, "entry_points", lambda group: plugins if group == "vllm.logits_processors" else []
    )
    specs = loading.resolve_logits_processors([WrappedPerReqLogitsProcessor])
    assert [s.name.rpartition(":")[2] for s in specs] == [
        "DummyLogitsProcessor",
        "WrappedPerReqLogitsProcessor",
    ]
    plugins[0] = EntryPoint("no_such_plugin:Thing")
    with pytest.raises(ValueError, match="plugin dummy = 'no_such_plugin:Thing' does not import"):
        loading.resolve_logits_processors(None)


def test_a_class_defined_in_a_function_is_refused(model_path):
    class Local(DummyLogitsProcessor):
        pass

    with pytest.raises(ValueError, match="is defined inside a function"):
        _build(model_path, logits_processors=[Local])
