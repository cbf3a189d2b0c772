"""Tool calling and reasoning for chat completions: what the request asks for,
checked before any work (``plan_tools``), and the per-choice parsing of the output
(``ChoiceParser``), non-streamed and streamed alike.

``tool_choice`` follows vLLM: tools without a choice mean "auto", which needs
``--enable-auto-tool-choice --tool-call-parser NAME``; "none" renders the tools (unless
``--exclude-tools-when-tool-choice-none``) and parses nothing; "required" and a named function
constrain the output with a JSON schema (structured outputs), so the calls are valid.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from trillm.engine.chat_template import normalize_tools
from trillm.entrypoints.openai.http.errors import BadRequestError
from trillm.parsers.reasoning import ReasoningParser, ReasoningStreamer, get_reasoning_parser
from trillm.parsers.special_tokens import markers_are_special
from trillm.parsers.tool_parsers import (
    NamedToolCallParser,
    RequiredToolCallParser,
    ToolCallStreamer,
    ToolParser,
    get_tool_parser,
    named_schema,
    required_schema,
)
from trillm.sampling_params import SamplingParamsError, StructuredOutputsParams

if TYPE_CHECKING:
    from trillm.entrypoints.openai.endpoints.base import ServerState
    from trillm.entrypoints.openai.schemas.protocol import ChatCompletionRequest
    from trillm.tokenizer_protocol import Tokenizer


@attrs.define
class ToolPlan:
    mode: str | None = None  # None (no tools / "none"), "auto", "named", "required"
    template_tools: list[dict[str, Any]] | None = None  # what the chat template receives
    parser: Callable[[], ToolParser] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    max_calls: int | None = None  # 1 when parallel_tool_calls is false ("auto": the first)
    schema_param: str = "tools"  # what a schema that does not compile is blamed on

    def blame(self, exc: BadRequestError) -> BadRequestError:
        """An error about the constraint this plan made, told as the tools' fault."""
        if self.structured_outputs is None or not (exc.param or "").startswith(
            "structured_outputs"
        ):
            return exc
        return BadRequestError(
            f"The tool parameters are not a usable JSON schema: {exc.message}", self.schema_param
        )


def plan_tools(state: ServerState, req: ChatCompletionRequest) -> ToolPlan:
    """The request's tools and tool_choice as a plan, or a 400 naming what is wrong."""
    tools = normalize_tools(req.tools)
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise BadRequestError(
            f"'tool_choice' must be 'none', 'auto', 'required' or a named function, got "
            f"{choice!r}.",
            "tool_choice",
        )
    if choice != "none" and tools is None:
        raise BadRequestError("When using `tool_choice`, `tools` must be set.", "tool_choice")
    names: set[str] = set()
    for i, tool in enumerate(tools or []):
        name = tool["function"]["name"]
        if not name:
            raise BadRequestError(
                "Tool function names must not be empty.", f"tools[{i}].function.name"
            )
        if name in names:
            raise BadRequestError(f"Tool {name!r} is given twice.", f"tools[{i}].function.name")
        names.add(name)
    if choice == "required" and not tools:
        choice = "none"  # OpenAI: "required" with no tools behaves as "none"
    if choice == "none":
        excluded = state.exclude_tools_when_tool_choice_none
        return ToolPlan(None, None if excluded else tools)
    assert tools is not None
    if choice == "auto":
        if not (state.enable_auto_tool_choice and state.tool_call_parser):
            raise BadRequestError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set.",
                "tool_choice",
            )
        parser_cls = get_tool_parser(state.tool_call_parser)
        max_calls = 1 if req.parallel_tool_calls is False else None
        return ToolPlan("auto", tools, lambda: parser_cls(tools), max_calls=max_calls)
    _refuse_other_constraints(req)
    if choice == "required":
        schema = required_schema(tools, req.parallel_tool_calls is not False)
        return ToolPlan(
            "required",
            tools,
            lambda: RequiredToolCallParser(tools),
            _constraint(schema),
        )
    assert not isinstance(choice, str)  # each string choice was planned above
    name = choice.function.name
    if name not in names:
        raise BadRequestError(
            f"The tool {name!r} named in `tool_choice` is not one of the `tools`.",
            "tool_choice.function.name",
        )
    index = next(i for i, tool in enumerate(tools) if tool["function"]["name"] == name)
    param = f"tools[{index}].function.parameters"
    return ToolPlan(
        "named",
        tools,
        lambda: NamedToolCallParser(tools, name),
        _constraint(named_schema(tools, name), param),
        schema_param=param,
    )


def _constraint(schema: dict[str, Any], param: str = "tools") -> StructuredOutputsParams:
    # NOTE: no free whitespace: the calls come as json.dumps writes them (", " and ": "), as
    # models write them, and a weak model cannot spend max_tokens on newlines between tokens
    # of JSON (then no call would be valid).
    try:
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    except SamplingParamsError as exc:  # a tool's parameters are not a usable JSON schema
        raise BadRequestError(f"The tool parameters: {exc}", param) from None


def _refuse_other_constraints(req: ChatCompletionRequest) -> None:
    fmt = req.response_format
    if req.structured_outputs is not None or (fmt is not None and fmt.type != "text"):
        raise BadRequestError(
            "A 'required' or named 'tool_choice' constrains the output itself; it cannot be "
            "combined with 'response_format' or 'structured_outputs'.",
            "tool_choice",
        )


def keeps_special_tokens(tokenizer: Tokenizer, tools: ToolPlan, reasoning: bool) -> bool:
    """Whether the output must keep special tokens for its parsers to see their markers
    (vLLM's adjust_request): Mistral's ``[TOOL_CALLS]`` is a special token, Qwen's
    ``<tool_call>`` and ``<think>`` are not."""
    markers: tuple[str, ...] = ()
    if tools.mode == "auto" and tools.parser is not None:
        markers = type(tools.parser()).markers
    return markers_are_special(tokenizer, markers, reasoning)


def reasoning_factory(
    state: ServerState, req: ChatCompletionRequest, prompt_text: str
) -> Callable[[], ReasoningParser] | None:
    if not state.reasoning_parser:
        return None
    cls = get_reasoning_parser(state.reasoning_parser)
    kwargs = req.chat_template_kwargs
    if _tags_are_tokens(cls, state.tokenizer):
        return lambda: cls(prompt_text, kwargs)  # (as a plugin's own __init__ takes them)
    return lambda: cls(prompt_text, kwargs, False)


# tokenizer -> {parser name: whether it has the parser's tags}; held weakly, so a tokenizer
# (an in-process server's) goes with whatever held it
_TAGS_ARE_TOKENS: weakref.WeakKeyDictionary[Any, dict[str, bool]] = weakref.WeakKeyDictionary()


def _tags_are_tokens(cls: type[ReasoningParser], tokenizer: Tokenizer) -> bool:
    """Whether ``tokenizer`` has ``cls``'s tags as tokens (its vocabulary read once per
    tokenizer, not per request)."""
    try:
        known = _TAGS_ARE_TOKENS.setdefault(tokenizer, {})
    except TypeError:  # NOTE: not weakly referable (or not hashable): read each time
        return cls.tags_are_tokens_of(tokenizer)
    if cls.name not in known:
        known[cls.name] = cls.tags_are_tokens_of(tokenizer)
    return known[cls.name]


class ChoiceParser:
    """One choice's output through the reasoning parser, then the tool parser."""

    def __init__(
        self,
        tools: ToolPlan,
        reasoning: Callable[[], ReasoningParser] | None,
        include_reasoning: bool,
    ) -> None:
        self.mode = tools.mode
        self.max_calls = tools.max_calls
        self.tool_parser = tools.parser() if tools.parser is not None else None
        # NOTE: a "required" / named output too: the engine constrains it only after the
        # reasoning section (the same --reasoning-parser is the engine's), so the reasoning
        # is split off first and the content is the constrained JSON, as in vLLM.
        self.reasons = reasoning is not None
        self.reasoning_parser = reasoning() if reasoning is not None else None
        self.include_reasoning = include_reasoning
        self._r_stream: ReasoningStreamer | None = None
        self._t_stream: ToolCallStreamer | None = None
        self.tools_called = False

    # ------------------------------------------------------------ non-streamed

    def message(self, text: str) -> dict[str, Any]:
        """The assistant message for the whole output ``text``."""
        msg: dict[str, Any] = {"role": "assistant"}
        if self.reasons:  # the fields are there whenever the server parses reasoning
            msg["reasoning_content"] = msg["reasoning"] = None
        content: str | None = text
        if self.reasoning_parser is not None:
            reasoning, content = self.reasoning_parser.extract(text)
            if not self.include_reasoning:
                reasoning = None
            msg["reasoning_content"] = msg["reasoning"] = reasoning
        if self.tool_parser is not None:
            extracted = self.tool_parser.extract(content or "")
            if extracted.tools_called:
                self.tools_called = True
                calls = extracted.tool_calls[: self.max_calls]
                msg["tool_calls"] = [c.to_dict() for c in calls]
                content = extracted.content
        if self.tools_called:
            msg["content"] = content or None
        else:  # without a reasoning parser, the text as it came (an empty string included)
            msg["content"] = content if self.reasoning_parser is not None else text
        return msg

    # ------------------------------------------------------------ streamed

    def feed(self, text: str, final: bool) -> dict[str, Any]:
        """The stream delta for the new ``text`` (``final``: the choice has finished)."""
        delta: dict[str, Any] = {}
        content = text
        if self.reasoning_parser is not None:
            if self._r_stream is None:
                self._r_stream = self.reasoning_parser.streamer()
            r1, c1 = self._r_stream.feed(text)
            r2, c2 = self._r_stream.finish() if final else ("", "")
            reasoning, content = r1 + r2, c1 + c2
            if reasoning and self.include_reasoning:
                delta["reasoning_content"] = delta["reasoning"] = reasoning
        if self.tool_parser is not None:
            if self._t_stream is None:
                self._t_stream = self.tool_parser.streamer()
            c1, calls = self._t_stream.feed(content)
            if final:
                c2, more = self._t_stream.finish()
                c1, calls = c1 + c2, calls + more
            content = c1
            if self.max_calls is not None:
                calls = [c for c in calls if c["index"] < self.max_calls]
            if calls:
                delta["tool_calls"] = calls
            self.tools_called = self._t_stream.tools_called
        if content:
            delta["content"] = content
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        """vLLM's rule: "tool_calls" when "auto" found calls, or "required" stopped; a named
        function finishes with "stop", as OpenAI answers."""
        if (
            self.tools_called
            and reason is not None
            and (self.mode == "auto" or (self.mode == "required" and reason == "stop"))
        ):
            return "tool_calls"
        return reason
