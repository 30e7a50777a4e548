"""Triton kernel for `hf_qsa_cache.ops.token_log.log_tokens_torch`: one program per ``BLOCK`` tokens computes each
token's slot in the log and stores its id there (pads in the log's last row, racing as ``index_copy_``'s
duplicates do: that row is never read)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import on_device_of_first_tensor, pdl, pdl_begin

BLOCK = 128


@triton.jit(do_not_specialize=["n", "max_len", "trash"])
def _log_tokens_kernel(log_ptr, ids_ptr, position_ptr, token_row_ptr, n, max_len, trash, BLOCK: tl.constexpr,
                       PDL: tl.constexpr = False):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    pdl_begin(PDL)  # the positions come from the step's metadata, the launch before
    position = tl.load(position_ptr + i, mask=ok, other=-1).to(tl.int64)
    row = tl.load(token_row_ptr + i, mask=ok, other=0).to(tl.int64)
    slot = tl.where(position >= 0, row * max_len + position, trash)
    tl.store(log_ptr + slot, tl.load(ids_ptr + i, mask=ok, other=0).to(tl.int32), mask=ok)


@on_device_of_first_tensor
def log_tokens_triton(log: torch.Tensor, position: torch.Tensor, token_row: torch.Tensor,
                      input_ids: torch.Tensor) -> None:
    """`token_log.log_tokens_torch` in one launch (``log`` contiguous ``[rows + 1, max_len]`` int32)."""
    n = position.numel()
    if input_ids.numel() != n or token_row.numel() != n:
        raise ValueError(f"one position and one row per token: {input_ids.numel()} ids, {n} positions, "
                         f"{token_row.numel()} rows")
    if log.dtype != torch.int32 or not log.is_contiguous():
        raise ValueError(f"the log must be contiguous int32, got {log.dtype} (contiguous: {log.is_contiguous()})")
    if n == 0:
        return
    max_len = log.shape[1]
    _log_tokens_kernel[(triton.cdiv(n, BLOCK),)](
        log, input_ids.reshape(-1).contiguous(), position.contiguous(), token_row.contiguous(), n, max_len,
        (log.shape[0] - 1) * max_len, BLOCK=BLOCK, **pdl(log),
    )
