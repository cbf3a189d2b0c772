"""The contracts between trillm's parts, typed, in one place.

- The model runner (``ModelRunnerProtocol``, below): what a model-worker process calls on the
  runner it loads (``trillm.worker.model_runner.ModelRunner``, the pooling runner, the fake
  runner and the test runners all conform; mypy checks each against it).
- The executor: ``trillm.executor.abstract.Executor``, an abstract class (it carries defaults
  for the batch-queue and failure-watching parts); every executor, stand-ins in tests
  included, subclasses it.
- The engine as a request sees it (``RequestEngine``, below): what ``request_stream.py``'s
  parent requests call to submit and abort (``trillm.engine.request_inbox.RequestInbox``,
  which ``AsyncEngine`` hands them).
- The scheduler: the Python twin's class, ``trillm.core.scheduler.Scheduler``; the native
  scheduler is declared with the twin's API (``trillm/_ext/scheduler.pyi``) and checked against
  it (``tests/native/test_native_contract.py``).
- The tokenizer (``Tokenizer``, below): what trillm calls on the transformers tokenizer it
  loads (``trillm.engine.tokenizer_loader.load_tokenizer``, the one place transformers' untyped
  object becomes this type).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, overload

if TYPE_CHECKING:
    from tokenizers import AddedToken

    from trillm.engine.preprocess import Preprocessor
    from trillm.lora.request import LoRARequest
    from trillm.messages import AbortRequest, AddRequest, ModelRunnerOutput, SchedulerOutput
    from trillm.sampling_params import SamplingParams

# req_id -> the grammar's allowed-token bitmask row: int32 words, packed (bytes) or listed
Bitmask = dict[str, bytes | list[int]]


class ModelRunnerProtocol(Protocol):
    """A model-worker's runner, in the order the worker calls it: built with (config, rank,
    **runner_kwargs); ``load_model``; ``determine_num_blocks``; ``initialize_kv_cache``; then
    per step ``execute_model`` (P2) and ``sample_tokens`` (P3); ``shutdown`` on the way out."""

    def load_model(self) -> None: ...

    def determine_num_blocks(self) -> int: ...

    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    def execute_model(self, sched: SchedulerOutput) -> None: ...

    def sample_tokens(self, bitmask: Bitmask | None) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...


# A runner class: (config, rank, **runner_kwargs) -> a runner.
RunnerClass = Callable[..., ModelRunnerProtocol]

if TYPE_CHECKING:  # mypy checks every runner trillm ships against the contract
    from trillm.testing.scripted_runner import ScriptedRunner
    from trillm.testing.slow_runner import SlowPoolingRunner
    from trillm.worker.fake_runner import FakeModelRunner
    from trillm.worker.model_runner import ModelRunner
    from trillm.worker.pooling_runner import PoolingModelRunner

    _RUNNERS: tuple[RunnerClass, ...] = (
        ModelRunner,
        PoolingModelRunner,
        FakeModelRunner,
        ScriptedRunner,
        SlowPoolingRunner,
    )


class RequestEngine(Protocol):
    """What a request needs of the engine (``RequestInbox``): stage 2, the adapter and grammar
    checks, and the output handler's inbox."""

    preprocessor: Preprocessor
    stream_interval: int

    def check_alive(self) -> None: ...

    async def check_lora(self, lora: LoRARequest) -> None: ...

    async def compile_grammar(self, params: SamplingParams) -> None: ...

    def try_send_to_handler(self, msg: AddRequest) -> bool: ...

    async def send_to_handler(self, msg: AddRequest) -> None: ...

    async def send_abort(self, msg: AbortRequest) -> None: ...


class Tokenizer(Protocol):
    """A transformers tokenizer, as far as trillm uses one: stage 2 (encode, the chat
    template's text and special tokens, EOS, the prompt-length bound), stage 10 (decode, the
    logprob texts; the detokenizer reads the ``tokenizers`` backend behind it,
    ``engine/vocab_spec.backend_tokenizer``), the parsers (special tokens, the think tags' ids),
    structured outputs (xgrammar reads it whole) and the HTTP routes (tokenize, detokenize,
    tokenizer_info, a pair for scoring)."""

    chat_template: str | dict[str, str] | None  # transformers: one template, or named ones

    @property
    def eos_token_id(self) -> int | None: ...

    # The named special tokens, as chat templates read them (``{{ bos_token }}``).
    @property
    def bos_token(self) -> str | None: ...

    @property
    def eos_token(self) -> str | None: ...

    @property
    def pad_token(self) -> str | None: ...

    @property
    def unk_token(self) -> str | None: ...

    @property
    def all_special_tokens(self) -> list[str]: ...

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]: ...  # id -> added token

    @property
    def clean_up_tokenization_spaces(self) -> bool: ...

    @property
    def init_kwargs(self) -> dict[str, object]: ...  # tokenizer_config.json's entries

    def __len__(self) -> int: ...  # the vocabulary, added tokens included

    def get_vocab(self) -> dict[str, int]: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    @overload
    def convert_ids_to_tokens(self, ids: int) -> str: ...

    @overload
    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]: ...

    def __call__(
        self, text: str, text_pair: str, *, truncation: bool = False, max_length: int | None = None
    ) -> Mapping[str, list[int]]: ...  # a pair: input_ids, token_type_ids, attention_mask
