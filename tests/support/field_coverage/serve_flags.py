"""Coverage of ``trillm serve`` flags (first long name, or the metavar) -> node ids."""

from __future__ import annotations

from field_coverage.engine_args import ENGINE
from field_coverage.ids import (
    FAULTS,
    FE,
    FEC,
    FEE,
    FLAG_MAP,
    GGUF,
    LIFE,
    LORA,
    LORA_CPU,
    LORA_HTTP,
    MN,
    OPENAI,
    POOL,
    SO_REASONING,
    SPEC_E,
    TOOLS,
    TOOLS_HTTP,
    UNITS,
    ids,
)

# ``trillm serve`` flags: how each reaches the engine or the server, and what it then does.
_FLAGS = {
    "--headless": ids(
        MN + "test_ranks_across_two_nodes_match_tp1_over_http",
        MN + "test_killed_node1_fails_node0s_requests_and_leaves_no_process",
        MN + "test_a_headless_node_with_other_engine_flags_is_refused",
        MN + "test_node_flags_reach_the_config_and_bad_ones_are_refused",
    ),
    **{
        f"--{name.replace('_', '-')}": ENGINE[name]
        for name in (
            "nnodes",
            "node_rank",
            "master_addr",
            "master_port",
            "distributed_timeout_seconds",
        )
    },
    "MODEL": ids(FEE + "test_model_positional_and_flag_and_bad_values"),
    "--model": ids(FEE + "test_model_positional_and_flag_and_bad_values"),
    "--host": ids(FE + "test_model_must_be_served"),  # every real-server test binds with it
    "--port": ids(FE + "test_model_must_be_served"),
    "--api-key": ids(
        LIFE + "test_api_key_guards_v1_routes",
        "tests/fault/test_api_key_routes.py::test_the_key_opens_what_runs_the_model",
        "tests/fault/test_api_key_routes.py::test_the_flag_wins_over_vllm_api_key",
    ),
    "--health-step-timeout": ids(
        "tests/fault/test_health_stall.py::test_a_stopped_worker_turns_health_503_and_back",
        "tests/fault/test_health_stall.py::test_the_flag_is_validated",
    ),
    "--served-model-name": ids(FLAG_MAP, OPENAI + "test_models"),
    "--enable-prompt-embeds": ids(
        "tests/entrypoints/test_prompt_embeds_http.py::test_embeds_equal_the_token_prompt",
        "tests/entrypoints/test_prompt_embeds_http.py::"
        "test_a_server_without_the_flag_refuses_naming_it",
    ),
    "--skip-tokenizer-init": ids(
        "tests/entrypoints/test_skip_tokenizer_init.py::test_token_id_prompts_give_the_plain_servers_tokens_and_empty_text",
        "tests/entrypoints/test_skip_tokenizer_init.py::test_what_needs_the_tokenizer_is_refused_by_name",
        "tests/entrypoints/test_engine_flags.py::"
        "test_skip_tokenizer_init_flag_reaches_the_engine_args",
    ),
    "--chat-template": ids(
        FEC + "test_server_chat_template_and_its_kwargs",
        TOOLS_HTTP + "test_tool_history_is_rendered",
    ),
    "--trust-request-chat-template": ids(
        FEC + "test_chat_template_in_a_request_replaces_the_servers",
        FEC + "test_log_level_and_request_chat_templates",
    ),
    "--uvicorn-log-level": ids(FEC + "test_log_level_and_request_chat_templates"),
    "--shutdown-timeout": ids(LIFE + "test_sigterm_drains_then_aborts_and_exits_0"),
    "--timeout-keep-alive": ids(
        "tests/fault/test_keepalive.py::test_timeout_keep_alive_flag_reaches_hypercorn"
    ),
    "--max-num-queued-requests": ids(
        FAULTS + "test_full_queue_answers_503_at_once",
        POOL + "test_embedding_inputs_hold_queue_places_until_done",
    ),
    "--max-num-admitted-tokens": ids(
        "tests/fault/test_token_queue_bound.py::test_token_bound_refuses_whole_requests_at_once",
        "tests/fault/test_token_queue_bound.py::test_flag_is_validated",
    ),
    "--max-logprob-entries": ids(
        "tests/fault/test_logprob_budget.py::test_over_the_budget_is_refused_at_once_naming_it",
        "tests/fault/test_logprob_budget.py::test_the_flags_are_parsed_and_validated",
    ),
    "--max-sequences-per-request": ids(
        "tests/fault/test_fanout_fairness.py::test_sequences_over_the_budget_are_refused_at_once",
        "tests/fault/test_logprob_budget.py::test_the_flags_are_parsed_and_validated",
    ),
    "--tokenizer": ids(FEC + "test_add_special_tokens_and_the_tokenizer_flag"),
    "--revision": ids(FLAG_MAP, FEE + "test_revision_reaches_the_hub_download"),
    "--structured-outputs-cache-bytes": ENGINE["structured_outputs_cache_bytes"],
    "--stream-wake-budget": ids(
        UNITS + "test_stream_wake_budget_flag",
        "tests/engine/test_output_wake_budget.py::test_wake_budget_spreads_middle_chunks_first_and_last_at_once",
    ),
    "--runner": ids(
        FLAG_MAP,
        TOOLS_HTTP + "test_auto_without_the_flag_is_a_400_and_plugins_load",
        POOL + "test_v1_embeddings_with_the_openai_client",
    ),
    "--enable-auto-tool-choice": ids(
        TOOLS_HTTP + "test_auto_parses_a_hermes_call_streamed_and_not",
        TOOLS_HTTP + "test_auto_without_the_flag_is_a_400_and_plugins_load",
    ),
    "--tool-call-parser": ids(
        TOOLS_HTTP + "test_auto_parses_a_hermes_call_streamed_and_not",
        TOOLS_HTTP + "test_bad_parser_flags_stop_the_cli",
    ),
    "--tool-parser-plugin": ids(
        TOOLS_HTTP + "test_auto_without_the_flag_is_a_400_and_plugins_load",
        TOOLS_HTTP + "test_bad_parser_flags_stop_the_cli",
    ),
    "--exclude-tools-when-tool-choice-none": ids(
        FEE + "test_tool_flags_are_checked_at_startup",
        TOOLS + "test_plan_required_and_auto_and_none",
    ),
    "--reasoning-parser": ids(
        TOOLS_HTTP + "test_enable_thinking_puts_the_output_in_reasoning",
        TOOLS_HTTP + "test_bad_parser_flags_stop_the_cli",
        SO_REASONING + "test_http_reasoning_content_then_schema_content",
    ),
}

# vLLM's serve flags (issue 16): honoured, refused naming the flag (features of other open
# issues), or, where what they ask is already so / means nothing here, said once in the log.
VF = "tests/entrypoints/test_vllm_flags.py::"
REFUSED_TOP = VF + "test_top35_flag_of_another_issue_refused"
MOOT = VF + "test_moot_flags_say_so_once"
SOCK = "tests/entrypoints/test_socket_and_process_flags.py::"
TLS = VF + "test_tls_and_request_log"
CORS = ids(
    VF + "test_preflight_needs_no_api_key_and_names_what_is_disallowed",
    VF + "test_cors_headers_on_answers_and_errors",
)
CONFORM = "tests/entrypoints/test_vllm_conformance.py::"
OTLP = "tests/entrypoints/test_otlp_tracing.py::"
DT = "tests/entrypoints/test_detailed_traces.py::"
_VLLM_FLAGS = {
    # One OpenTelemetry span per request (metrics/tracing.py), with --collect-detailed-traces
    # its model forward / execute times.
    "--otlp-traces-endpoint": ids(
        OTLP + "test_one_server_span_per_engine_request",
        OTLP + "test_traceparent_makes_the_span_its_child",
        OTLP + "test_span_figures_are_what_metrics_observed",
        OTLP + "test_grpc_receiver_gets_the_spans",
        OTLP + "test_a_dead_collector_does_not_harm_serving",
    ),
    "--collect-detailed-traces": ids(
        DT + "test_all_puts_both_times_on_every_span",
        DT + "test_more_steps_more_forward_time",
        DT + "test_each_value_adds_only_its_attribute",
        DT + "test_flag_values_reach_the_server_options",
        OTLP + "test_detailed_traces_need_an_endpoint_as_in_vllm",
        OTLP + "test_without_detailed_traces_no_model_times",
    ),
    # What the OpenAI routes' answers carry (vLLM's frontend flags).
    "--enable-prompt-tokens-details": ids(
        CONFORM + "test_prompt_tokens_details_with_the_flag",
        CONFORM + "test_unasked_keys_are_null",
        FE + "test_cache_salt_separates_prefix_cache_hits",
    ),
    "--enable-force-include-usage": ids(CONFORM + "test_force_include_usage"),
    "--return-tokens-as-token-ids": ids(CONFORM + "test_return_tokens_as_token_ids_flag"),
    "--enable-tokenizer-info-endpoint": ids(CONFORM + "test_tokenizer_info"),
    "--allowed-origins": CORS,
    "--allow-credentials": CORS,
    "--allowed-headers": CORS,
    "--allowed-methods": ids(
        FEE + "test_tls_client_certificates_and_cors_methods_reach_the_server"
    ),
    "--ssl-keyfile": ids(TLS, VF + "test_bad_values_refused_with_the_flag_named"),
    "--ssl-certfile": ids(TLS),
    "--ssl-ca-certs": ids(FEE + "test_tls_client_certificates_and_cors_methods_reach_the_server"),
    "--ssl-cert-reqs": ids(FEE + "test_tls_client_certificates_and_cors_methods_reach_the_server"),
    "--root-path": ids(VF + "test_root_path_serves_paths_with_and_without_it"),
    "--uds": ids(
        SOCK + "test_uds_serves_on_the_socket_file_and_replaces_a_stale_one",
        SOCK + "test_uds_over_a_regular_file_is_refused_before_loading",
        SOCK + "test_uds_with_a_port_is_refused",
    ),
    "--api-server-count": ids(SOCK + "test_api_server_count_one_is_accepted_more_refused_by_name"),
    "--show-hidden-metrics-for-version": ids(
        SOCK + "test_show_hidden_metrics_for_version_is_said_once"
    ),
    "--config": ids(VF + "test_config_yaml_and_command_line_precedence"),
    "--download-dir": ids(VF + "test_download_dir_is_the_hub_cache"),
    "--enable-log-requests": ids(TLS),
    "--max-log-len": ids(TLS),
    "--disable-log-stats": ids(TLS),
    "--disable-uvicorn-access-log": ids(TLS),
    "--log-stats-interval": ids(VF + "test_logs_stats_notes_once_and_no_prompt_by_default"),
    "--log-format": ids(
        "tests/entrypoints/test_logging_config.py::test_log_format_json_makes_every_record_one_json_object"
    ),
    "--metrics-prefix": ids(
        "tests/entrypoints/test_metrics_vllm.py::test_metrics_prefix_vllm_only"
    ),
    "--restart-on-engine-death": ids(FAULTS + "test_dead_engine_restarts_with_flag"),
    "--load-format": ids(
        VF + "test_bad_values_refused_with_the_flag_named",
        GGUF + "test_serve_flags_reach_the_engine_args",
        GGUF + "test_trillm_serve_a_gguf_file_chats_with_its_template",
    ),
    "--tokenizer-mode": ids(VF + "test_more_vllm_flags_refused"),
    "--data-parallel-size-local": ids(VF + "test_more_vllm_flags_refused"),
    "--data-parallel-start-rank": ids(VF + "test_more_vllm_flags_refused"),
    "--data-parallel-address": ids(VF + "test_more_vllm_flags_refused"),
    "--data-parallel-rpc-port": ids(VF + "test_more_vllm_flags_refused"),
    "--data-parallel-backend": ids(VF + "test_more_vllm_flags_refused"),
    "--data-parallel-hybrid-lb": ids(VF + "test_more_vllm_flags_refused"),
    "--data-parallel-external-lb": ids(VF + "test_more_vllm_flags_refused"),
    **dict.fromkeys(
        ("--enable-eplb", "--eplb-config", "--num-redundant-experts", "--all2all-backend"),
        ids("tests/parallel/test_expert_parallel.py::test_load_balancer_flags_are_refused"),
    ),
    "--expert-placement-strategy": ids(
        "tests/parallel/test_expert_parallel.py::test_load_balancer_flags_are_refused",
        "tests/parallel/test_expert_parallel.py::test_the_flag_and_linear_placement_parse",
    ),
    "--quantization": ids(
        REFUSED_TOP,
        FLAG_MAP,
        *ENGINE["quantization"],
        GGUF + "test_serve_flags_reach_the_engine_args",
        GGUF + "test_trillm_serve_a_gguf_file_chats_with_its_template",
    ),
    "--kv-cache-dtype": ids(REFUSED_TOP, FLAG_MAP, *ENGINE["kv_cache_dtype"]),
    # LoRA (tests/entrypoints/test_lora_http.py: a real server; the engine arguments in tests/lora/test_lora.py)
    "--enable-lora": ids(
        LORA_HTTP + "test_model_name_selects_the_adapter",
        LORA_HTTP + "test_lora_flags_refused_with_the_flag_named",
    ),
    "--lora-modules": ids(
        LORA_HTTP + "test_model_name_selects_the_adapter",
        LORA_HTTP + "test_models_lists_adapters_with_their_parent",
        LORA_HTTP + "test_lora_flags_refused_with_the_flag_named",
    ),
    "--max-loras": ids(
        VF + "test_bad_values_refused_with_the_flag_named",
        LORA + "test_more_adapters_than_max_loras_wait_and_rotate",
    ),
    "--max-lora-rank": ids(
        LORA_HTTP + "test_load_and_unload_at_runtime",
        LORA + "test_unimplemented_adapters_are_refused_naming_it",
    ),
    "--max-cpu-loras": ids(
        LORA_CPU + "test_an_adapter_kept_in_cpu_memory_comes_back_without_its_files",
        LORA_CPU + "test_fewer_than_max_loras_is_refused",
    ),
    "--enable-sleep-mode": ids(
        "tests/entrypoints/test_dev_routes.py::test_sleep_and_wake_up_keep_greedy_completions",
        "tests/entrypoints/test_dev_routes.py::test_sleep_without_enable_sleep_mode_is_refused",
    ),
    "--allow-runtime-lora-updating": ids(
        LORA_HTTP + "test_load_and_unload_at_runtime",
        LORA_HTTP + "test_runtime_updating_routes_need_the_opt_in",
    ),
    "--lora-allowed-root": ids(
        "tests/fault/test_lora_runtime_hostile.py::test_paths_that_are_not_adapters_get_one_answer",
        "tests/fault/test_lora_runtime_hostile.py::test_an_adapter_under_the_root_loads_and_serves",
        "tests/fault/test_lora_runtime_hostile.py::"
        "test_lora_allowed_root_flag_refused_with_the_flag_named",
    ),
    "--speculative-config": ids(
        SPEC_E + "test_http_same_greedy_text_and_metrics_count",
        "tests/spec_decode/test_spec_decode_eagle.py::"
        "test_http_eagle3_same_text_and_acceptance_counted",
        "tests/spec_decode/test_spec_decode_mtp.py::"
        "test_http_same_text_and_acceptance_counted_per_position",
        REFUSED_TOP,
    ),  # medusa / mlp_speculator: not yet
    # Already so in trillm, or meaningless without CUDA graphs / swapping / several ranks:
    # accepted, and the log says so once at startup.
    "--enable-chunked-prefill": ids(MOOT, VF + "test_bad_values_refused_with_the_flag_named"),
    "--enforce-eager": ids(
        FEE + "test_enforce_eager_reaches_the_runner_from_the_serve_flag",
        "tests/worker/test_step_program.py::test_enforce_eager_turns_programs_off",
        MOOT,
        VF + "test_logs_stats_notes_once_and_no_prompt_by_default",
    ),
    "--swap-space": ids(MOOT, VF + "test_logs_stats_notes_once_and_no_prompt_by_default"),
    "--disable-log-requests": ids(MOOT),
    "--max-seq-len-to-capture": ids(MOOT),
    "--disable-custom-all-reduce": ids(MOOT),
    "--enable-server-load-tracking": ids(
        VF + "test_ping_load_and_invocations", VF + "test_more_vllm_flags_accepted"
    ),
}

# Engine flags: parsed into the EngineArgs field of the same name, whose tests show the effect.
_ENGINE_FLAG_FIELDS = {
    "--dtype": "dtype",
    "--seed": "seed",
    "--max-model-len": "max_model_len",
    "--block-size": "block_size",
    "--max-num-seqs": "max_num_seqs",
    "--max-num-batched-tokens": "max_num_batched_tokens",
    "--long-prefill-token-threshold": "long_prefill_token_threshold",
    "--enable-prefix-caching": "enable_prefix_caching",
    "--scheduling-policy": "scheduling_policy",
    "--tensor-parallel-size": "tensor_parallel_size",
    "--kv-cache-memory": "kv_cache_memory",
    "--kv-offloading-size": "kv_offloading_size",
    "--kv-offloading-backend": "kv_offloading_backend",
    "--data-parallel-size": "data_parallel_size",
    "--pipeline-parallel-size": "pipeline_parallel_size",
    "--enable-expert-parallel": "enable_expert_parallel",
    "--gpu-memory-utilization": "gpu_memory_utilization",
    "--num-gpu-blocks-override": "num_gpu_blocks_override",
    "--max-logprobs": "max_logprobs",
    "--stream-interval": "stream_interval",
    "--device": "device",
    "--attention-backend": "attention_backend",
    "--convert": "convert",
    "--pooler-config": "pooler_config",
    "--limit-mm-per-prompt": "limit_mm_per_prompt",
    "--allowed-local-media-path": "allowed_local_media_path",
    "--allowed-media-domains": "allowed_media_domains",
    "--mm-processor-kwargs": "mm_processor_kwargs",
    "--mm-processor-cache-gb": "mm_processor_cache_gb",
    "--logits-processors": "logits_processors",
    "--skip-mm-profiling": "skip_mm_profiling",
    "--hf-overrides": "hf_overrides",
    "--structured-outputs-config": "structured_outputs_config",
    "--kv-transfer-config": "kv_transfer_config",
    "--chat-template-content-format": "chat_template_content_format",
    "--distributed-executor-backend": "distributed_executor_backend",
    "--generation-config": "generation_config",
    "--trust-remote-code": "trust_remote_code",
    "--dequantize-gguf": "dequantize_gguf",
    "--numerics": "numerics",
}

SERVE_FLAGS: dict[str, tuple[str, ...]] = {
    **_FLAGS,
    **_VLLM_FLAGS,
    **{flag: (FLAG_MAP, *ENGINE[field]) for flag, field in _ENGINE_FLAG_FIELDS.items()},
}
