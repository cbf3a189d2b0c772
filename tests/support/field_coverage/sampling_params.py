"""Coverage of SamplingParams and StructuredOutputsParams fields -> node ids."""

from __future__ import annotations

from field_coverage.ids import (
    CUSTOM_LP,
    FEE,
    OUTPUT,
    SAMPLER,
    SO_UNIT,
    ids,
)

_BUDGET = "tests/sample/test_thinking_budget.py::"
_HTTP_BUDGET = "tests/entrypoints/test_logprob_ids_thinking_budget.py::"

_PARAMS = {
    "n": ids(FEE + "test_temperature_seed_n"),
    "presence_penalty": ids(
        FEE + "test_penalties_make_a_repetitive_output_less_repetitive",
        SAMPLER + "test_penalties_follow_the_formulas",
    ),
    "frequency_penalty": ids(
        FEE + "test_penalties_make_a_repetitive_output_less_repetitive",
        SAMPLER + "test_penalties_follow_the_formulas",
    ),
    "repetition_penalty": ids(
        FEE + "test_penalties_make_a_repetitive_output_less_repetitive",
        SAMPLER + "test_penalties_follow_the_formulas",
    ),
    "temperature": ids(
        FEE + "test_temperature_seed_n",
        SAMPLER + "test_temperature_matches_softmax_of_scaled_logits",
    ),
    "top_p": ids(
        FEE + "test_top_k_top_p_min_p_that_keep_one_token_give_the_greedy_output",
        SAMPLER + "test_top_p_never_emits_outside_the_nucleus",
    ),
    "top_k": ids(
        FEE + "test_top_k_top_p_min_p_that_keep_one_token_give_the_greedy_output",
        SAMPLER + "test_top_k_never_emits_outside_the_top_k",
    ),
    "min_p": ids(
        FEE + "test_top_k_top_p_min_p_that_keep_one_token_give_the_greedy_output",
        SAMPLER + "test_min_p_drops_tokens_below_the_scaled_top_probability",
    ),
    "seed": ids(
        FEE + "test_temperature_seed_n",
        SAMPLER + "test_seeded_requests_reproduce_across_batches_and_slots",
    ),
    "stop": ids(FEE + "test_stop_stop_token_ids_include_stop_str_in_output"),
    "stop_token_ids": ids(FEE + "test_stop_stop_token_ids_include_stop_str_in_output"),
    "bad_words": ids(FEE + "test_logit_bias_allowed_token_ids_bad_words"),
    "ignore_eos": ids(FEE + "test_eos_fields_and_detokenize"),
    "max_tokens": ids(FEE + "test_eos_fields_and_detokenize"),
    "min_tokens": ids(FEE + "test_eos_fields_and_detokenize"),
    "logprobs": ids(FEE + "test_logprobs_and_prompt_logprobs"),
    "prompt_logprobs": ids(FEE + "test_logprobs_and_prompt_logprobs"),
    "prompt_logprobs_temperature": ids(
        "tests/entrypoints/test_prompt_logprobs_temperature.py::"
        "test_prompt_logprobs_equal_transformers_at_the_temperature",
        "tests/entrypoints/test_prompt_logprobs_temperature.py::"
        "test_a_tiny_temperature_gives_finite_logprobs",
        "tests/entrypoints/test_prompt_logprobs_temperature.py::"
        "test_sampling_params_keep_a_positive_finite_prompt_logprobs_temperature",
    ),
    "detokenize": ids(
        FEE + "test_eos_fields_and_detokenize", OUTPUT + "test_detokenize_false_gives_no_text"
    ),
    "skip_special_tokens": ids(FEE + "test_eos_fields_and_detokenize"),
    "include_stop_str_in_output": ids(FEE + "test_stop_stop_token_ids_include_stop_str_in_output"),
    "spaces_between_special_tokens": ids(FEE + "test_spaces_between_special_tokens"),
    "logit_bias": ids(FEE + "test_logit_bias_allowed_token_ids_bad_words"),
    "allowed_token_ids": ids(FEE + "test_logit_bias_allowed_token_ids_bad_words"),
    "truncate_prompt_tokens": ids(FEE + "test_truncate_prompt_tokens"),
    "output_kind": ids(
        OUTPUT + "test_final_only_gives_one_output",
        OUTPUT + "test_stalled_reader_gets_merged_outputs",
    ),
    "structured_outputs": ids(FEE + "test_structured_outputs_kinds"),
    # read by custom logits processors (vLLM's DummyLogitsProcessor's target_token)
    "extra_args": ids(
        CUSTOM_LP + "test_targeted_requests_output_their_token_others_unchanged",
        CUSTOM_LP + "test_validate_params_refuses_at_admission",
    ),
    # Filled by the input processor, read by the sampler.
    "bad_words_token_ids": ids(SAMPLER + "test_bad_words_single_and_multi_token"),
    "all_stop_token_ids": ids(SAMPLER + "test_min_tokens_suppresses_stop_ids_until_reached"),
    "logprob_token_ids": ids(
        _BUDGET + "test_logprob_token_ids_are_the_log_softmax_of_the_same_logits",
        _HTTP_BUDGET + "test_completion_logprob_token_ids_equal_transformers",
    ),
    "thinking_token_budget": ids(
        _BUDGET + "test_the_sampler_forces_the_end_over_other_processors",
        _HTTP_BUDGET + "test_thinking_budget_forces_the_end_of_reasoning",
    ),
    # filled by the input processor from the reasoning parser, read by the sampler
    "thinking_tag_ids": ids(
        _BUDGET + "test_the_sampler_forces_the_end_over_other_processors",
        _HTTP_BUDGET + "test_thinking_budget_forces_the_end_of_reasoning",
    ),
}

_SO_PARAMS = {
    kind: ids(FEE + "test_structured_outputs_kinds")
    for kind in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
}
_SO_PARAMS["disable_any_whitespace"] = ids(
    FEE + "test_disable_any_whitespace_and_disable_additional_properties",
    SO_UNIT + "test_spec_key_and_options",
)

SAMPLING_PARAMS: dict[str, tuple[str, ...]] = {
    **{f"SamplingParams.{k}": v for k, v in _PARAMS.items()},
    **{f"StructuredOutputsParams.{k}": v for k, v in _SO_PARAMS.items()},
}
