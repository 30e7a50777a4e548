"""Attention weights as transformers returns them (``output_attentions``): ``[batch, heads, query_len, kv_len]``
over the caller's key columns.

The attention ops address keys by each row's logical position (pads are never stored), and their
probability functions give the weights by key position. Position ``p`` of row ``b`` sits in the caller's
column that holds the row's ``(p+1)``-th real token: the ``(p+1)``-th 1 of its 2-D attention mask row
(without a mask, column ``p``). So ``kv_len`` is the mask's width (past columns and this step's), and a
pad column gets zeros. Query rows are the caller's columns too: a step whose pads follow real tokens runs
reordered (`hf_qsa_cache.padding`), and its weights come back in the caller's order, each layer mapping
its own (`StepColumns.to_caller`), as the reordered forward's other outputs come back.

While autograd records, a layer computes its output from the very tensor it returns (`StepColumns.output`:
the weights times the values at the caller's key columns), as transformers' eager attention does, so a
gradient of the output reaches the returned weights. Otherwise the weights are a side computation and the
output runs the layer's usual kernels.

Only transformers' ``eager`` attention returns weights; with ``sdpa`` (transformers' default) or another
implementation transformers returns none (an empty tuple, and a warning): so do ours (`returns_weights`).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
from dataclasses import dataclass

import torch

from .padding import as_padding_mask, step_order

logger = logging.getLogger(__name__)

# (the caller's 2-D padding mask or None, the step's length): set around a text model's forward by
# `keeps_caller_columns`, read inside it (where a reordered step sees its reordered mask).
_CALLER = contextvars.ContextVar("hf_qsa_attention_caller_columns", default=None)
_warned = [False]


def keeps_caller_columns(forward):
    """Decorator for a text model's ``forward``, outside `hf_qsa_cache.padding.runs_any_padding`: the caller's mask
    stays readable inside (`step_columns`), so that attention weights come back in the caller's columns."""
    signature = inspect.signature(forward)

    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        # Only self by position (how the models are called): the keywords are the arguments, no binding needed.
        call = kwargs if len(args) <= 1 else signature.bind_partial(*args, **kwargs).arguments
        tokens = call.get("input_ids")
        if tokens is None:
            tokens = call.get("inputs_embeds")
        if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
            return forward(*args, **kwargs)
        length = tokens.shape[1]
        token = _CALLER.set((as_padding_mask(call.get("attention_mask"), length), length))
        try:
            return forward(*args, **kwargs)
        finally:
            _CALLER.reset(token)

    return wrapper


def returns_weights(config) -> bool:
    """Whether ``output_attentions`` gives weights for a model with this config: transformers' eager attention
    only. Otherwise (``sdpa``, its default, and the rest) transformers returns an empty tuple with a warning,
    and so do ours."""
    implementation = getattr(config, "_attn_implementation", None)
    if implementation is None or implementation == "eager":
        return True
    if not _warned[0]:
        _warned[0] = True
        logger.warning(
            "attn_implementation=%r returns no attention weights with output_attentions=True (as in transformers); "
            "set attn_implementation='eager' (model.set_attn_implementation('eager')) to get them. The model's "
            "outputs do not depend on this setting.", implementation)
    return False


@dataclass
class StepColumns:
    """Where a step's attention weights go among the caller's columns."""

    position: torch.Tensor  # [B, W] long: the key position each caller column holds (clamped to >= 0)
    real: torch.Tensor  # [B, W] bool: the column holds a key
    source: torch.Tensor | None  # [B, L]: caller query column c shows the layers' step column source[b, c]
    order: torch.Tensor | None  # [B, L]: the layers' step column j is the caller's column order[b, j]

    def to_caller(self, by_position: torch.Tensor) -> torch.Tensor:
        """``[B, L, H, P]`` weights by key position, in the layers' step order -> ``[B, H, L, W]`` over the caller's
        query and key columns (zero at a column that holds no key, or a position past ``P``)."""
        weights = by_position.transpose(1, 2)  # [B, H, L, P]
        B, H, L, P = weights.shape
        if self.source is not None:
            weights = weights.gather(2, self.source.to(weights.device)[:, None, :, None].expand(B, H, L, P))
        holds = self.real & (self.position < P)
        index = self.position.clamp_max(P - 1)[:, None, None, :].expand(B, H, L, -1)
        return weights.gather(-1, index).masked_fill(~holds[:, None, None, :], 0)

    def output(self, weights: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The attention output ``[B, L, H, D]`` in the layers' step order from the caller-order ``weights``
        ``[B, H, L, W]`` (`to_caller`'s) and the ``values`` ``[B, W, Hkv, D]`` at the caller's key columns
        (`values_at`): ``weights @ values`` per head, as transformers' eager attention computes it (in the
        weights' dtype), zero at a pad query (``valid`` ``[B, L]`` false)."""
        B, H, L, W = weights.shape
        Hkv, D = values.shape[2:]
        grouped = weights.view(B, Hkv, H // Hkv, L, W)
        out = torch.einsum("bkglw,bwkd->blkgd", grouped, values.to(weights.dtype)).reshape(B, L, H, D)
        if self.order is not None:
            out = out.gather(1, self.order.to(out.device)[:, :, None, None].expand(B, L, H, D))
        return out.masked_fill(~valid.view(B, L)[:, :, None, None], 0)

    def values_at(self, values_by_position) -> torch.Tensor:
        """``[B, W, Hkv, D]``: ``values_by_position(position [B, W])`` (values at those positions, any
        ``[B, W, Hkv, D]``) with zeros at the columns that hold no key."""
        values = values_by_position(self.position)
        return values.masked_fill(~self.real[:, :, None, None], 0)


def step_columns(attention_mask: torch.Tensor | None, batch: int, length: int, positions: int,
                 device: torch.device) -> StepColumns:
    """The caller's columns of a step of ``batch x length`` whose weights span ``positions`` key positions.
    ``attention_mask`` is the mask the layers see (reordered where the caller's was not left-padded); the
    caller's own comes from `keeps_caller_columns`."""
    caller = _CALLER.get()
    mask, order = attention_mask, None
    if caller is not None and caller[1] == length and (caller[0] is None) == (attention_mask is None):
        mask = caller[0]
        order = step_order(mask, length) if mask is not None else None
    if mask is None:
        position = torch.arange(positions, device=device).expand(batch, positions)
        return StepColumns(position, torch.ones_like(position, dtype=torch.bool), None, None)
    real = (mask != 0).to(device)
    position = (real.long().cumsum(dim=1) - 1).clamp_min(0)
    return StepColumns(position, real, order.source if order is not None else None,
                       order.order if order is not None else None)


class StepWeights(list):
    """The attention weights one forward returns, layer by layer (``[B, H, L, W]`` each, in the caller's
    columns), with where they go (`columns`)."""

    def __init__(self, columns: StepColumns):
        super().__init__()
        self.columns = columns
