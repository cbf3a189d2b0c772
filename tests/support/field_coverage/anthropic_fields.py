"""Coverage of /v1/messages' and /v1/messages/count_tokens' request fields: ``Class.field`` ->
node ids."""

from __future__ import annotations

from field_coverage.ids import ids

MSG = "tests/entrypoints/test_anthropic_messages.py::"
_TEXT = MSG + "test_text_equals_the_chat_completion"
_SAMPLING = MSG + "test_sampling_fields_reach_the_engine"
_BAD = MSG + "test_bad_input_is_a_400_in_anthropics_shape"
_FORCED = MSG + "test_forced_tool_choices_equal_chats_tool_calls"
_COUNT = MSG + "test_count_tokens_is_the_prompt"
_COMMON = {
    "model": ids(_TEXT, MSG + "test_unknown_model_and_route_in_anthropics_shape"),
    "messages": ids(_TEXT, MSG + "test_tool_result_round_trip", _BAD),
    "system": ids(_TEXT),
    "tools": ids(_FORCED, MSG + "test_tool_choice_auto_and_none_answer_text", _BAD),
    "tool_choice": ids(_FORCED, MSG + "test_tool_choice_auto_and_none_answer_text", _BAD),
    "chat_template_kwargs": ids(MSG + "test_thinking_blocks_from_the_reasoning_parser"),
    "thinking": ids(_BAD),
    "cache_control": ids(_BAD),
}
_COUNT_ONLY = {
    "model": ids(_COUNT, MSG + "test_unknown_model_and_route_in_anthropics_shape"),
    **{
        name: ids(_COUNT)
        for name in (
            "messages",
            "system",
            "tools",
            "tool_choice",
            "chat_template_kwargs",
            "thinking",
            "cache_control",
        )
    },
}
_MESSAGES = {
    "max_tokens": ids(_SAMPLING, _BAD),
    "stop_sequences": ids(MSG + "test_stop_sequences"),
    "temperature": ids(_SAMPLING, _BAD),
    "top_p": ids(_SAMPLING),
    "top_k": ids(_SAMPLING, _BAD),
    "stream": ids(
        MSG + "test_stream_final_message_equals_the_message",
        MSG + "test_stream_events_as_anthropic_sends_them",
    ),
    "metadata": ids(_BAD),
    "service_tier": ids(_BAD),
}
ANTHROPIC_FIELDS: dict[str, tuple[str, ...]] = {
    **{f"CountTokensRequest.{k}": v for k, v in _COUNT_ONLY.items()},
    **{f"MessagesRequest.{k}": v for k, v in {**_COMMON, **_MESSAGES}.items()},
}
