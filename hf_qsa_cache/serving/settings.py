"""What the engine reads of the configs it is given: the model's vocabulary, and a warning (once per process) for
each `ContinuousBatchingConfig` field or sampling option that it does not apply."""

from __future__ import annotations

import warnings

from transformers import ContinuousBatchingConfig, GenerationConfig

# ContinuousBatchingConfig fields this engine does not use (each named in one warning when set).
UNUSED_FIELDS = ("max_memory_percent", "max_blocks_per_request", "use_async_batching", "q_padding_interval_size",
                 "kv_padding_interval_size", "varlen_compile_config", "decode_compile_config", "cpu_offload_space",
                 "per_request_processors", "max_cached_graphs")
IGNORED_SAMPLING = ("no_repeat_ngram_size", "min_new_tokens", "typical_p")


def vocab_size(model) -> int:
    config = model.config
    return config.get_text_config().vocab_size if hasattr(config, "get_text_config") else config.vocab_size


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def warn_unused(config: ContinuousBatchingConfig, generation_config: GenerationConfig) -> None:
    default = ContinuousBatchingConfig()
    for name in UNUSED_FIELDS:
        if getattr(config, name, None) != getattr(default, name, None):
            _warn_once(f"ContinuousBatchingConfig.{name} is not used by this engine (QSAPagedCache)")
    for name in IGNORED_SAMPLING:
        value = getattr(generation_config, name, None)
        if value not in (None, 1.0, 0, 0.0):
            _warn_once(f"GenerationConfig.{name}={value} is not applied by continuous batching here")
