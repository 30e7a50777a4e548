"""What a model class needs so that `generate()` without `past_key_values` runs on a paged cache."""

from __future__ import annotations

from .cache import QSAPagedCache


class PagedCacheGenerationMixin:
    """Put before `GenerationMixin` in the bases of a ForCausalLM class."""

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length):
        if model_kwargs.get("past_key_values") is None and generation_config.use_cache is not False:
            # generate() passes the batch before it expands rows for beams / returned sequences.
            rows = batch_size * max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
            model_kwargs["past_key_values"] = QSAPagedCache(
                self.config, max_batch_size=rows, max_cache_len=max_cache_length
            )
        return super()._prepare_cache_for_generation(
            generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
        )
