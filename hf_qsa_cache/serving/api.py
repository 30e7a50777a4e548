"""transformers' continuous-batching entry points on our model classes, with the same signatures and
result types (`GenerationOutput`), running on `QSAPagedCache` (`manager`)."""

from __future__ import annotations

import contextlib
import logging

import torch
from tqdm.auto import tqdm
from transformers.generation.continuous_batching.requests import GenerationOutput

from .manager import ContinuousBatchingManager
from .requests import check_max_new_tokens, check_prompt, copy_ids
from .settings import vocab_size

logger = logging.getLogger(__name__)


class ContinuousBatchingMixin:
    """Put before `GenerationMixin` in a ForCausalLM's bases."""

    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None,
                                 workload_hints=None, **options) -> ContinuousBatchingManager:
        """transformers' signature, plus the manager's own options (`ContinuousBatchingManager`: the cache's
        ``kv_cache_dtype`` / ``index_cache_dtype`` for fp8 caches, ``grouped_steps``, ``mixed_steps``,
        ``prefix_snapshot_gap``)."""
        cached = getattr(self, "_cached_continuous_batching_manager", None)
        if isinstance(cached, ContinuousBatchingManager):
            return cached
        return ContinuousBatchingManager(self, generation_config, continuous_batching_config, workload_hints,
                                         **options)

    def destroy_cached_continuous_batching_manager(self) -> None:
        cached = getattr(self, "_cached_continuous_batching_manager", None)
        if isinstance(cached, ContinuousBatchingManager):
            cached.destroy()
            del self._cached_continuous_batching_manager

    @contextlib.contextmanager
    def continuous_batching_context_manager(self, generation_config=None, block: bool = True, timeout=None,
                                            continuous_batching_config=None, persistent_manager: bool = False,
                                            warmup: bool = True, workload_hints=None, **options):
        manager = self.init_continuous_batching(generation_config, continuous_batching_config, workload_hints,
                                                **options)
        if warmup and not manager.warmed_up:
            manager.warmup()
        manager.start()
        try:
            yield manager
        finally:
            manager.stop(block=block, timeout=timeout, keep_for_next_session=persistent_manager)
            if not persistent_manager:
                manager.destroy()

    @torch.no_grad()
    def generate_batch(self, inputs: list[list[int]], generation_config=None, continuous_batching_config=None,
                       record_timestamps: bool = False, progress_bar: bool = False, persistent_manager: bool = False,
                       warmup: bool = False, **kwargs) -> dict[str, GenerationOutput]:
        """Every prompt through continuous batching; results keyed ``req_0, req_1, ...`` in input order (the
        extra return sequences ``req_i__child#j`` right before their parent, as transformers orders them).
        ``warmup`` is off by default here (on in transformers): the warm-up pays ahead, with dummy requests, what the
        batch would pay anyway (`ContinuousBatchingManager.warmup`); it helps a server's first requests, not a batch."""
        if not inputs:
            return {}
        from transformers.generation.continuous_batching.utils import WorkloadHints

        config = generation_config if generation_config is not None else self.generation_config
        copies = config.num_return_sequences or 1
        max_new_tokens = kwargs.pop("max_new_tokens", None)
        options = {k: kwargs.pop(k) for k in ("kv_cache_dtype", "index_cache_dtype", "grouped_steps", "mixed_steps",
                                                "prefix_snapshot_gap") if k in kwargs}
        if kwargs:
            raise TypeError(f"generate_batch got unexpected keyword arguments {sorted(kwargs)} (max_new_tokens, "
                            f"kv_cache_dtype, index_cache_dtype, grouped_steps, mixed_steps and prefix_snapshot_gap "
                            f"are the ones it takes)")
        # The requests' arguments are checked before the manager sizes its cache from them.
        if max_new_tokens is None:
            max_new_tokens = check_max_new_tokens(config.max_new_tokens, "GenerationConfig.max_new_tokens")
        else:
            max_new_tokens = check_max_new_tokens(max_new_tokens)
        vocab = vocab_size(self)
        inputs = [check_prompt(p, vocab, f"inputs[{i}]") for i, p in enumerate(inputs)]
        hints = WorkloadHints(max_prompt_length=max(len(p) for p in inputs),
                              max_generated_length=max_new_tokens or 0, num_requests=len(inputs) * copies)
        results: dict[str, GenerationOutput] = {}
        with self.continuous_batching_context_manager(config, True, None, continuous_batching_config,
                                                      persistent_manager, warmup, hints, **options) as manager, \
                tqdm(total=len(inputs) * copies, disable=not progress_bar, desc="requests", unit="request") as bar:
            ids = manager.add_requests(inputs, max_new_tokens=max_new_tokens, record_timestamps=record_timestamps)
            while len(results) < len(inputs) * copies:
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        logger.error("the continuous batching loop ended before every request finished")
                        break
                    continue
                if result.is_finished():
                    results[result.request_id] = result
                    bar.update(1)
        ordered = {}
        for request_id in ids:
            for key in copy_ids(request_id, copies):
                if key in results:
                    ordered[key] = results[key]
        return ordered
