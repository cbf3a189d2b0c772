"""The table tests/test_field_coverage.py checks: each request field, SamplingParams /
EngineArgs field and ``trillm serve`` flag -> tests that show its effect or its refusal.

Keys: ``Class.field`` for request models and dataclasses, ``--flag`` (first long name) or the
metavar (``MODEL``) for ``trillm serve``. Values: node ids; a parametrized test is named by its
function. Every test listed was read to confirm it observes the field (an output that changes,
an error that names it), not only that a request holding it is accepted.
"""

from __future__ import annotations

FE = "tests/test_field_effects.py::"
FEE = "tests/test_field_effects_engine.py::"
OPENAI = "tests/test_server_openai.py::"
TOOLS_HTTP = "tests/test_tool_calling_http.py::"
TOOLS = "tests/test_tool_calling.py::"
SAMPLER = "tests/test_sampler.py::"
SCHED = "tests/test_scheduler.py::"
OUTPUT = "tests/test_output_processor.py::"
LIFE = "tests/test_server_lifecycle.py::"
FAULTS = "tests/fault/test_lifecycle_faults.py::"
HOSTILE = "tests/fault/test_hostile_requests.py::"
UNITS = "tests/test_server_units.py::"
SO_UNIT = "tests/test_structured_output.py::"
REQ = "tests/test_request_fields.py::"
LOADING = "tests/test_model_loading.py::"
FP8 = "tests/test_quantization_fp8.py::"
KV_DTYPE = "tests/test_kv_cache_dtype.py::"
SO_REASONING = "tests/test_structured_output_reasoning.py::"
POOL = "tests/test_pooling.py::"
CLS = "tests/test_classify.py::"
RESP = "tests/test_responses_api.py::"
TP = "tests/test_tensor_parallel.py::"
DP = "tests/test_data_parallel.py::"
MN = "tests/test_multinode.py::"
PP = "tests/test_pipeline_parallel.py::"
LORA = "tests/test_lora.py::"
GGUF = "tests/test_gguf.py::"
AWQ = "tests/test_awq_gptq.py::"
LORA_HTTP = "tests/test_lora_http.py::"
SPEC = "tests/test_spec_decode.py::"
SPEC_E = "tests/test_spec_decode_engine.py::"
SPEC_D = "tests/test_spec_decode_draft.py::"


def ids(*node_ids: str) -> tuple[str, ...]:
    return node_ids


STRUCTURED = FE + "test_structured_outputs_constrain_the_text"
MESSAGES = FE + "test_message_and_tool_fields_reach_the_template"
REFUSED_TYPES = FE + "test_tool_and_part_types_other_than_function_and_text_are_refused"
TOKENIZE = FE + "test_tokenize_and_detokenize_fields"
FLAG_MAP = FEE + "test_engine_flags_reach_the_engine"
CONFIG = FEE + "test_engine_args_reach_the_config"
ENGINE_REFUSED = FEE + "test_engine_args_that_cannot_be_honoured_are_refused"
ACT = FEE + "test_engine_args_act_on_requests"

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
    "spaces_between_special_tokens": ids(FE + "test_spaces_between_special_tokens"),
    "prompt_logprobs": ids(FE + "test_return_token_ids_and_prompt_logprobs"),
    "priority": ids(FE + "test_priority_needs_the_priority_policy"),
    "cache_salt": ids(FE + "test_cache_salt_separates_prefix_cache_hits"),
    "return_token_ids": ids(FE + "test_return_token_ids_and_prompt_logprobs"),
    "allowed_token_ids": ids(FE + "test_allowed_token_ids_and_bad_words"),
    "bad_words": ids(FE + "test_allowed_token_ids_and_bad_words"),
    "truncate_prompt_tokens": ids(FE + "test_truncate_prompt_tokens"),
    "return_tokens_as_token_ids": ids(FE + "test_logprobs_and_return_tokens_as_token_ids"),
    "use_beam_search": ids(REQ + "test_refused_fields_name_themselves"),
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
}

_CHAT = {
    "max_tokens": ids(FE + "test_max_tokens"),
    "messages": ids(MESSAGES),
    "logprobs": ids(FE + "test_logprobs_and_return_tokens_as_token_ids"),
    "top_logprobs": ids(FE + "test_logprobs_and_return_tokens_as_token_ids"),
    "max_completion_tokens": ids(FE + "test_max_completion_tokens_is_chats_max_tokens"),
    "add_generation_prompt": ids(MESSAGES),
    "continue_final_message": ids(FE + "test_continue_final_message_leaves_the_last_message_open"),
    "chat_template": ids(
        FE + "test_chat_template_in_a_request_replaces_the_servers",
        FE + "test_log_level_and_request_chat_templates",
    ),
    "chat_template_kwargs": ids(MESSAGES, FE + "test_server_chat_template_and_its_kwargs"),
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
        "tests/test_reasoning.py::test_include_reasoning_false_drops_it",
    ),
    "documents": ids(MESSAGES),
    "echo": ids(REQ + "test_chat_echo_prepends_the_assistants_last_message"),
}

_COMPLETION = {
    "prompt": ids(FE + "test_prompt_as_text_ids_and_lists"),
    "max_tokens": ids(FE + "test_max_tokens"),
    "echo": ids(FE + "test_echo_suffix_best_of", OPENAI + "test_echo"),
    "logprobs": ids(
        FE + "test_logprobs_and_return_tokens_as_token_ids",
        OPENAI + "test_logprobs_match_transformers",
    ),
    "suffix": ids(FE + "test_echo_suffix_best_of"),
    "best_of": ids(FE + "test_echo_suffix_best_of"),
    "add_special_tokens": ids(FE + "test_add_special_tokens_and_the_tokenizer_flag"),
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
        REFUSED_TYPES, "tests/test_server_units.py::test_non_text_parts_are_refused"
    ),
    "TextPart.text": ids(MESSAGES),
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
        FE + "test_add_special_tokens_and_the_tokenizer_flag"
    ),
    "TokenizeRequest.add_generation_prompt": ids(TOKENIZE),
    "TokenizeRequest.continue_final_message": ids(TOKENIZE),
    "TokenizeRequest.chat_template_kwargs": ids(FE + "test_server_chat_template_and_its_kwargs"),
    "TokenizeRequest.return_token_strs": ids(TOKENIZE),
    "DetokenizeRequest.tokens": ids(TOKENIZE),
    "DetokenizeRequest.model": ids(TOKENIZE),
}

_PARAMS = {
    "n": ids(FEE + "test_temperature_seed_n"),
    "presence_penalty": ids(FEE + "test_penalties_make_a_repetitive_output_less_repetitive",
                            SAMPLER + "test_penalties_follow_the_formulas"),
    "frequency_penalty": ids(FEE + "test_penalties_make_a_repetitive_output_less_repetitive",
                             SAMPLER + "test_penalties_follow_the_formulas"),
    "repetition_penalty": ids(FEE + "test_penalties_make_a_repetitive_output_less_repetitive",
                              SAMPLER + "test_penalties_follow_the_formulas"),
    "temperature": ids(FEE + "test_temperature_seed_n",
                       SAMPLER + "test_temperature_matches_softmax_of_scaled_logits"),
    "top_p": ids(FEE + "test_top_k_top_p_min_p_that_keep_one_token_give_the_greedy_output",
                 SAMPLER + "test_top_p_never_emits_outside_the_nucleus"),
    "top_k": ids(FEE + "test_top_k_top_p_min_p_that_keep_one_token_give_the_greedy_output",
                 SAMPLER + "test_top_k_never_emits_outside_the_top_k"),
    "min_p": ids(FEE + "test_top_k_top_p_min_p_that_keep_one_token_give_the_greedy_output",
                 SAMPLER + "test_min_p_drops_tokens_below_the_scaled_top_probability"),
    "seed": ids(FEE + "test_temperature_seed_n",
                SAMPLER + "test_seeded_requests_reproduce_across_batches_and_slots"),
    "stop": ids(FEE + "test_stop_stop_token_ids_include_stop_str_in_output"),
    "stop_token_ids": ids(FEE + "test_stop_stop_token_ids_include_stop_str_in_output"),
    "bad_words": ids(FEE + "test_logit_bias_allowed_token_ids_bad_words"),
    "ignore_eos": ids(FEE + "test_eos_fields_and_detokenize"),
    "max_tokens": ids(FEE + "test_eos_fields_and_detokenize"),
    "min_tokens": ids(FEE + "test_eos_fields_and_detokenize"),
    "logprobs": ids(FEE + "test_logprobs_and_prompt_logprobs"),
    "prompt_logprobs": ids(FEE + "test_logprobs_and_prompt_logprobs"),
    "detokenize": ids(FEE + "test_eos_fields_and_detokenize",
                      OUTPUT + "test_detokenize_false_gives_no_text"),
    "skip_special_tokens": ids(FEE + "test_eos_fields_and_detokenize"),
    "include_stop_str_in_output": ids(FEE + "test_stop_stop_token_ids_include_stop_str_in_output"),
    "spaces_between_special_tokens": ids(FEE + "test_spaces_between_special_tokens"),
    "logit_bias": ids(FEE + "test_logit_bias_allowed_token_ids_bad_words"),
    "allowed_token_ids": ids(FEE + "test_logit_bias_allowed_token_ids_bad_words"),
    "truncate_prompt_tokens": ids(FEE + "test_truncate_prompt_tokens"),
    "output_kind": ids(OUTPUT + "test_final_only_gives_one_output",
                       OUTPUT + "test_stalled_reader_gets_merged_outputs"),
    "structured_outputs": ids(FEE + "test_structured_outputs_kinds"),
    # Filled by the input processor, read by the sampler.
    "bad_words_token_ids": ids(SAMPLER + "test_bad_words_single_and_multi_token"),
    "all_stop_token_ids": ids(SAMPLER + "test_min_tokens_suppresses_stop_ids_until_reached"),
}  # fmt: skip

_SO_PARAMS = {
    kind: ids(FEE + "test_structured_outputs_kinds")
    for kind in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
}
_SO_PARAMS["disable_any_whitespace"] = ids(
    FEE + "test_disable_any_whitespace_and_disable_additional_properties",
    SO_UNIT + "test_spec_key_and_options",
)

_ENGINE = {
    "model": ids(ENGINE_REFUSED, LOADING + "test_default_model"),
    "tokenizer": ids(FE + "test_add_special_tokens_and_the_tokenizer_flag"),
    "served_model_name": ids(CONFIG, OPENAI + "test_models"),
    "revision": ids(FEE + "test_revision_reaches_the_hub_download"),
    "dtype": ids(CONFIG, ENGINE_REFUSED, LOADING + "test_explicit_float16_on_cpu_is_an_error"),
    "seed": ids(FEE + "test_engine_seed_sets_unseeded_sampling"),
    "max_model_len": ids(CONFIG, FEE + "test_truncate_prompt_tokens", LOADING + "test_max_model_len"),
    "block_size": ids(FEE + "test_block_size_sets_the_prefix_cache_granularity", ENGINE_REFUSED),
    "max_num_seqs": ids(CONFIG, ENGINE_REFUSED, SCHED + "test_max_num_seqs"),
    "max_num_batched_tokens": ids(CONFIG, SCHED + "test_token_budget_and_chunked_prefill"),
    "long_prefill_token_threshold": ids(CONFIG, SCHED + "test_long_prefill_token_threshold"),
    "enable_prefix_caching": ids(ACT, CONFIG),
    "scheduling_policy": ids(
        CONFIG, FE + "test_priority_needs_the_priority_policy",
        SCHED + "test_priority_preemption_of_a_request_scheduled_earlier_in_the_step",
    ),  # fmt: skip
    "tensor_parallel_size": ids(
        ENGINE_REFUSED, TP + "test_python_api_tp2_matches_tp1",
        TP + "test_http_tp2_matches_tp1_token_for_token",
        TP + "test_tp_size_the_model_cannot_split_is_refused",
        DP + "test_http_dp2_tp2_matches_dp1_token_for_token",
    ),  # fmt: skip
    "data_parallel_size": ids(
        DP + "test_python_api_dp2_matches_dp1_and_spreads_the_requests",
        DP + "test_abort_goes_to_the_core_that_holds_the_request",
        DP + "test_data_parallel_size_below_one_is_refused",
        DP + "test_more_engine_cores_than_gpus_are_refused",
        DP + "test_http_dp2_tp2_matches_dp1_token_for_token",
        DP + "test_metrics_label_each_engine_and_show_the_spread",
        DP + "test_prefix_affinity_keeps_a_shared_prefix_on_one_core",
    ),  # fmt: skip
    "pipeline_parallel_size": ids(
        PP + "test_python_api_pp2_matches_pp1", PP + "test_http_pp2_matches_pp1_token_for_token",
        PP + "test_tp2_x_pp2_matches_pp1", PP + "test_what_pp_cannot_do_is_refused_by_name",
    ),  # fmt: skip
    "kv_cache_memory": ids(CONFIG, FEE + "test_too_few_kv_blocks_for_the_context_are_refused_at_startup"),
    "gpu_memory_utilization": ids(FEE + "test_gpu_memory_utilization_sizes_the_cuda_kv_budget"),
    "num_gpu_blocks_override": ids(
        ACT, FEE + "test_too_few_kv_blocks_for_the_context_are_refused_at_startup"
    ),
    "max_logprobs": ids(ACT, FEE + "test_logprobs_and_prompt_logprobs"),
    "stream_interval": ids(OUTPUT + "test_stream_interval_batches_delta_outputs",
                           LIFE + "test_stream_interval_sends_fewer_larger_chunks"),
    "device": ids(CONFIG, ENGINE_REFUSED),
    "attention_backend": ids(CONFIG, FEE + "test_unknown_attention_backend_is_refused_at_startup"),
    "distributed_executor_backend": ids(CONFIG, FEE + "test_temperature_seed_n"),
    **dict.fromkeys(("nnodes", "node_rank", "master_addr", "master_port"), ids(
        MN + "test_tp2_across_two_nodes_matches_tp1_over_http",
        MN + "test_killed_node1_fails_node0s_requests_and_leaves_no_process",
        MN + "test_node_flags_reach_the_config_and_bad_ones_are_refused",
    )),  # fmt: skip
    "distributed_timeout_seconds": ids(
        TP + "test_stuck_rank_times_out_the_collective_and_is_named",
        MN + "test_node_flags_reach_the_config_and_bad_ones_are_refused",
    ),
    "generation_config": ids(ACT, CONFIG),
    "chat_template": ids(ACT),
    # the tokenizer's code; model code never runs (trillm's own model classes)
    "trust_remote_code": ids(FEE + "test_trust_remote_code_lets_the_tokenizers_code_run"),
    "skip_tokenizer_init": ids(ENGINE_REFUSED),
    "enforce_eager": ids(FEE + "test_enforce_eager_false_is_accepted_and_said_once"),
    # structured outputs constrain only after </think>; a tokenizer without it is refused
    "reasoning_parser": ids(SO_REASONING + "test_engine_constrains_only_after_the_reasoning",
                            SO_REASONING + "test_llm_engine_argument_and_refusal"),
    # fp8 weights change the output (close to, not equal to, unquantized); others refused
    "quantization": ids(FP8 + "test_quantized_model_stays_close_to_the_unquantized_one",
                        FP8 + "test_pack_quantizes_every_linear_but_the_lm_head",
                        FP8 + "test_methods_trillm_cannot_run_are_refused",
                        GGUF + "test_load_format_and_quantization_are_honoured_or_refused",
                        GGUF + "test_quantized_layers_hold_only_their_blocks",
                        AWQ + "test_method_must_match_the_checkpoint",
                        AWQ + "test_greedy_output_equals_transformers_on_the_dequantized_weights"),
    "load_format": ids(GGUF + "test_load_format_and_quantization_are_honoured_or_refused"),
    "dequantize_gguf": ids(GGUF + "test_greedy_output_equals_transformers_on_the_dequantized_weights",
                           GGUF + "test_quantized_layers_hold_only_their_blocks"),
    "enable_lora": ids(LORA + "test_mixed_batch_equals_peft_and_single_runs",
                       LORA + "test_adapter_for_another_model_and_lora_off_are_refused"),
    "max_loras": ids(LORA + "test_more_adapters_than_max_loras_wait_and_rotate",
                     LORA + "test_adapter_for_another_model_and_lora_off_are_refused"),
    "max_lora_rank": ids(LORA + "test_unimplemented_adapters_are_refused_naming_it"),
    # the cache's storage: block bytes, kernels reading it, output close to auto's; refusals
    "kv_cache_dtype": ids(
        KV_DTYPE + "test_cache_dtype_sizes_the_blocks_and_unknown_values_are_refused",
        KV_DTYPE + "test_native_kernel_reads_the_cache_dtype_in_place",
        KV_DTYPE + "test_engine_output_with_a_bf16_and_an_fp8_cache_stays_close",
    ),
    # pooling models: the vector equals transformers' pooled hidden states; refusals named
    "runner": ids(POOL + "test_llm_embed_equals_transformers",
                  POOL + "test_a_generative_engine_refuses_to_embed",
                  POOL + "test_settings_trillm_cannot_honour_are_refused"),
    "convert": ids(POOL + "test_convert_embed_is_the_pooling_runner",
                   POOL + "test_settings_trillm_cannot_honour_are_refused",
                   CLS + "test_classify_route_answers_in_vllms_shape",
                   CLS + "test_convert_classify_needs_a_score_head",
                   CLS + "test_what_a_classifier_does_not_do_is_refused"),
    "pooler_config": ids(POOL + "test_llm_embed_equals_transformers",
                         POOL + "test_the_folder_says_how_to_pool_and_an_override_wins",
                         POOL + "test_settings_trillm_cannot_honour_are_refused"),
    # n-gram / draft-model drafts verified in one forward: same output, fewer forwards; bad
    # configs and drafts with another vocabulary refused
    "speculative_config": ids(SPEC_E + "test_same_output_with_speculation_and_drafts_accepted",
                              SPEC_D + "test_target_copy_as_draft_is_accepted_and_output_is_exact",
                              SPEC_D + "test_draft_with_another_vocabulary_is_refused_by_name",
                              SPEC + "test_speculative_config_refused_with_the_reason"),
}  # fmt: skip

# ``trillm serve`` flags: how each reaches the engine or the server, and what it then does.
_FLAGS = {
    "--headless": ids(MN + "test_tp2_across_two_nodes_matches_tp1_over_http",
                      MN + "test_killed_node1_fails_node0s_requests_and_leaves_no_process",
                      MN + "test_a_headless_node_with_other_engine_flags_is_refused",
                      MN + "test_node_flags_reach_the_config_and_bad_ones_are_refused"),
    **{f"--{name.replace('_', '-')}": _ENGINE[name] for name in (
        "nnodes", "node_rank", "master_addr", "master_port", "distributed_timeout_seconds")},
    "MODEL": ids(FEE + "test_model_positional_and_flag_and_bad_values"),
    "--model": ids(FEE + "test_model_positional_and_flag_and_bad_values"),
    "--host": ids(FE + "test_model_must_be_served"),  # every real-server test binds with it
    "--port": ids(FE + "test_model_must_be_served"),
    "--api-key": ids(LIFE + "test_api_key_guards_v1_routes"),
    "--served-model-name": ids(FLAG_MAP, OPENAI + "test_models"),
    "--chat-template": ids(FE + "test_server_chat_template_and_its_kwargs",
                           TOOLS_HTTP + "test_tool_history_is_rendered"),
    "--trust-request-chat-template": ids(FE + "test_chat_template_in_a_request_replaces_the_servers",
                                         FE + "test_log_level_and_request_chat_templates"),
    "--uvicorn-log-level": ids(FE + "test_log_level_and_request_chat_templates"),
    "--shutdown-timeout": ids(LIFE + "test_sigterm_drains_then_aborts_and_exits_0"),
    "--timeout-keep-alive": ids(
        "tests/fault/test_keepalive.py::test_timeout_keep_alive_flag_reaches_hypercorn"
    ),
    "--max-num-queued-requests": ids(FAULTS + "test_full_queue_answers_503_at_once",
                                     POOL + "test_embedding_inputs_hold_queue_places_until_done"),
    "--max-num-admitted-tokens": ids(
        "tests/fault/test_token_queue_bound.py::test_token_bound_refuses_whole_requests_at_once",
        "tests/fault/test_token_queue_bound.py::test_flag_is_validated",
    ),
    "--tokenizer": ids(FE + "test_add_special_tokens_and_the_tokenizer_flag"),
    "--revision": ids(FLAG_MAP, FEE + "test_revision_reaches_the_hub_download"),
    "--stream-wake-budget": ids(
        UNITS + "test_stream_wake_budget_flag",
        "tests/test_output_wake_budget.py::test_wake_budget_spreads_middle_chunks_first_and_last_at_once",
    ),
    "--runner": ids(FLAG_MAP, TOOLS_HTTP + "test_auto_without_the_flag_is_a_400_and_plugins_load",
                    POOL + "test_v1_embeddings_with_the_openai_client"),
    "--enable-auto-tool-choice": ids(
        TOOLS_HTTP + "test_auto_parses_a_hermes_call_streamed_and_not",
        TOOLS_HTTP + "test_auto_without_the_flag_is_a_400_and_plugins_load",
    ),
    "--tool-call-parser": ids(TOOLS_HTTP + "test_auto_parses_a_hermes_call_streamed_and_not",
                              TOOLS_HTTP + "test_bad_parser_flags_stop_the_cli"),
    "--tool-parser-plugin": ids(TOOLS_HTTP + "test_auto_without_the_flag_is_a_400_and_plugins_load",
                                TOOLS_HTTP + "test_bad_parser_flags_stop_the_cli"),
    "--exclude-tools-when-tool-choice-none": ids(FEE + "test_tool_flags_are_checked_at_startup",
                                                 TOOLS + "test_plan_required_and_auto_and_none"),
    "--reasoning-parser": ids(TOOLS_HTTP + "test_enable_thinking_puts_the_output_in_reasoning",
                              TOOLS_HTTP + "test_bad_parser_flags_stop_the_cli",
                              SO_REASONING + "test_http_reasoning_content_then_schema_content"),
}  # fmt: skip

# vLLM's serve flags (issue 16): honoured, refused naming the flag (features of other open
# issues), or, where what they ask is already so / means nothing here, said once in the log.
VF = "tests/test_vllm_flags.py::"
REFUSED_TOP = VF + "test_top35_flag_of_another_issue_refused"
MOOT = VF + "test_moot_flags_say_so_once"
TLS = VF + "test_tls_and_request_log"
CORS = ids(VF + "test_preflight_needs_no_api_key_and_names_what_is_disallowed",
           VF + "test_cors_headers_on_answers_and_errors")  # fmt: skip
_VLLM_FLAGS = {
    "--allowed-origins": CORS,
    "--allow-credentials": CORS,
    "--allowed-headers": CORS,
    "--allowed-methods": ids(FEE + "test_tls_client_certificates_and_cors_methods_reach_the_server"),
    "--ssl-keyfile": ids(TLS, VF + "test_bad_values_refused_with_the_flag_named"),
    "--ssl-certfile": ids(TLS),
    "--ssl-ca-certs": ids(FEE + "test_tls_client_certificates_and_cors_methods_reach_the_server"),
    "--ssl-cert-reqs": ids(FEE + "test_tls_client_certificates_and_cors_methods_reach_the_server"),
    "--root-path": ids(VF + "test_root_path_as_uvicorn"),
    "--config": ids(VF + "test_config_yaml_and_command_line_precedence"),
    "--download-dir": ids(VF + "test_download_dir_is_the_hub_cache"),
    "--enable-log-requests": ids(TLS),
    "--max-log-len": ids(TLS),
    "--disable-log-stats": ids(TLS),
    "--disable-uvicorn-access-log": ids(TLS),
    "--log-stats-interval": ids(VF + "test_logs_stats_notes_once_and_no_prompt_by_default"),
    "--log-format": ids("tests/test_logging_config.py::test_log_format_json_makes_every_record_one_json_object"),
    "--metrics-prefix": ids("tests/test_metrics_vllm.py::test_metrics_prefix_vllm_only"),
    "--restart-on-engine-death": ids(FAULTS + "test_dead_engine_restarts_with_flag"),
    "--load-format": ids(VF + "test_bad_values_refused_with_the_flag_named",
                         GGUF + "test_serve_flags_reach_the_engine_args",
                         GGUF + "test_trillm_serve_a_gguf_file_chats_with_its_template"),
    "--tokenizer-mode": ids(VF + "test_more_vllm_flags_refused"),
    "--limit-mm-per-prompt": ids(VF + "test_more_vllm_flags_refused"),
    "--data-parallel-size-local": ids(VF + "test_more_vllm_flags_refused"),
    "--data-parallel-start-rank": ids(VF + "test_more_vllm_flags_refused"),
    "--data-parallel-address": ids(VF + "test_more_vllm_flags_refused"),
    "--data-parallel-rpc-port": ids(VF + "test_more_vllm_flags_refused"),
    "--data-parallel-backend": ids(VF + "test_more_vllm_flags_refused"),
    "--data-parallel-hybrid-lb": ids(VF + "test_more_vllm_flags_refused"),
    "--data-parallel-external-lb": ids(VF + "test_more_vllm_flags_refused"),
    "--quantization": ids(REFUSED_TOP, FLAG_MAP, *_ENGINE["quantization"],
                          GGUF + "test_serve_flags_reach_the_engine_args",
                          GGUF + "test_trillm_serve_a_gguf_file_chats_with_its_template"),
    "--kv-cache-dtype": ids(REFUSED_TOP, FLAG_MAP, *_ENGINE["kv_cache_dtype"]),
    # LoRA (tests/test_lora_http.py: a real server; the engine arguments in tests/test_lora.py)
    "--enable-lora": ids(LORA_HTTP + "test_model_name_selects_the_adapter",
                         LORA_HTTP + "test_lora_flags_refused_with_the_flag_named"),
    "--lora-modules": ids(LORA_HTTP + "test_model_name_selects_the_adapter",
                          LORA_HTTP + "test_models_lists_adapters_with_their_parent",
                          LORA_HTTP + "test_lora_flags_refused_with_the_flag_named"),
    "--max-loras": ids(VF + "test_bad_values_refused_with_the_flag_named",
                       LORA + "test_more_adapters_than_max_loras_wait_and_rotate"),
    "--max-lora-rank": ids(LORA_HTTP + "test_load_and_unload_at_runtime",
                           LORA + "test_unimplemented_adapters_are_refused_naming_it"),
    "--allow-runtime-lora-updating": ids(LORA_HTTP + "test_load_and_unload_at_runtime",
                                         LORA_HTTP + "test_runtime_updating_routes_need_the_opt_in"),
    "--speculative-config": ids(SPEC_E + "test_http_same_greedy_text_and_metrics_count",
                                REFUSED_TOP),  # eagle / medusa / mtp: not yet
    # Already so in trillm, or meaningless without CUDA graphs / swapping / several ranks:
    # accepted, and the log says so once at startup.
    "--enable-chunked-prefill": ids(MOOT, VF + "test_bad_values_refused_with_the_flag_named"),
    "--enforce-eager": ids(MOOT, VF + "test_logs_stats_notes_once_and_no_prompt_by_default"),
    "--swap-space": ids(MOOT, VF + "test_logs_stats_notes_once_and_no_prompt_by_default"),
    "--disable-log-requests": ids(MOOT),
    "--enable-prompt-tokens-details": ids(MOOT, FE + "test_cache_salt_separates_prefix_cache_hits"),
    "--max-seq-len-to-capture": ids(MOOT),
    "--disable-custom-all-reduce": ids(MOOT),
    "--enable-server-load-tracking": ids(VF + "test_ping_load_and_invocations",
                                         VF + "test_more_vllm_flags_accepted"),
}  # fmt: skip

# Engine flags: parsed into the EngineArgs field of the same name, whose tests show the effect.
_ENGINE_FLAG_FIELDS = {
    "--dtype": "dtype", "--seed": "seed", "--max-model-len": "max_model_len",
    "--block-size": "block_size", "--max-num-seqs": "max_num_seqs",
    "--max-num-batched-tokens": "max_num_batched_tokens",
    "--long-prefill-token-threshold": "long_prefill_token_threshold",
    "--enable-prefix-caching": "enable_prefix_caching", "--scheduling-policy": "scheduling_policy",
    "--tensor-parallel-size": "tensor_parallel_size", "--kv-cache-memory": "kv_cache_memory",
    "--data-parallel-size": "data_parallel_size",
    "--pipeline-parallel-size": "pipeline_parallel_size",
    "--gpu-memory-utilization": "gpu_memory_utilization",
    "--num-gpu-blocks-override": "num_gpu_blocks_override", "--max-logprobs": "max_logprobs",
    "--stream-interval": "stream_interval", "--device": "device",
    "--attention-backend": "attention_backend", "--convert": "convert",
    "--pooler-config": "pooler_config",
    "--distributed-executor-backend": "distributed_executor_backend",
    "--generation-config": "generation_config", "--trust-remote-code": "trust_remote_code",
    "--dequantize-gguf": "dequantize_gguf",
}  # fmt: skip

# /v1/responses (tests/test_responses_api.py)
_R_TEXT = RESP + "test_text_equals_the_chat_completion"
_R_SAMPLING = RESP + "test_sampling_fields_reach_the_engine"
_R_TOOLS = RESP + "test_named_tool_gives_a_function_call_item"
_R_TOOL_FIELDS = RESP + "test_tool_fields_reach_the_template_and_parallel_tool_calls"
_R_FORMAT = RESP + "test_text_format_json_schema_constrains_the_output"
_R_REASONING = RESP + "test_reasoning_effort_gives_a_reasoning_item"
_R_REFUSED = RESP + "test_refused_fields_are_named"
_R_EXT = RESP + "test_vllm_extensions_request_id_cache_salt_priority_timeout"
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
    "ResponsesRequest.store": ids(_R_REFUSED),
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
    "input": ids(POOL + "test_v1_embeddings_with_the_openai_client",
                 POOL + "test_token_id_input_and_encoding_format",
                 POOL + "test_what_the_pooling_routes_refuse"),
    "model": ids(POOL + "test_what_the_pooling_routes_refuse"),
    "encoding_format": ids(POOL + "test_token_id_input_and_encoding_format"),
    "dimensions": ids(POOL + "test_what_the_pooling_routes_refuse"),
    "truncate_prompt_tokens": ids(POOL + "test_truncate_prompt_tokens_keeps_the_last_tokens"),
}  # fmt: skip

_CLASSIFY = {
    "input": ids(CLS + "test_classify_route_answers_in_vllms_shape",
                 CLS + "test_what_the_classify_server_refuses"),
    "model": ids(CLS + "test_what_the_classify_server_refuses"),
    "truncate_prompt_tokens": ids(CLS + "test_truncate_prompt_tokens_keeps_the_last_tokens"),
}  # fmt: skip

COVERAGE: dict[str, tuple[str, ...]] = {
    **{f"ChatCompletionRequest.{k}": v for k, v in {**_SAMPLING, **_CHAT}.items()},
    **{f"CompletionRequest.{k}": v for k, v in {**_SAMPLING, **_COMPLETION}.items()},
    **_NESTED,
    **_RESPONSES,
    **{f"{cls}.{k}": v for cls in ("EmbeddingRequest", "PoolingRequest")
       for k, v in _EMBEDDING.items()},
    **{f"ClassificationRequest.{k}": v for k, v in _CLASSIFY.items()},
    **{f"SamplingParams.{k}": v for k, v in _PARAMS.items()},
    **{f"StructuredOutputsParams.{k}": v for k, v in _SO_PARAMS.items()},
    **{f"EngineArgs.{k}": v for k, v in _ENGINE.items()},
    **_FLAGS,
    **_VLLM_FLAGS,
    **{flag: (FLAG_MAP, *_ENGINE[field]) for flag, field in _ENGINE_FLAG_FIELDS.items()},
}

# Accepted with no effect, on purpose; vLLM does the same. Keep this tiny.
NO_EFFECT_BY_DESIGN: dict[str, str] = {
    "ChatCompletionRequest.user": "OpenAI's end-user id for abuse monitoring; no effect on "
    "generation in OpenAI's API or in vLLM (accepted, ignored).",
    "CompletionRequest.user": "OpenAI's end-user id for abuse monitoring; no effect on "
    "generation in OpenAI's API or in vLLM (accepted, ignored).",
    "JsonSchemaSpec.name": "a label for the schema in OpenAI's API; vLLM compiles only "
    "json_schema.schema, as here.",
    "JsonSchemaSpec.description": "a note for the model in OpenAI's API; vLLM does not render "
    "it into the prompt, nor does trillm.",
    "JsonSchemaSpec.strict": "the grammar always enforces the schema (strict or not), as in vLLM, "
    "which also ignores the flag.",
    "StructuredOutputs.disable_additional_properties": "xgrammar compiles schemas strictly: "
    "additionalProperties is false unless the schema allows more, with or without the option "
    "(vLLM documents it for its guidance backend only); test_disable_any_whitespace_and_"
    "disable_additional_properties shows the constraint holds.",
    "StructuredOutputsParams.disable_additional_properties": "as StructuredOutputs."
    "disable_additional_properties: xgrammar's strict schemas already forbid extra properties.",
    "SamplingParams.extra_args": "vLLM's carrier for custom sampling plugins ('not used by any "
    "in-tree sampling implementation'); checked as plain data and carried to the worker.",
}

# Accepted but not honoured yet: each is a bug to fix (honour it, or refuse it naming it).
KNOWN_GAPS: dict[str, str] = {}
