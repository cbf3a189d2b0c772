"""Coverage of the HTTP request models' fields: ``Class.field`` -> node ids."""

from __future__ import annotations

from field_coverage.ids import (
    AUDIO_HTTP,
    BEAM,
    CLS,
    CUSTOM_LP,
    FAULTS,
    FE,
    FEC,
    HOSTILE,
    LLAVA_HTTP,
    MESSAGES,
    ONEVISION_HTTP,
    OPENAI,
    POOL,
    REFUSED_TYPES,
    REQ,
    RESP,
    STRUCTURED,
    TOKENIZE,
    TOOLS_HTTP,
    VLLM_LIST,
    WHOLE_VOCAB,
    ids,
)

_PLT = "tests/entrypoints/test_prompt_logprobs_temperature.py::"

# Fields both /v1/completions and /v1/chat/completions take; the tests run on both endpoints.
_SAMPLING = {
    "model": ids(FE + "test_model_must_be_served"),
    "n": ids(FE + "test_n_gives_independent_choices", OPENAI + "test_n_and_seed"),
    "temperature": ids(FE + "test_temperature_and_seed"),
    "top_p": ids(FE + "test_top_k_top_p_min_p_that_keep_one_token_give_the_greedy_output"),
    "top_k": ids(FE + "test_top_k_top_p_min_p_that_keep_one_token_give_the_greedy_output"),
    "min_p": ids(FE + "test_top_k_top_p_min_p_that_keep_one_token_give_the_greedy_output"),
    "presence_penalty": ids(FE + "test_penalties_make_a_repetitive_output_less_repetitive"),
    "frequency_penalty": ids(FE + "test_penalties_make_a_repetitive_output_less_repetitive"),
    "repetition_penalty": ids(FE + "test_penalties_make_a_repetitive_output_less_repetitive"),
    "logit_bias": ids(
        FE + "test_logit_bias_forces_a_token",
        HOSTILE + "test_an_oversized_logit_bias_is_refused_before_it_is_parsed",
    ),
    "seed": ids(FE + "test_temperature_and_seed", OPENAI + "test_n_and_seed"),
    "stop": ids(FE + "test_stop_strings_and_include_stop_str_in_output"),
    "stream": ids(FE + "test_stream_and_stream_options"),
    "stream_options": ids(FE + "test_stream_and_stream_options"),
    "response_format": ids(STRUCTURED),
    "stop_token_ids": ids(FE + "test_stop_token_ids"),
    "ignore_eos": ids(FE + "test_eos_fields_ignore_eos_min_tokens_skip_special_tokens"),
    "min_tokens": ids(FE + "test_eos_fields_ignore_eos_min_tokens_skip_special_tokens"),
    "skip_special_tokens": ids(FE + "test_eos_fields_ignore_eos_min_tokens_skip_special_tokens"),
    "include_stop_str_in_output": ids(FE + "test_stop_strings_and_include_stop_str_in_output"),
    "spaces_between_special_tokens": ids(FEC + "test_spaces_between_special_tokens"),
    "prompt_logprobs": ids(
        FE + "test_return_token_ids_and_prompt_logprobs",
        WHOLE_VOCAB + "test_prompt_logprobs_minus_one_is_every_token_at_every_position",
    ),
    # the prompt logprobs equal transformers' log_softmax(logits / T), completions and chat;
    # a value that is not a positive number refused by name
    "prompt_logprobs_temperature": ids(
        _PLT + "test_prompt_logprobs_equal_transformers_at_the_temperature",
        _PLT + "test_chat_prompt_logprobs_follow_the_temperature",
        _PLT + "test_a_value_that_is_not_a_positive_number_is_refused_by_name",
    ),
    "priority": ids(FEC + "test_priority_needs_the_priority_policy"),
    "cache_salt": ids(FE + "test_cache_salt_separates_prefix_cache_hits"),
    "return_token_ids": ids(FE + "test_return_token_ids_and_prompt_logprobs"),
    "allowed_token_ids": ids(FE + "test_allowed_token_ids_and_bad_words"),
    "bad_words": ids(FE + "test_allowed_token_ids_and_bad_words"),
    "truncate_prompt_tokens": ids(FE + "test_truncate_prompt_tokens"),
    "return_tokens_as_token_ids": ids(FE + "test_logprobs_and_return_tokens_as_token_ids"),
    # the ids' logprobs equal transformers' (completions and chat, streamed and not); refused
    # without logprobs, over the length bound or outside the vocabulary
    "logprob_token_ids": ids(
        "tests/entrypoints/test_logprob_ids_thinking_budget.py::"
        "test_completion_logprob_token_ids_equal_transformers",
        "tests/entrypoints/test_logprob_ids_thinking_budget.py::"
        "test_chat_logprob_token_ids_equal_transformers_streamed_and_not",
        "tests/entrypoints/test_logprob_ids_thinking_budget.py::"
        "test_logprob_token_ids_refusals_name_the_field",
    ),
    # </think> forced at the budget, the rest transformers' continuation; refused by name
    # without --reasoning-parser and with beam search
    "thinking_token_budget": ids(
        "tests/entrypoints/test_logprob_ids_thinking_budget.py::"
        "test_thinking_budget_forces_the_end_of_reasoning",
        "tests/entrypoints/test_thinking_budget_refusals.py::"
        "test_without_a_reasoning_parser_the_budget_is_refused_by_name",
    ),
    # n beams as the choices, equal to LLM.beam_search (itself equal to transformers')
    "use_beam_search": ids(BEAM + "test_completion_choices_are_the_beams"),
    "length_penalty": ids(
        BEAM + "test_completion_choices_are_the_beams",
        BEAM + "test_what_cannot_combine_is_refused_by_name",
    ),
    "early_stopping": ids(
        BEAM + "test_completion_choices_are_the_beams",
        BEAM + "test_what_cannot_combine_is_refused_by_name",
    ),
    "structured_outputs": ids(STRUCTURED),
    "guided_json": ids(STRUCTURED),
    "guided_regex": ids(STRUCTURED),
    "guided_choice": ids(STRUCTURED),
    "guided_grammar": ids(STRUCTURED),
    "request_id": ids(
        FE + "test_request_id_names_the_response",
        HOSTILE + "test_a_duplicate_request_id_is_refused_and_the_original_runs_on",
    ),
    "timeout": ids(FE + "test_timeout_ends_the_request", FAULTS + "test_timeout_ends_request"),
    "stream_interval": ids(VLLM_LIST + "test_stream_interval_gives_chunks_of_that_many_tokens"),
    "truncation_side": ids(VLLM_LIST + "test_truncation_side_picks_the_end_that_is_kept"),
    # extra_args of the request: a custom logits processor's target token on both endpoints;
    # what the processor's validate_params refuses, and values not strings/numbers, are 400s
    "vllm_xargs": ids(
        CUSTOM_LP + "test_vllm_xargs_over_http", CUSTOM_LP + "test_bad_vllm_xargs_are_400s"
    ),
}

_CHAT = {
    # the image processor's keywords: greedy-exact vs transformers with them; unknown keys and
    # sizes the vision tower cannot take refused by name
    "mm_processor_kwargs": ids(LLAVA_HTTP + "test_mm_processor_kwargs_per_request"),
    # a video_url's frames: num_frames and fps keep vLLM's choice of frames (greedy-exact on
    # them); other options, other modalities' and counts over the frame cap refused by name
    "media_io_kwargs": ids(
        ONEVISION_HTTP + "test_media_io_kwargs_choose_a_video_urls_frames",
        ONEVISION_HTTP + "test_media_io_kwargs_refusals",
    ),
    "max_tokens": ids(FE + "test_max_tokens"),
    "messages": ids(MESSAGES),
    "logprobs": ids(FE + "test_logprobs_and_return_tokens_as_token_ids"),
    "top_logprobs": ids(FE + "test_logprobs_and_return_tokens_as_token_ids"),
    "max_completion_tokens": ids(FE + "test_max_completion_tokens_is_chats_max_tokens"),
    "add_generation_prompt": ids(MESSAGES),
    "continue_final_message": ids(FEC + "test_continue_final_message_leaves_the_last_message_open"),
    "chat_template": ids(
        FEC + "test_chat_template_in_a_request_replaces_the_servers",
        FEC + "test_log_level_and_request_chat_templates",
    ),
    "chat_template_kwargs": ids(MESSAGES, FEC + "test_server_chat_template_and_its_kwargs"),
    "tools": ids(MESSAGES, TOOLS_HTTP + "test_tool_choice_none_renders_tools_and_parses_nothing"),
    "tool_choice": ids(
        TOOLS_HTTP + "test_tool_choice_none_renders_tools_and_parses_nothing",
        TOOLS_HTTP + "test_named_function_gives_that_call",
        TOOLS_HTTP + "test_required_gives_valid_calls",
    ),
    "parallel_tool_calls": ids(
        TOOLS_HTTP + "test_auto_parses_a_hermes_call_streamed_and_not",
        TOOLS_HTTP + "test_required_gives_valid_calls",
    ),
    "include_reasoning": ids(
        TOOLS_HTTP + "test_enable_thinking_puts_the_output_in_reasoning",
        "tests/parsers/test_reasoning.py::test_include_reasoning_false_drops_it",
    ),
    "documents": ids(MESSAGES),
    "echo": ids(REQ + "test_chat_echo_prepends_the_assistants_last_message"),
    # the template's reasoning_effort and enable_thinking, as vLLM renders them
    "reasoning_effort": ids(
        VLLM_LIST + "test_reasoning_effort_reaches_the_template_as_vllm_renders_it"
    ),
    "add_special_tokens": ids(FEC + "test_add_special_tokens_and_the_tokenizer_flag"),
}

_COMPLETION = {
    "prompt": ids(FEC + "test_prompt_as_text_ids_and_lists"),
    "max_tokens": ids(FE + "test_max_tokens"),
    "echo": ids(FEC + "test_echo_suffix_best_of", OPENAI + "test_echo"),
    "logprobs": ids(
        FE + "test_logprobs_and_return_tokens_as_token_ids",
        OPENAI + "test_logprobs_match_transformers",
        WHOLE_VOCAB + "test_completion_logprobs_minus_one_is_the_whole_vocabulary",
    ),
    "suffix": ids(FEC + "test_echo_suffix_best_of"),
    "best_of": ids(FEC + "test_echo_suffix_best_of"),
    "add_special_tokens": ids(FEC + "test_add_special_tokens_and_the_tokenizer_flag"),
    # --enable-prompt-embeds: equal to the token prompt; bad tensors, echo, prompt_logprobs 400
    "prompt_embeds": ids(
        "tests/entrypoints/test_prompt_embeds_http.py::test_embeds_equal_the_token_prompt",
        "tests/entrypoints/test_prompt_embeds_http.py::test_bad_inputs_are_400s_naming_the_field",
    ),
}

_NESTED = {
    "StreamOptions.include_usage": ids(FE + "test_stream_and_stream_options"),
    "StreamOptions.continuous_usage_stats": ids(FE + "test_stream_and_stream_options"),
    "ResponseFormat.type": ids(STRUCTURED),
    "ResponseFormat.json_schema": ids(STRUCTURED),
    "ResponseFormat.format": ids(STRUCTURED),
    "ResponseFormat.structures": ids(FE + "test_structural_tag_structures_and_triggers"),
    "ResponseFormat.triggers": ids(FE + "test_structural_tag_structures_and_triggers"),
    "JsonSchemaSpec.schema": ids(STRUCTURED),
    "StructuredOutputs.json": ids(STRUCTURED),
    "StructuredOutputs.regex": ids(STRUCTURED),
    "StructuredOutputs.choice": ids(STRUCTURED),
    "StructuredOutputs.grammar": ids(STRUCTURED),
    "StructuredOutputs.json_object": ids(STRUCTURED),
    "StructuredOutputs.structural_tag": ids(STRUCTURED),
    "StructuredOutputs.disable_any_whitespace": ids(FE + "test_disable_any_whitespace"),
    "TextPart.type": ids(
        REFUSED_TYPES, "tests/entrypoints/test_server_units.py::test_non_text_parts_are_refused"
    ),
    "TextPart.text": ids(MESSAGES),
    # data:, file:// and http(s) URL images for a model that takes them (the same answer);
    # bad data, paths outside the allowed directory, hosts outside the allowed domains and
    # fetches that hang, run over the size or bring no image refused by name
    "TextPart.image_url": ids(
        LLAVA_HTTP + "test_data_url_image_is_greedy_exact",
        LLAVA_HTTP + "test_bad_image_parts_are_400_naming_them",
        LLAVA_HTTP + "test_file_and_http_urls_answer_as_the_data_url_does",
        LLAVA_HTTP + "test_bad_urls_are_400_within_the_limit_while_a_stream_runs",
    ),
    "ImageURL.url": ids(
        LLAVA_HTTP + "test_data_url_image_is_greedy_exact",
        LLAVA_HTTP + "test_bad_image_parts_are_400_naming_them",
        LLAVA_HTTP + "test_file_and_http_urls_answer_as_the_data_url_does",
        LLAVA_HTTP + "test_bad_urls_are_400_within_the_limit_while_a_stream_runs",
    ),
    # base64 WAV (and audio_url's data:, file:// and http(s) URLs) for a model that takes
    # audio, greedy-exact; mp3, bad data, long clips and disallowed hosts refused by name
    "TextPart.input_audio": ids(
        AUDIO_HTTP + "test_input_audio_is_greedy_exact_and_audio_urls_answer_the_same",
        AUDIO_HTTP + "test_bad_audio_is_400_naming_it_while_a_stream_runs",
    ),
    "TextPart.audio_url": ids(
        AUDIO_HTTP + "test_input_audio_is_greedy_exact_and_audio_urls_answer_the_same",
        AUDIO_HTTP + "test_bad_audio_is_400_naming_it_while_a_stream_runs",
    ),
    # an MP4 data: URL greedy-exact on the tiny Qwen2.5-VL; a bomb, bad data refused by name
    "TextPart.video_url": ids(
        "tests/entrypoints/test_qwen2_vl_video_http.py::test_data_url_video_is_greedy_exact",
        "tests/entrypoints/test_qwen2_vl_video_http.py::test_bad_videos_are_400_naming_them",
    ),
    "InputAudio.data": ids(
        AUDIO_HTTP + "test_input_audio_is_greedy_exact_and_audio_urls_answer_the_same",
        AUDIO_HTTP + "test_bad_audio_is_400_naming_it_while_a_stream_runs",
    ),
    "InputAudio.format": ids(AUDIO_HTTP + "test_bad_audio_is_400_naming_it_while_a_stream_runs"),
    "ChatMessage.role": ids(MESSAGES),
    "ChatMessage.content": ids(MESSAGES),
    "ChatMessage.name": ids(MESSAGES),
    "ChatMessage.tool_calls": ids(MESSAGES, TOOLS_HTTP + "test_tool_history_is_rendered"),
    "ChatMessage.tool_call_id": ids(MESSAGES),
    "ChatMessage.reasoning_content": ids(MESSAGES),
    "ChatMessage.reasoning": ids(MESSAGES),
    "ToolCall.function": ids(MESSAGES),
    "ToolCall.id": ids(MESSAGES),
    "ToolCall.type": ids(MESSAGES, REFUSED_TYPES),
    "FunctionCall.name": ids(MESSAGES),
    "FunctionCall.arguments": ids(MESSAGES, TOOLS_HTTP + "test_tool_history_is_rendered"),
    "ChatTool.function": ids(MESSAGES),
    "ChatTool.type": ids(MESSAGES, REFUSED_TYPES),
    "FunctionDefinition.name": ids(MESSAGES, TOOLS_HTTP + "test_named_function_gives_that_call"),
    "FunctionDefinition.description": ids(MESSAGES),
    "FunctionDefinition.parameters": ids(
        MESSAGES, TOOLS_HTTP + "test_named_function_gives_that_call"
    ),
    "FunctionDefinition.strict": ids(MESSAGES),
    "NamedToolChoice.function": ids(
        TOOLS_HTTP + "test_named_function_gives_that_call", REFUSED_TYPES
    ),
    "NamedToolChoice.type": ids(REFUSED_TYPES),
    "NamedFunction.name": ids(TOOLS_HTTP + "test_named_function_gives_that_call", REFUSED_TYPES),
    "TokenizeRequest.model": ids(TOKENIZE),
    "TokenizeRequest.prompt": ids(TOKENIZE),
    "TokenizeRequest.messages": ids(TOKENIZE),
    "TokenizeRequest.add_special_tokens": ids(
        FEC + "test_add_special_tokens_and_the_tokenizer_flag"
    ),
    "TokenizeRequest.add_generation_prompt": ids(TOKENIZE),
    "TokenizeRequest.continue_final_message": ids(TOKENIZE),
    "TokenizeRequest.chat_template_kwargs": ids(FEC + "test_server_chat_template_and_its_kwargs"),
    "TokenizeRequest.return_token_strs": ids(TOKENIZE),
    "TokenizeRequest.tools": ids(
        "tests/entrypoints/test_tokenize_tools.py::test_tokenize_renders_the_tools"
    ),
    "TokenizeRequest.mm_processor_kwargs": ids(
        LLAVA_HTTP + "test_tokenize_gives_the_expanded_prompt"
    ),
    "DetokenizeRequest.tokens": ids(TOKENIZE),
    "DetokenizeRequest.model": ids(TOKENIZE),
}

# /v1/responses (tests/entrypoints/test_responses_api.py)
_R_TEXT = RESP + "test_text_equals_the_chat_completion"
_R_SAMPLING = RESP + "test_sampling_fields_reach_the_engine"
_R_TOOLS = RESP + "test_named_tool_gives_a_function_call_item"
_R_TOOL_FIELDS = RESP + "test_tool_fields_reach_the_template_and_parallel_tool_calls"
_R_FORMAT = RESP + "test_text_format_json_schema_constrains_the_output"
_R_REASONING = RESP + "test_reasoning_effort_gives_a_reasoning_item"
_R_REFUSED = RESP + "test_refused_fields_are_named"
_R_EXT = RESP + "test_vllm_extensions_request_id_cache_salt_priority_timeout"
_R_STORE = "tests/entrypoints/test_responses_store.py::"
_RESPONSES = {
    "ResponsesRequest.input": ids(
        _R_TEXT, RESP + "test_function_call_history_is_the_chat_tool_history"
    ),
    "ResponsesRequest.instructions": ids(_R_TEXT),
    "ResponsesRequest.model": ids(_R_REFUSED),
    "ResponsesRequest.max_output_tokens": ids(_R_TEXT, _R_SAMPLING),
    "ResponsesRequest.temperature": ids(_R_SAMPLING),
    "ResponsesRequest.top_p": ids(_R_SAMPLING),
    "ResponsesRequest.stream": ids(RESP + "test_stream_events_in_order_and_deltas_make_the_text"),
    "ResponsesRequest.tools": ids(_R_TOOLS, _R_TOOL_FIELDS),
    "ResponsesRequest.tool_choice": ids(_R_TOOLS, _R_TOOL_FIELDS),
    "ResponsesRequest.parallel_tool_calls": ids(_R_TOOL_FIELDS),
    "ResponsesRequest.text": ids(_R_FORMAT),
    "ResponsesRequest.reasoning": ids(_R_REASONING),
    "ResponsesRequest.metadata": ids(_R_SAMPLING),
    "ResponsesRequest.user": ids(_R_SAMPLING),
    "ResponsesRequest.vllm_xargs": ids(CUSTOM_LP + "test_vllm_xargs_over_http"),
    "ResponsesRequest.thinking_token_budget": ids(
        RESP + "test_thinking_token_budget_ends_the_reasoning_item"
    ),
    "ResponsesRequest.store": ids(
        RESP + "test_without_the_store",
        _R_STORE + "test_a_stored_response_is_returned_by_get",
        _R_STORE + "test_store_false_is_not_kept",
    ),
    **{
        f"ResponsesRequest.{name}": ids(RESP + "test_vllm_sampling_extras_as_on_chat")
        for name in (
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "seed",
        )
    },
    "ResponsesRequest.background": ids(
        _R_STORE + "test_background_runs_after_the_answer",
        _R_STORE + "test_cancel_stops_a_background_response",
        _R_REFUSED,
    ),
    "ResponsesRequest.enable_response_messages": ids(
        _R_STORE + "test_enable_response_messages_gives_the_raw_prompt_and_output"
    ),
    "ResponsesRequest.previous_response_id": ids(
        _R_STORE + "test_previous_response_id_continues_the_conversation",
        RESP + "test_without_the_store",
    ),
    "ResponsesRequest.truncation": ids(_R_REFUSED),
    "ResponsesRequest.service_tier": ids(_R_REFUSED),
    "ResponsesRequest.request_id": ids(_R_EXT),
    "ResponsesRequest.priority": ids(_R_EXT),
    "ResponsesRequest.cache_salt": ids(_R_EXT),
    "ResponsesRequest.timeout": ids(_R_EXT),
    "ResponsesFunctionTool.type": ids(_R_REFUSED),
    "ResponsesFunctionTool.name": ids(_R_TOOLS),
    "ResponsesFunctionTool.description": ids(_R_TOOL_FIELDS),
    "ResponsesFunctionTool.parameters": ids(_R_TOOLS),
    "ResponsesFunctionTool.strict": ids(_R_TOOL_FIELDS),
    "ResponsesToolChoiceFunction.type": ids(_R_REFUSED),
    "ResponsesToolChoiceFunction.name": ids(_R_TOOLS, _R_REFUSED),
    "ResponsesText.format": ids(_R_FORMAT),
    "ResponsesText.verbosity": ids(_R_REFUSED),
    "ResponsesTextFormat.type": ids(_R_FORMAT),
    "ResponsesTextFormat.name": ids(_R_FORMAT),
    "ResponsesTextFormat.schema": ids(_R_FORMAT, _R_REFUSED),
    "ResponsesTextFormat.description": ids(_R_FORMAT),
    "ResponsesTextFormat.strict": ids(_R_FORMAT),
    "ResponsesReasoning.effort": ids(_R_REASONING, _R_REFUSED),
    "ResponsesReasoning.summary": ids(_R_REFUSED),
    "ResponsesReasoning.generate_summary": ids(_R_REFUSED),
}

_EMBEDDING = {
    "input": ids(
        POOL + "test_v1_embeddings_with_the_openai_client",
        POOL + "test_token_id_input_and_encoding_format",
        POOL + "test_what_the_pooling_routes_refuse",
    ),
    "model": ids(POOL + "test_what_the_pooling_routes_refuse"),
    "encoding_format": ids(POOL + "test_token_id_input_and_encoding_format"),
    "dimensions": ids(POOL + "test_what_the_pooling_routes_refuse"),
    "truncate_prompt_tokens": ids(POOL + "test_truncate_prompt_tokens_keeps_the_last_tokens"),
}

_CLASSIFY = {
    "input": ids(
        CLS + "test_classify_route_answers_in_vllms_shape",
        CLS + "test_what_the_classify_server_refuses",
    ),
    "model": ids(CLS + "test_what_the_classify_server_refuses"),
    "truncate_prompt_tokens": ids(CLS + "test_truncate_prompt_tokens_keeps_the_last_tokens"),
}

REQUEST_FIELDS: dict[str, tuple[str, ...]] = {
    **{f"ChatCompletionRequest.{k}": v for k, v in {**_SAMPLING, **_CHAT}.items()},
    **{f"CompletionRequest.{k}": v for k, v in {**_SAMPLING, **_COMPLETION}.items()},
    **_NESTED,
    **_RESPONSES,
    **{
        f"{cls}.{k}": v
        for cls in ("EmbeddingRequest", "PoolingRequest")
        for k, v in _EMBEDDING.items()
    },
    **{f"ClassificationRequest.{k}": v for k, v in _CLASSIFY.items()},
}
