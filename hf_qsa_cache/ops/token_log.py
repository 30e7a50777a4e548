"""Writing a step's token ids into the cache's token log (`hf_qsa_cache.stores.token_log.TokenLog`), in one launch
where fused (``token_log`` in `hf_qsa_cache.fusions`).

In torch the write is six small launches (the pad test, two casts, the slot arithmetic, the select) and the
``index_copy_``: a noticeable share of the launches of Inkling's graphed decode step, whose other launches are each
a layer's fused kernel. `log_tokens_torch` is the specification; on CUDA
`hf_qsa_cache.ops.token_log_triton.log_tokens_triton` does it in one launch.

On by default: the graphed batch-1 steps of both models are faster end to end with it (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import torch

from . import fusions, use_triton


def log_tokens_torch(log: torch.Tensor, position: torch.Tensor, token_row: torch.Tensor,
                     input_ids: torch.Tensor) -> None:
    """The specification: ``log[row, position] = id`` for each token of ``input_ids`` (``[B, L]``, flattened in
    the order of ``position`` and ``token_row``, ``[B*L]`` each); a pad (position -1) writes the log's last row,
    which is never read. ``log`` is ``[rows + 1, max_len]`` int32."""
    max_len = log.shape[1]
    trash = (log.shape[0] - 1) * max_len
    slot = torch.where(position >= 0, token_row.long() * max_len + position, trash)
    log.view(-1).index_copy_(0, slot, input_ids.reshape(-1).to(log.device, torch.int32))


def log_tokens(log: torch.Tensor, position: torch.Tensor, token_row: torch.Tensor, input_ids: torch.Tensor) -> None:
    """`log_tokens_torch`, in one launch on CUDA where the fusion is on."""
    if fusions.enabled("token_log") and use_triton(log):
        from .token_log_triton import log_tokens_triton

        log_tokens_triton(log, position, token_row, input_ids)
    else:
        log_tokens_torch(log, position, token_row, input_ids)
