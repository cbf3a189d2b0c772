"""Whether an engine pools, and its ``PoolerConfig``: ``runner`` / ``convert``, a sequence
classifier's checkpoint or an encoder-only model make it a pooling engine; what such an engine
cannot run with is refused by the field's name at load."""

from __future__ import annotations

from trillm.config import EngineArgs, ModelConfig, PoolerConfig, is_pooling
from trillm.model_executor import classification, encoder_config
from trillm.model_executor.pooling import resolve_pooler


def resolve_engine_pooler(args: EngineArgs, model_config: ModelConfig) -> PoolerConfig | None:
    """-> the pooler, or None for a generating engine."""
    classifier = classification.is_sequence_classifier(model_config.hf_config)
    encoder = _check_encoder(args, model_config)
    if args.convert == "classify" and not classifier:
        raise ValueError(
            f"convert='classify' needs a *ForSequenceClassification checkpoint (a "
            f"score head); {model_config.architecture} has none."
        )
    if classifier and (args.runner == "generate" or args.convert == "embed"):
        raise ValueError(
            "This checkpoint is a sequence classifier: it classifies (runner "
            "'auto' / 'pooling', convert 'auto' / 'classify'); "
            f"runner={args.runner!r} convert={args.convert!r} is not implemented."
        )
    if not (is_pooling(args.runner, args.convert) or classifier or encoder):
        return None
    for name, value in (
        ("enable_lora", args.enable_lora),
        ("speculative_config", args.speculative_config is not None),
    ):
        if value:
            raise ValueError(
                f"{name}: a pooling model (runner='pooling') with it is not implemented yet."
            )
    if classifier:
        if args.pooler_config is not None:
            raise ValueError(
                "pooler_config with a sequence classifier is not implemented (it "
                "pools the last token)."
            )
        return PoolerConfig(
            pooling_type="LAST",
            normalize=False,
            task="classify",
            labels=classification.labels(model_config.hf_config),
        )
    default = "CLS" if encoder else "LAST"  # vLLM's defaults for BERT / decoder embedders
    return resolve_pooler(model_config.model, args.pooler_config, model_config.hf_config, default)


def _check_encoder(args: EngineArgs, model_config: ModelConfig) -> bool:
    """An encoder-only model pools (the runner picks itself, as vLLM's ``auto``); what it
    cannot run with is refused by name (tensor parallelism by its own check, which names
    the architectures it runs). -> whether the model is one."""
    arch = model_config.architecture
    if not encoder_config.is_encoder(arch):
        return False
    encoder_config.check(model_config.hf_config, arch)
    for name, unsupported in (
        ("runner", args.runner == "generate"),
        ("pipeline_parallel_size", args.pipeline_parallel_size > 1),
        ("data_parallel_size", args.data_parallel_size > 1),
        ("quantization", model_config.quantization is not None),
    ):
        if unsupported:
            raise ValueError(
                f"{arch} is an encoder-only model (embeddings, scores): "
                f"{name}={getattr(args, name)!r} is not supported."
            )
    return True
