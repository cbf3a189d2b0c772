"""Coverage of EngineArgs fields (``ENGINE``: field -> node ids; the serve flags of the same
name reuse it)."""

from __future__ import annotations

from field_coverage.ids import (
    ACT,
    AWQ,
    CLS,
    CONFIG,
    CUSTOM_LP,
    DP,
    ENGINE_REFUSED,
    FEC,
    FEE,
    FP8,
    GGUF,
    KV_DTYPE,
    LIFE,
    LLAVA,
    LLAVA_HTTP,
    LOADING,
    LORA,
    LORA_CPU,
    LORA_HTTP,
    MN,
    NUM,
    OPENAI,
    OUTPUT,
    PA,
    PAH,
    POOL,
    PP,
    SCHED,
    SO_REASONING,
    SPEC,
    SPEC_D,
    SPEC_E,
    TP,
    WHOLE_VOCAB,
    ids,
)

MM_CACHE = "tests/models/test_mm_processor_cache.py::"
OFFLOAD = "tests/kv_transfer/test_kv_offload.py::"
MM_METRICS = "tests/entrypoints/test_mm_cache_metrics.py::"
EXPERT_PARALLEL = "tests/parallel/test_expert_parallel.py::"

ENGINE: dict[str, tuple[str, ...]] = {
    "model": ids(ENGINE_REFUSED, LOADING + "test_default_model"),
    "tokenizer": ids(FEC + "test_add_special_tokens_and_the_tokenizer_flag"),
    "served_model_name": ids(CONFIG, OPENAI + "test_models"),
    "revision": ids(FEE + "test_revision_reaches_the_hub_download"),
    "dtype": ids(CONFIG, ENGINE_REFUSED, LOADING + "test_explicit_float16_on_cpu_runs_in_float16"),
    "seed": ids(FEE + "test_engine_seed_sets_unseeded_sampling"),
    "max_model_len": ids(
        CONFIG, FEE + "test_truncate_prompt_tokens", LOADING + "test_max_model_len"
    ),
    "block_size": ids(FEE + "test_block_size_sets_the_prefix_cache_granularity", ENGINE_REFUSED),
    "max_num_seqs": ids(CONFIG, ENGINE_REFUSED, SCHED + "test_max_num_seqs"),
    "max_num_batched_tokens": ids(
        CONFIG,
        SCHED + "test_token_budget_and_chunked_prefill",
        "tests/engine/test_step_budget_defaults.py::test_the_llm_class_takes_vllms_offline_budget",
    ),
    "long_prefill_token_threshold": ids(CONFIG, SCHED + "test_long_prefill_token_threshold"),
    "enable_prefix_caching": ids(ACT, CONFIG),
    "scheduling_policy": ids(
        CONFIG,
        FEC + "test_priority_needs_the_priority_policy",
        SCHED + "test_priority_preemption_of_a_request_scheduled_earlier_in_the_step",
    ),
    "tensor_parallel_size": ids(
        ENGINE_REFUSED,
        TP + "test_python_api_tp2_matches_tp1",
        TP + "test_http_tp2_matches_tp1_token_for_token",
        TP + "test_tp_size_the_model_cannot_split_is_refused",
        DP + "test_http_dp2_tp2_matches_dp1_token_for_token",
        PA + "test_tp2_matches_tp1",
        PA + "test_tp_size_that_does_not_divide_an_expert_size_is_refused",
        PAH + "test_tp2_x_pp2_over_http_matches_tp1",
        POOL + "test_tp2_embeds_as_tp1_does",
        POOL + "test_tp2_v1_embeddings_over_http_as_tp1",
        CLS + "test_tp2_classifies_as_tp1_does",
        TP + "test_draft_model_on_the_output_rank_with_tp2",
        LORA + "test_tp2_mixed_batch_equals_peft",
    ),
    "data_parallel_size": ids(
        DP + "test_python_api_dp2_matches_dp1_and_spreads_the_requests",
        DP + "test_abort_goes_to_the_core_that_holds_the_request",
        DP + "test_data_parallel_size_below_one_is_refused",
        DP + "test_more_engine_cores_than_gpus_are_refused",
        DP + "test_http_dp2_tp2_matches_dp1_token_for_token",
        DP + "test_metrics_label_each_engine_and_show_the_spread",
        DP + "test_prefix_affinity_keeps_a_shared_prefix_on_one_core",
    ),
    "enable_expert_parallel": ids(
        EXPERT_PARALLEL + "test_ep2_matches_one_rank",
        EXPERT_PARALLEL + "test_deepseek_v3_ep2_matches_one_rank",
        EXPERT_PARALLEL + "test_tp2_x_pp2_ep_matches_one_rank",
        EXPERT_PARALLEL + "test_what_expert_parallelism_cannot_do_is_refused",
        EXPERT_PARALLEL + "test_deepseek_shared_experts_must_still_split",
        EXPERT_PARALLEL + "test_the_flag_and_linear_placement_parse",
    ),
    "pipeline_parallel_size": ids(
        PP + "test_python_api_pp2_matches_pp1",
        PP + "test_http_pp2_matches_pp1_token_for_token",
        PP + "test_tp2_x_pp2_matches_pp1",
        PP + "test_what_pp_cannot_do_is_refused_by_name",
        PA + "test_pp2_matches_pp1",
        MN + "test_ranks_across_two_nodes_match_tp1_over_http",
        AWQ + "test_pp2_matches_pp1_on_a_quantized_checkpoint",
        POOL + "test_pp2_embeds_as_transformers_does",
        CLS + "test_pp2_classifies_as_transformers_does",
        CLS + "test_tp2_classifies_as_tp1_does",
        LORA + "test_pp2_mixed_batch_equals_peft",
        PAH + "test_tp2_x_pp2_over_http_matches_tp1",
        PP + "test_draft_model_on_the_last_stage_drafts_verified_across_stages",
        GGUF + "test_pp2_on_a_gguf_equals_one_rank",
    ),
    "kv_cache_memory": ids(
        CONFIG, FEE + "test_too_few_kv_blocks_for_the_context_are_refused_at_startup"
    ),
    "kv_offloading_size": ids(
        OFFLOAD + "test_an_evicted_prefix_loads_from_the_tier_and_matches",
        OFFLOAD + "test_a_preempted_request_loads_its_blocks_from_the_tier",
        OFFLOAD + "test_what_the_tier_cannot_take_is_refused_by_name",
    ),
    "kv_offloading_backend": ids(
        OFFLOAD + "test_the_flags_reach_the_engine_args",
        OFFLOAD + "test_what_the_tier_cannot_take_is_refused_by_name",
    ),
    "gpu_memory_utilization": ids(FEE + "test_gpu_memory_utilization_sizes_the_cuda_kv_budget"),
    "num_gpu_blocks_override": ids(
        ACT, FEE + "test_too_few_kv_blocks_for_the_context_are_refused_at_startup"
    ),
    "max_logprobs": ids(
        ACT,
        FEE + "test_logprobs_and_prompt_logprobs",
        WHOLE_VOCAB + "test_prompt_logprobs_minus_one_is_every_token_at_every_position",
    ),
    "stream_interval": ids(
        OUTPUT + "test_stream_interval_batches_delta_outputs",
        LIFE + "test_stream_interval_sends_fewer_larger_chunks",
    ),
    "device": ids(CONFIG, ENGINE_REFUSED),
    "attention_backend": ids(
        CONFIG,
        FEE + "test_unknown_attention_backend_is_refused_at_startup",
        NUM + "test_eager_backend_equals_transformers_eager_attention",
        NUM + "test_bad_values_are_refused",
    ),
    # every op as transformers computes it: its output to the bit; what it cannot honour refused
    "numerics": ids(
        NUM + "test_output_equals_transformers_bit_for_bit",
        NUM + "test_the_model_runs_transformers_ops",
        NUM + "test_what_it_cannot_honour_is_refused",
        NUM + "test_bad_values_are_refused",
    ),
    "distributed_executor_backend": ids(CONFIG, FEE + "test_temperature_seed_n"),
    **dict.fromkeys(
        ("nnodes", "node_rank", "master_addr", "master_port"),
        ids(
            MN + "test_ranks_across_two_nodes_match_tp1_over_http",
            MN + "test_killed_node1_fails_node0s_requests_and_leaves_no_process",
            MN + "test_node_flags_reach_the_config_and_bad_ones_are_refused",
        ),
    ),
    "distributed_timeout_seconds": ids(
        TP + "test_stuck_rank_times_out_the_collective_and_is_named",
        MN + "test_node_flags_reach_the_config_and_bad_ones_are_refused",
    ),
    "generation_config": ids(ACT, CONFIG),
    "chat_template": ids(ACT),
    # how message content reaches the template: the parts list where the template loops over
    # it (auto / openai), the parts' text joined by newlines (string)
    "chat_template_content_format": ids(
        "tests/models/test_gemma3_vision.py::test_chat_parts_reach_the_template_as_a_list",
        "tests/models/test_gemma3_vision.py::test_the_string_content_format_joins_the_parts",
        "tests/engine/test_chat_content_format.py::test_auto_detects_templates_that_loop_over_content",
    ),
    # the tokenizer's code; model code never runs (trillm's own model classes)
    "trust_remote_code": ids(FEE + "test_trust_remote_code_lets_the_tokenizers_code_run"),
    # no tokenizer: token-id prompts, token-id outputs with empty text; text paths refused
    "skip_tokenizer_init": ids(
        "tests/entrypoints/test_skip_tokenizer_init.py::test_llm_generate_takes_token_ids",
        "tests/entrypoints/test_skip_tokenizer_init.py::test_what_needs_the_tokenizer_is_refused_by_name",
    ),
    # prompts as input embeddings: equal to their tokens; refused without it / where unsupported
    "enable_prompt_embeds": ids(
        "tests/engine/test_prompt_embeds.py::"
        "test_embeds_equal_their_tokens_batched_chunked_and_preempted",
        "tests/engine/test_prompt_embeds.py::"
        "test_refused_without_the_flag_and_where_the_model_cannot_take_them",
    ),
    # compiled grammars kept, LRU by bytes; one grammar over 1/4 of it is a 400
    "structured_outputs_cache_bytes": ids(
        "tests/fault/test_grammar_cache_bytes.py::test_distinct_big_schemas_keep_memory_bounded",
        "tests/fault/test_grammar_cache_bytes.py::test_grammar_over_its_share_is_refused",
        "tests/fault/test_grammar_cache_bytes.py::test_flag_is_validated",
    ),
    # sleep(level) frees the KV cache (level 2: the weights too); refused without the flag
    "enable_sleep_mode": ids(
        "tests/engine/test_sleep_mode.py::test_sleep_frees_the_kv_cache_and_outputs_stay_equal",
        "tests/engine/test_sleep_mode.py::test_refusals_name_what_is_refused",
    ),
    "enforce_eager": ids(
        FEE + "test_enforce_eager_reaches_the_runner_from_the_serve_flag",
        "tests/worker/test_step_program.py::test_enforce_eager_turns_programs_off",
    ),
    # structured outputs constrain only after </think>; a tokenizer without it is refused
    "reasoning_parser": ids(
        SO_REASONING + "test_engine_constrains_only_after_the_reasoning",
        SO_REASONING + "test_llm_engine_argument_and_refusal",
    ),
    # fp8 weights change the output (close to, not equal to, unquantized); others refused
    "quantization": ids(
        FP8 + "test_quantized_model_stays_close_to_the_unquantized_one",
        FP8 + "test_pack_quantizes_every_linear_but_the_lm_head",
        FP8 + "test_methods_trillm_cannot_run_are_refused",
        GGUF + "test_load_format_and_quantization_are_honoured_or_refused",
        GGUF + "test_quantized_layers_hold_only_their_blocks",
        AWQ + "test_method_must_match_the_checkpoint",
        AWQ + "test_greedy_output_equals_transformers_on_the_dequantized_weights",
    ),
    "load_format": ids(
        GGUF + "test_load_format_and_quantization_are_honoured_or_refused",
        "tests/models/test_load_overrides.py::test_dummy_weights_need_no_checkpoint",
        "tests/models/test_load_overrides.py::test_dummy_is_refused_for_a_gguf_file",
    ),
    "structured_outputs_config": ids(
        "tests/structured_output/test_structured_outputs_config.py::test_bad_values_are_refused_by_name",
        "tests/structured_output/test_structured_outputs_config.py::test_engine_wide_defaults_apply_as_if_the_request_set_them",
        "tests/structured_output/test_structured_outputs_config.py::test_through_the_engine_output_follows_the_backend_and_whitespace_settings",
        "tests/structured_output/test_structured_outputs_config.py::test_enable_in_reasoning_constrains_from_the_first_token",
        "tests/structured_output/test_structured_outputs_config.py::test_reasoning_parser_and_its_plugin_through_the_config",
    ),
    "hf_overrides": ids(
        "tests/models/test_load_overrides.py::test_an_override_acts_as_editing_config_json",
        "tests/models/test_load_overrides.py::test_overrides_replace_keys_and_merge_into_sub_configs",
    ),
    "dequantize_gguf": ids(
        GGUF + "test_greedy_output_equals_transformers_on_the_dequantized_weights",
        GGUF + "test_quantized_layers_hold_only_their_blocks",
    ),
    "enable_lora": ids(
        LORA + "test_mixed_batch_equals_peft_and_single_runs",
        LORA + "test_adapter_for_another_model_and_lora_off_are_refused",
        LORA + "test_pp2_mixed_batch_equals_peft",
        LORA + "test_tp2_mixed_batch_equals_peft",
        LORA_HTTP + "test_tp2_server_mixes_adapters_as_peft",
    ),
    "max_loras": ids(
        LORA + "test_more_adapters_than_max_loras_wait_and_rotate",
        LORA + "test_adapter_for_another_model_and_lora_off_are_refused",
    ),
    "max_lora_rank": ids(LORA + "test_unimplemented_adapters_are_refused_naming_it"),
    # an adapter kept in CPU memory comes back without its files; fewer than max_loras refused
    "max_cpu_loras": ids(
        LORA_CPU + "test_an_adapter_kept_in_cpu_memory_comes_back_without_its_files",
        LORA_CPU + "test_fewer_than_max_loras_is_refused",
    ),
    # the cache's storage: block bytes, kernels reading it, output close to auto's; refusals
    "kv_cache_dtype": ids(
        KV_DTYPE + "test_cache_dtype_sizes_the_blocks_and_unknown_values_are_refused",
        KV_DTYPE + "test_native_kernel_reads_the_cache_dtype_in_place",
        KV_DTYPE + "test_engine_output_with_a_bf16_and_an_fp8_cache_stays_close",
    ),
    # pooling models: the vector equals transformers' pooled hidden states; refusals named
    "runner": ids(
        POOL + "test_llm_embed_equals_transformers",
        POOL + "test_a_generative_engine_refuses_to_embed",
        POOL + "test_settings_trillm_cannot_honour_are_refused",
    ),
    "convert": ids(
        POOL + "test_convert_embed_is_the_pooling_runner",
        POOL + "test_settings_trillm_cannot_honour_are_refused",
        CLS + "test_classify_route_answers_in_vllms_shape",
        CLS + "test_convert_classify_needs_a_score_head",
        CLS + "test_what_a_classifier_does_not_do_is_refused",
    ),
    "pooler_config": ids(
        POOL + "test_llm_embed_equals_transformers",
        POOL + "test_the_folder_says_how_to_pool_and_an_override_wins",
        POOL + "test_settings_trillm_cannot_honour_are_refused",
    ),
    # n-gram / draft-model / EAGLE / MTP drafts verified in one forward: same output, fewer
    # forwards; bad configs, drafts with another vocabulary and head fields refused
    # vLLM's SharedStorageConnector: consumer output equals the plain engine's and
    # transformers'; prefill/decode pair behind the proxy; other connectors refused by name
    "kv_transfer_config": ids(
        "tests/kv_transfer/test_shared_storage.py::test_the_consumer_loads_the_prompts_and_matches",
        "tests/kv_transfer/test_shared_storage.py::test_a_truncated_file_is_recomputed",
        "tests/kv_transfer/test_shared_storage.py::"
        "test_what_the_connector_cannot_take_is_refused_by_name",
        "tests/entrypoints/test_disagg_http.py::"
        "test_the_pair_answers_as_one_instance_and_decode_computes_no_stored_token",
        "tests/entrypoints/test_disagg_http.py::test_other_connectors_stop_serve_naming_them",
        "tests/kv_transfer/test_disk_budget.py::"
        "test_a_producer_serving_many_distinct_prompts_stays_under_the_cap",
        "tests/kv_transfer/test_disk_budget.py::test_a_bad_cap_is_refused_naming_the_key",
        "tests/kv_transfer/test_p2p.py::test_the_decode_instance_pulls_the_prompts_and_matches",
        "tests/kv_transfer/test_p2p.py::test_what_the_p2p_connector_cannot_take_is_refused_by_name",
        "tests/entrypoints/test_p2p_http.py::"
        "test_the_pair_answers_as_one_instance_and_decode_computes_no_transferred_token",
    ),
    "speculative_config": ids(
        SPEC_E + "test_same_output_with_speculation_and_drafts_accepted",
        SPEC_D + "test_target_copy_as_draft_is_accepted_and_output_is_exact",
        SPEC_D + "test_draft_with_another_vocabulary_is_refused_by_name",
        "tests/spec_decode/test_spec_decode_eagle.py::"
        "test_a_head_that_agrees_is_accepted_k_drafts_at_a_time",
        "tests/spec_decode/test_spec_decode_eagle.py::"
        "test_head_fields_it_cannot_honour_are_refused_by_name",
        "tests/spec_decode/test_spec_decode_mtp.py::"
        "test_an_agreeing_layer_is_accepted_k_drafts_at_a_time",
        "tests/spec_decode/test_spec_decode_mtp.py::test_what_it_cannot_serve_is_refused_by_name",
        SPEC + "test_speculative_config_refused_with_the_reason",
        TP + "test_draft_model_on_the_output_rank_with_tp2",
    ),
    # images per prompt: honoured (too many refused), 0 disables, text models and other
    # modalities refused by name
    "limit_mm_per_prompt": ids(
        LLAVA + "test_bad_image_input_is_refused_by_name",
        LLAVA + "test_two_images_in_one_prompt",
        LLAVA + "test_text_models_and_disabled_images_refuse_image_input",
        LLAVA + "test_limit_mm_per_prompt_values",
    ),
    # file:// image URLs read only inside the directory (symlinks resolved first), none
    # without it
    "allowed_local_media_path": ids(
        LLAVA_HTTP + "test_file_and_http_urls_answer_as_the_data_url_does",
        LLAVA_HTTP + "test_bad_urls_are_400_within_the_limit_while_a_stream_runs",
        LLAVA + "test_llm_chat_mm_processor_kwargs_and_refusals",
    ),
    # http(s) image URLs only from these hosts, every redirect hop checked; any without it
    "allowed_media_domains": ids(
        LLAVA_HTTP + "test_bad_image_parts_are_400_naming_them",
        LLAVA_HTTP + "test_bad_urls_are_400_within_the_limit_while_a_stream_runs",
        LLAVA + "test_llm_chat_takes_image_url_and_image_pil_parts",
    ),
    # the image processor's keywords for every request (a request's own win); keys it does
    # not take, and text-only models, refused by name
    "mm_processor_kwargs": ids(
        LLAVA + "test_the_trio_api_takes_the_same_dict_and_chat_parts",
        LLAVA + "test_text_models_and_disabled_images_refuse_image_input",
    ),
    # processed images kept by pixels and keywords (a repeat skips the processor), LRU within
    # the byte budget, 0 disables it; bad budgets refused by name; its hits in /metrics
    "mm_processor_cache_gb": ids(
        MM_CACHE + "test_a_repeated_image_is_processed_once_and_answers_the_same",
        MM_CACHE + "test_zero_gib_disables_the_cache_and_the_output_is_unchanged",
        MM_CACHE + "test_bad_budgets_are_refused_by_name",
        MM_METRICS + "test_a_repeated_image_is_a_hit_in_metrics",
    ),
    # vLLM's custom logits processors: classes or names, loaded in the frontend (admission's
    # validate_params) and the workers; what does not import, or with pooling / speculative
    # decoding, refused by name
    "logits_processors": ids(
        CUSTOM_LP + "test_targeted_requests_output_their_token_others_unchanged",
        CUSTOM_LP + "test_refused_at_start_naming_the_flag",
        CUSTOM_LP + "test_names_resolve_both_spellings",
    ),
    # no memory-profiling pass exists to skip: accepted and said in the log
    "skip_mm_profiling": ids(
        MM_CACHE + "test_skip_mm_profiling_is_accepted_and_said_in_the_log",
        MM_METRICS + "test_skip_mm_profiling_is_said_in_the_log",
    ),
}

ENGINE_ARGS = {f"EngineArgs.{k}": v for k, v in ENGINE.items()}
