"""A grouped step on the models: decoding rows and prefill chunks of other rows in one forward, without pads
between them (continuous batching).

The step's rows form consecutive rectangles (`hf_qsa_cache.step.RowGroup`: the decoding rows, one token each, and
each prefilling row with its chunk); the tokens are the rectangles one after the other, ``[1, T]``. Everything a
model does token by token (embeddings, projections, norms, hyper-connection mixing, the experts: most of a step's
work and all of its weight reads) runs once over the ``T`` tokens; what reads or writes a row's past (attention,
the QSA indexer, GatedDeltaNet, PLE, Inkling's short convolutions) runs one rectangle at a time with that group's
metadata (`per_group`), exactly the ops of a rectangular step. So a grouped step computes what separate steps of
its groups would, and a rectangular step is a grouped step of one group.

`grouped_logits` is the entry point (`ModelRunner` calls it); each model's text model has ``forward_grouped``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .metadata import StepMetadata
from .step import RowGroup, row_groups


@dataclass
class GroupPart:
    """One group of a grouped step as the layers see it: its metadata, where its tokens start in the step's
    ``T``, its rectangle, and what a model computes once per group for its layers (``extra``)."""

    meta: StepMetadata
    start: int
    rows: int
    query_len: int
    extra: dict = field(default_factory=dict)

    @property
    def span(self) -> slice:
        return slice(self.start, self.start + self.rows * self.query_len)

    def view(self, x: torch.Tensor) -> torch.Tensor:
        """The group's tokens of ``x`` ``[1, T, ...]`` as its rectangle ``[rows, query_len, ...]``."""
        return x[:, self.span].reshape(self.rows, self.query_len, *x.shape[2:])


def group_ids(input_ids: torch.Tensor, groups: list[RowGroup]) -> list[torch.Tensor]:
    """Each group's ids ``[rows, query_len]`` of a grouped step's ``[1, T]`` (what the cache logs per group)."""
    ids, start = [], 0
    for group in groups:
        ids.append(input_ids[0, start:start + group.tokens].view(group.rows, group.query_len))
        start += group.tokens
    return ids


def group_parts(metas: list[StepMetadata], groups: list[RowGroup]) -> list[GroupPart]:
    parts, start = [], 0
    for meta, group in zip(metas, groups):
        parts.append(GroupPart(meta, start, group.rows, group.query_len))
        start += group.tokens
    return parts


def per_group(cache, parts: list[GroupPart], fn, *tensors: torch.Tensor):
    """``fn(part, *views)`` for each group, ``views`` its rectangles of ``tensors`` (each ``[1, T, ...]``), under
    the group's metadata; its outputs (one tensor ``[rows, query_len, ...]`` or a tuple of them) joined back to
    ``[1, T, ...]`` in the step's token order. A None among ``tensors`` is passed as None."""
    outs = []
    for part in parts:
        with cache.replaying(part.meta):
            out = fn(part, *(None if t is None else part.view(t) for t in tensors))
        outs.append(out)
    single = not isinstance(outs[0], tuple)
    columns = zip(*((o,) if single else o for o in outs))
    joined = tuple(torch.cat([o.reshape(1, -1, *o.shape[2:]) for o in column], dim=1) for column in columns)
    return joined[0] if single else joined


def grouped_logits(model, cache, shape: list[tuple[int, int]], counts: list[int], input_ids: torch.Tensor,
                   keep: torch.Tensor) -> torch.Tensor:
    """The logits ``[len(keep), vocab]`` at the step's token indices ``keep`` of a grouped step of ``model`` (a
    ForCausalLM of either family) on ``cache``: ``shape`` ``[(rows, query_len), ...]`` its groups over rows
    ``0, 1, ...``, ``counts`` each row's real tokens (in its group's last columns), ``input_ids`` ``[1, T]``. The
    step lands only if the head's logits are computed too (the caller runs it under ``torch.no_grad()``)."""
    groups = row_groups(shape)
    with cache.forward_scope():
        hidden = model.language_model.forward_grouped(input_ids, cache, groups, counts)
        return model.grouped_head(hidden[0, keep])
