"""The table tests/entrypoints/test_field_coverage.py checks: each request field, SamplingParams /
EngineArgs field and ``trillm serve`` flag -> tests that show its effect or its refusal.

One module per section in ``tests/support/field_coverage/``: ``request_fields`` (the HTTP request
models), ``sampling_params`` (and StructuredOutputsParams), ``engine_args``, ``serve_flags``
(with ``ids``: the node-id prefixes and shared test ids); this module joins them.

Keys: ``Class.field`` for request models and dataclasses, ``--flag`` (first long name) or the
metavar (``MODEL``) for ``trillm serve``. Values: node ids; a parametrized test is named by its
function. Every test listed was read to confirm it observes the field (an output that changes,
an error that names it), not only that a request holding it is accepted.
"""

from __future__ import annotations

from field_coverage.anthropic_fields import ANTHROPIC_FIELDS
from field_coverage.engine_args import ENGINE_ARGS
from field_coverage.request_fields import REQUEST_FIELDS
from field_coverage.sampling_params import SAMPLING_PARAMS
from field_coverage.score_fields import SCORE_FIELDS
from field_coverage.serve_flags import SERVE_FLAGS

COVERAGE: dict[str, tuple[str, ...]] = {
    **REQUEST_FIELDS,
    **SCORE_FIELDS,
    **ANTHROPIC_FIELDS,
    **SAMPLING_PARAMS,
    **ENGINE_ARGS,
    **SERVE_FLAGS,
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
}

# Accepted but not honoured yet: each is a bug to fix (honour it, or refuse it naming it).
KNOWN_GAPS: dict[str, str] = {}
