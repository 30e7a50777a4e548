"""Any 2-D padding mask on a cache whose steps are laid out left-padded.

The layers see each row's real tokens of a step in the step's last columns (`hf_qsa_cache.metadata`).
A mask with pads after or between real tokens (right padding, pads in the middle) runs by reordering
each row's columns of the step: pads first, then the real tokens in their order. Pads are inert, so a
row's real tokens compute what the row computes without its pads; that is what transformers' models
compute at the real positions of left- and right-padded rows. The outputs are put back in the
caller's columns.

Output at a pad column: after a real token of the same step it repeats that token's output (so the
last column's logits of a right-padded prompt predict the row's next token and `generate()` works on
right-padded prompts: later steps continue from the row's real length); before any it is unspecified
(transformers' are too).

Hidden states a model records while autograd records (`on_output_path`) stay on the outputs' autograd path,
so ``retain_grad()`` on the returned ones gets a gradient, as in transformers.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import weakref
from dataclasses import dataclass

import torch


@dataclass
class StepOrder:
    """How a step's ``L`` columns are reordered for the layers, and how outputs come back."""

    order: torch.Tensor  # [B, L] long: reordered column j holds the caller's column order[b, j]
    source: torch.Tensor  # [B, L] long: the caller's column c reads reordered column source[b, c]
    inverse: torch.Tensor  # [B, L] long: the caller's column c is reordered column inverse[b, c]
    mask: torch.Tensor  # [B, L] the step's mask columns, reordered (left-padded)
    host_mask: torch.Tensor | None = None  # `mask` on the host (read once: `host_step_columns`)

    def inputs(self, x: torch.Tensor | None, dim: int, batch_dim: int = 0) -> torch.Tensor | None:
        """``x`` (the step's columns along ``dim``) in the layers' order."""
        return None if x is None else _take(x, self.order, dim, batch_dim)

    def outputs(self, y: torch.Tensor | None, dim: int = 1, batch_dim: int = 0) -> torch.Tensor | None:
        """``y`` (the layers' columns along ``dim``) back in the caller's columns."""
        return None if y is None else _take(y, self.source, dim, batch_dim)

    def key_outputs(self, y: torch.Tensor, dim: int = -1, batch_dim: int = 0) -> torch.Tensor:
        """``y`` with the step's key columns (the last ``L`` along ``dim``) back in the caller's columns: a
        plain permutation (a pad key column keeps what the layers gave it), unlike query outputs."""
        L = self.order.shape[1]
        past, step = y.split([y.shape[dim] - L, L], dim)
        return torch.cat([past, _take(step, self.inverse, dim, batch_dim)], dim)

    def full_mask(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """The whole mask (past columns as given) with the step's columns reordered."""
        L = self.mask.shape[1]
        full = torch.cat([attention_mask[:, : attention_mask.shape[1] - L], self.mask.to(attention_mask.dtype)], 1)
        if self.host_mask is not None:  # the cache's step reads these columns: no second device read
            remember_host_step_columns(full, L, self.host_mask.to(attention_mask.dtype))
        return full


# The last mask whose step columns were read to the host: (a weak reference to it, its version counter, the
# step length, the host copy). Matched by identity and version, so a mask changed in place is read again.
_host_read: tuple | None = None


def host_step_columns(attention_mask: torch.Tensor, query_len: int) -> torch.Tensor:
    """The last ``query_len`` columns of ``attention_mask`` on the host, in its dtype: one device-to-host read
    per mask and step length, shared by everything that checks a step's mask (`step_order`, then the cache's
    `QSAPagedCache.check_step` on the same tensor, or on the reordered mask `StepOrder.full_mask` built)."""
    memo = _host_read
    if (memo is not None and memo[0]() is attention_mask and memo[1] == attention_mask._version
            and memo[2] == query_len):
        return memo[3]
    host = attention_mask[:, -query_len:].detach().cpu()
    remember_host_step_columns(attention_mask, query_len, host)
    return host


def remember_host_step_columns(attention_mask: torch.Tensor, query_len: int, host: torch.Tensor) -> None:
    """``host`` holds ``attention_mask``'s last ``query_len`` columns (`host_step_columns` answers with it)."""
    global _host_read
    _host_read = (weakref.ref(attention_mask), attention_mask._version, query_len, host)


def _take(x: torch.Tensor, index: torch.Tensor, dim: int, batch_dim: int) -> torch.Tensor:
    """``x`` with its ``dim`` entries taken per row (``batch_dim``) from ``index`` ``[B, L]``."""
    dim, batch_dim = dim % x.dim(), batch_dim % x.dim()
    shape = [1] * x.dim()
    shape[batch_dim], shape[dim] = index.shape
    sizes = list(x.shape)
    sizes[dim] = index.shape[1]
    return x.gather(dim, index.to(x.device).view(shape).expand(sizes))


def step_order(attention_mask: torch.Tensor | None, query_len: int) -> StepOrder | None:
    """The reordering a step of ``query_len`` columns needs, or None when its mask columns are already
    left-padded (no mask, single-token steps, left padding). One host read for multi-token steps
    (`host_step_columns`, which the cache's step then reuses)."""
    if attention_mask is None or query_len == 1 or attention_mask.dim() != 2:
        return None
    host = host_step_columns(attention_mask, query_len)
    host_real = host != 0
    if not bool((host_real[:, :-1] & ~host_real[:, 1:]).any()):  # no real token before a pad
        return None
    step = attention_mask[:, -query_len:]
    real = step != 0
    order = torch.sort(real.to(torch.int8), dim=1, stable=True).indices  # pads first, each kept in order
    position_in_order = order.argsort(dim=1)
    col = torch.arange(query_len, device=step.device).expand_as(order)
    # A pad after a real token reads that token's output: the latest real column at or before it.
    latest_real = torch.where(real, col, -1).cummax(dim=1).values
    source = position_in_order.gather(1, torch.where(latest_real >= 0, latest_real, col))
    # The same stable sort on the host copy: the reordered columns' host copy, for the cache's check.
    host_order = torch.sort(host_real.to(torch.int8), dim=1, stable=True).indices
    return StepOrder(order=order, source=source, inverse=position_in_order, mask=step.gather(1, order),
                     host_mask=host.gather(1, host_order))


def as_padding_mask(attention_mask, query_len: int):
    """A 2-D ``[B, W]`` padding mask from what a caller passed: a 2-D mask (as is), None, or a 4-D
    ``[B, 1 | heads, L, W]`` mask (bool: True = visible; float: 0 = visible) that is a causal mask with
    padding, as transformers builds from a 2-D mask. Any other 4-D mask (packed sequences, bidirectional
    spans, custom patterns) is refused: the cache runs each row as one causal sequence."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
        return attention_mask
    B, heads, L, W = attention_mask.shape
    if L != query_len or W < L:
        raise ValueError(f"a 4-D attention_mask must be [batch, 1, {query_len} queries, keys >= {query_len}], "
                         f"got {tuple(attention_mask.shape)}")
    visible = attention_mask != 0 if attention_mask.dtype in (torch.bool, torch.int64, torch.int32) else attention_mask == 0
    if heads > 1 and not bool((visible == visible[:, :1]).all()):
        raise ValueError("a 4-D attention_mask must be the same for every head (a causal mask with padding)")
    visible = visible[:, 0]
    real = visible[:, -1]  # the last query sees every real key up to itself
    past = W - L
    causal = torch.arange(W, device=visible.device)[None, :] <= past + torch.arange(L, device=visible.device)[:, None]
    expected = causal[None] & real[:, None, :]
    # pad queries' rows are free (their outputs are unspecified; transformers may unmask them entirely)
    real_queries = real[:, past:]
    differs = (visible != expected) & real_queries[..., None]
    if bool(differs.any()):
        b, i, j = (int(x) for x in differs.nonzero()[0])
        raise ValueError(
            "a 4-D attention_mask must be a causal mask with padding (what transformers builds from a 2-D padding "
            f"mask); this one differs from that at row {b}, query {i}, key {j}. Pass the 2-D padding mask instead: "
            "custom 4-D masks (packed sequences, bidirectional spans) are not supported"
        )
    return real.long()


@dataclass
class _ReorderedStep:
    """A reordered step in progress (`runs_any_padding`): its order, and the caller-column copies of the hidden
    states `on_output_path` put on the outputs' path, by the recorded tensor's id (with the tensor itself, so a
    freed tensor's reused id never matches)."""

    order: StepOrder
    restored: dict


_STEP = contextvars.ContextVar("hf_qsa_reordered_step", default=None)


def on_output_path(hidden_states: torch.Tensor) -> torch.Tensor:
    """At a point where a model's layer loop records ``hidden_states`` (``[B, L, ...]``, the layers' columns) as an
    output: the tensor the layers go on with.

    A reordered step's outputs come back in the caller's columns as copies (`runs_any_padding`). A copy taken
    after the forward hangs off the autograd graph, so ``retain_grad()`` on it gets no gradient. So while autograd
    records, the copy is taken here and the layers go on from it, put back in their order (at a pad column, whose
    copy repeats a real token's, they keep their own value): the values are unchanged, and every later output
    depends on the copy, which `runs_any_padding` returns for the recorded tensor. Otherwise this returns
    ``hidden_states`` as is (and the copy is taken after the forward)."""
    step = _STEP.get()
    if step is None or not (torch.is_grad_enabled() and hidden_states.requires_grad):
        return hidden_states
    order = step.order
    caller = order.outputs(hidden_states)
    real = (order.mask != 0).to(hidden_states.device)
    real = real.view(*real.shape, *[1] * (hidden_states.dim() - 2))
    go_on = torch.where(real, order.inputs(caller, 1), hidden_states)
    # A recorder may hold either: the tensor given (recorded as a layer's output) or the one returned (recorded
    # as the next layer's input).
    for recorded in (hidden_states, go_on):
        step.restored[id(recorded)] = (recorded, caller)
    return go_on


def runs_any_padding(per_token: dict[str, int], outputs: dict[str, tuple[int, ...]]):
    """Decorator for a text model's ``forward``: a step whose mask columns are not left-padded runs
    reordered (`step_order`) and its outputs come back in the caller's columns.

    ``per_token``: inputs holding the step's columns (the last ``L`` along the given dim; the batch is
    the dim before it). ``outputs``: output fields -> (column dim, batch dim) or, for attention weights,
    whose keys end with the step's columns too, (query column dim, batch dim, key column dim); tuples of
    tensors are mapped entry by entry, and a ``[B * L, ...]`` tensor (router logits) is viewed as
    ``[B, L, ...]``."""

    def decorate(forward):
        signature = inspect.signature(forward)
        mask_position = list(signature.parameters).index("attention_mask")

        @functools.wraps(forward)
        def wrapper(*args, **kwargs):
            if len(args) <= mask_position and kwargs.get("attention_mask") is None:
                return forward(*args, **kwargs)  # no mask: nothing to reorder (decode steps of the serving loop)
            call = dict(signature.bind(*args, **kwargs).arguments)
            extra = call.pop("kwargs", {}) if "kwargs" in signature.parameters else {}
            tokens = call.get("input_ids")
            if tokens is None:
                tokens = call.get("inputs_embeds")
            mask = call.get("attention_mask")
            order = None
            if isinstance(tokens, torch.Tensor) and tokens.dim() >= 2 and isinstance(mask, torch.Tensor):
                mask = call["attention_mask"] = as_padding_mask(mask, tokens.shape[1])
                order = step_order(mask, tokens.shape[1])
            if order is None:
                return forward(**call, **extra)
            B, L = order.order.shape
            for name, dim in per_token.items():
                where = call if name in call else extra
                value = where.get(name)
                if isinstance(value, torch.Tensor) and value.shape[dim] >= L:
                    dim %= value.dim()
                    where[name] = order.inputs(value.narrow(dim, value.shape[dim] - L, L), dim, dim - 1)
            call["attention_mask"] = order.full_mask(mask)
            step = _ReorderedStep(order, {})
            token = _STEP.set(step)
            try:
                result = forward(**call, **extra)
            finally:
                _STEP.reset(token)
            # One caller-column copy per tensor: a tensor returned in two fields (the last hidden state is also the
            # last entry of hidden_states) comes back as one tensor, on the outputs' path.
            restored = step.restored
            for name, dims in outputs.items():
                value = getattr(result, name, None)
                if value is not None:
                    setattr(result, name, _restore(value, order, B, L, restored, *dims))
            return result

        return wrapper

    return decorate


def _restore(value, order: StepOrder, B: int, L: int, restored: dict, dim: int, batch_dim: int,
             key_dim: int | None = None):
    if isinstance(value, tuple):
        return tuple(_restore(v, order, B, L, restored, dim, batch_dim, key_dim) for v in value)
    if not isinstance(value, torch.Tensor):
        return value
    known = restored.get(id(value))
    if known is not None and known[0] is value:
        return known[1]
    if value.dim() >= 1 and value.shape[0] == B * L != B:  # flattened [B * L, ...] (router logits)
        out = order.outputs(value.view(B, L, *value.shape[1:]), 1).reshape(value.shape)
    else:
        out = order.key_outputs(value, key_dim, batch_dim) if key_dim is not None else value
        out = order.outputs(out, dim, batch_dim)
    restored[id(value)] = (value, out)
    return out
