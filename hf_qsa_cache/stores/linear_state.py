"""Per-row GatedDeltaNet state, plus the PLE short-conv window and n-gram context on PLE layers.

Everything here is dense per cache row (``[max_rows, ...]``): the state does not grow with the
sequence. Conv windows keep the last ``kernel - 1`` inputs (the only ones a causal conv reads).

Rollback (``history > 0``, a cache built with ``num_speculative_tokens``): every forward also keeps,
for each of a row's last ``history`` positions, the whole state *after* that position (recurrent
state, conv window, PLE window, n-gram context) in a per-row ring indexed by ``position % history``.
`restore` puts a row back to the state after any kept position (`QSAPagedCache.crop`). One extra
ring row absorbs pad writes.
"""

from __future__ import annotations

import copy

import torch

from .base import Store, tensor_bytes
from ..ops.gated_delta import causal_window, conv_decode_step, conv_prefill, recurrent_step


class LinearAttentionState(Store):
    """Dense per row (``table`` None): nothing here is paged."""

    def __init__(self, max_rows: int, conv_dim: int, conv_kernel: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, ple_channels: int = 0, ple_window: int = 0, ngram_context: int = 0,
                 eos_token_id: int = 0, history: int = 0):
        self.max_rows = max_rows
        self.history = history
        self.conv_shape = (max_rows, conv_dim, conv_kernel - 1)
        self.recurrent_shape = (max_rows, num_v_heads, head_k_dim, head_v_dim)
        self.ple_shape = (max_rows, ple_channels, ple_window) if ple_channels else None
        self.ngram_shape = (max_rows, ngram_context) if ngram_context else None
        self.eos_token_id = eos_token_id
        self.conv: torch.Tensor | None = None  # model dtype
        self.recurrent: torch.Tensor | None = None  # fp32, as upstream
        self.ple_conv: torch.Tensor | None = None  # model dtype
        self.ngram_ids: torch.Tensor | None = None  # int64 token ids, EOS when fresh
        # Rollback rings, ``[(max_rows + 1) * history, *state]``: slot ``row * history + pos % history``
        # holds the state after position ``pos`` (`record`, `restore`).
        self.rings: dict[str, torch.Tensor] = {}

    def _marker(self) -> torch.Tensor | None:
        return self.conv

    def allocate(self, device, dtype) -> None:
        live = {"conv": torch.zeros(self.conv_shape, device=device, dtype=dtype),
                "recurrent": torch.zeros(self.recurrent_shape, device=device, dtype=torch.float32)}
        if self.ple_shape is not None:
            live["ple_conv"] = torch.zeros(self.ple_shape, device=device, dtype=dtype)
        if self.ngram_shape is not None:
            live["ngram_ids"] = torch.full(self.ngram_shape, self.eos_token_id, device=device, dtype=torch.int64)
        rings = {}
        if self.history:
            slots = (self.max_rows + 1) * self.history
            rings = {name: torch.zeros((slots, *t.shape[1:]), device=device, dtype=t.dtype) for name, t in live.items()}
        # Set together once all exist (``conv`` marks the store allocated).
        self.rings = rings
        self.recurrent, self.ple_conv, self.ngram_ids = live["recurrent"], live.get("ple_conv"), live.get("ngram_ids")
        self.conv = live["conv"]

    def deallocate(self) -> None:
        self.conv = self.recurrent = self.ple_conv = self.ngram_ids = None
        self.rings = {}

    def rows_from(self, first: int) -> "LinearAttentionState":
        """This store seen from cache row ``first`` on (a group of a grouped step: its row 0 is row ``first``): the
        same memory, every per-row tensor and ring viewed from there."""
        if not first:
            return self
        view = copy.copy(self)
        view.max_rows = self.max_rows - first  # the rings' spare row stays where it is
        for name, t in self._live().items():
            setattr(view, name, t[first:])
        view.rings = {name: ring[first * self.history:] for name, ring in self.rings.items()}
        return view

    def _live(self) -> dict[str, torch.Tensor]:
        named = {"conv": self.conv, "recurrent": self.recurrent, "ple_conv": self.ple_conv, "ngram_ids": self.ngram_ids}
        return {name: t for name, t in named.items() if t is not None}

    # ------------------------------------------------------------------ the writes of a step
    def window(self, name: str, x: torch.Tensor, leading_pads: torch.Tensor | None, fresh: bool = False) -> torch.Tensor:
        """``[previous state | this step's inputs]`` for rows ``[0, B)`` of window state ``name``, along the
        last dim. ``x``'s real columns are each row's last ones; ``leading_pads`` (``[B]``, None when no row
        has pads) moves a row's pad columns in front of its kept window, filled as a fresh window is, so the
        window reaches the row's real inputs unbroken even when the row holds tokens. ``fresh``: the rows
        start empty (the fresh window is used, the stored one is not read)."""
        fill = self.eos_token_id if name == "ngram_ids" else 0
        return causal_window(getattr(self, name)[: x.shape[0]], x, leading_pads, fresh, fill)

    def conv_step_in_place(self, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype, name: str = "conv",
                           dilation: int = 1, residual: torch.Tensor | None = None) -> torch.Tensor:
        """A one-token step's conv over rows ``[0, B)`` of window state ``name`` (``conv``, ``ple_conv``), which
        shifts in place to take ``x`` ``[B, C, 1]`` (`hf_qsa_cache.ops.gated_delta.conv_decode_step`, with its
        ``dilation`` and ``residual``); returns ``[B, 1, C]``."""
        return conv_decode_step(getattr(self, name)[: x.shape[0]], x, weight, out_dtype, dilation, residual)

    def recurrent_step_in_place(self, query, key, value, b, a, A_log, dt_bias, valid, gate, norm) -> torch.Tensor:
        """A one-token step's recurrence over rows ``[0, B)`` of the recurrent state, updated in place, and its
        gated output norm (`hf_qsa_cache.ops.gated_delta.recurrent_step`; ``norm`` is transformers' gated RMS norm
        module); returns ``[B, Hv, Dv]``."""
        return recurrent_step(self.recurrent[: value.shape[0]], query, key, value, b, a, A_log, dt_bias, valid, gate,
                              norm.weight, norm.variance_epsilon, norm.activation)

    def conv_prefill_in_place(self, x: torch.Tensor, weight: torch.Tensor, leading_pads, fresh: bool,
                              out_dtype: torch.dtype) -> torch.Tensor:
        """A step's conv over rows ``[0, B)`` of the conv window, which takes the window's last inputs in place
        (`hf_qsa_cache.ops.gated_delta.conv_prefill`); returns ``[B, L, C]``."""
        return conv_prefill(self.conv[: x.shape[0]], x, weight, leading_pads, fresh, out_dtype)

    def initial_recurrent(self, num_rows: int, fresh: bool) -> torch.Tensor | None:
        """The recurrent state rows ``[0, num_rows)`` start this step from: None (zeros) for fresh rows; a
        copy when autograd records, since the step overwrites the stored state in place afterwards."""
        if fresh:
            return None
        live = self.recurrent[:num_rows]
        return live.clone() if torch.is_grad_enabled() else live

    def write_window(self, name: str, window: torch.Tensor, kept) -> None:
        """Rows ``[0, B)`` of window state ``name`` (``conv``, ``ple_conv``, ``ngram_ids``) become the tail of
        ``window`` = ``[previous state | this step's inputs]``; with rollback history (``kept`` from
        `hf_qsa_cache.rollback.step_history`) the states after the step's last columns are kept too."""
        live = getattr(self, name)
        live[: window.shape[0]] = window[..., -live.shape[-1]:].detach().to(live.dtype)  # values, not history
        if kept is not None:
            self.record_window(name, kept[1], window, kept[0])

    def write_recurrent(self, last_state: torch.Tensor, kept=None, states: torch.Tensor | None = None) -> None:
        """Rows ``[0, B)`` of the recurrent state become ``last_state``; with rollback history, ``states``
        (after each of the step's last columns) are kept too."""
        self.recurrent[: last_state.shape[0]] = last_state.detach().to(self.recurrent.dtype)
        if kept is not None:
            self.record("recurrent", kept[1], states)

    # ------------------------------------------------------------------ rollback
    def history_slots(self, position: torch.Tensor, num_rows: int, query_len: int) -> tuple[int, torch.Tensor]:
        """``(m, slots)``: the last ``m = min(query_len, history)`` columns of a step and their ring slots
        ``[num_rows * m]`` (pads, position -1, go to the spare ring row)."""
        m = min(query_len, self.history)
        pos = position.view(num_rows, query_len)[:, query_len - m:]
        rows = torch.arange(num_rows, device=pos.device)[:, None]
        trash = self.max_rows * self.history
        slots = torch.where(pos >= 0, rows * self.history + pos % self.history, trash)
        return m, slots.reshape(-1)

    def record(self, name: str, slots: torch.Tensor, states: torch.Tensor) -> None:
        """``states[b, j]`` is the state ``name`` after the ``j``-th of the step's last ``m`` columns."""
        ring = self.rings[name]
        ring.index_copy_(0, slots.to(ring.device), states.detach().reshape(-1, *ring.shape[1:]).to(ring.dtype))

    def record_window(self, name: str, slots: torch.Tensor, window: torch.Tensor, m: int) -> None:
        """``window`` is ``[previous state | this step's inputs]`` along its last dim (``[B, C, W + L]`` for a
        conv window, ``[B, W + L]`` for n-gram ids); the state after column ``j`` is its ``W`` entries
        ending there."""
        width = self.rings[name].shape[-1]
        after = window[..., window.shape[-1] - width - m + 1:].unfold(-1, width, 1)  # [..., m, W]
        if after.dim() == 4:  # [B, C, m, W] -> [B, m, C, W]
            after = after.permute(0, 2, 1, 3)
        self.record(name, slots, after)

    def restore(self, rows: list[int], lengths: list[int], plans: dict) -> None:
        """Row ``rows[i]`` becomes the state after position ``lengths[i] - 1`` (fresh when 0). ``plans``
        shares the index tensors (`restore_plan`) between the stores of one crop: every store of a device and
        ring depth reads the same ring rows, and each built tensor is a host-to-device copy."""
        if not rows or not self.allocated:
            return
        key = (self.conv.device, self.history)
        if key not in plans:
            plans[key] = self.restore_plan(rows, lengths)
        fresh, dst, src = plans[key]
        if fresh is not None:
            self.reset_rows(fresh)
        if dst is not None:
            for name, live in self._live().items():
                live.index_copy_(0, dst, self.rings[name].index_select(0, src))

    def restore_plan(self, rows: list[int], lengths: list[int]):
        """``(fresh rows, rows to restore, their ring rows)`` on this store's device (None where empty)."""
        device = self.conv.device
        fresh = [r for r, n in zip(rows, lengths) if n == 0]
        kept = [(r, r * self.history + (n - 1) % self.history) for r, n in zip(rows, lengths) if n > 0]

        def as_tensor(values):
            return torch.tensor(values, dtype=torch.long, device=device) if values else None

        return as_tensor(fresh), as_tensor([r for r, _ in kept]), as_tensor([s for _, s in kept])

    def inplace_rows(self) -> list[torch.Tensor]:
        """The state a step overwrites in place, row-major (all of it: conv and PLE windows, recurrent state,
        n-gram context)."""
        return list(self._live().values())

    def row_tensors(self) -> list[torch.Tensor]:
        rings = [r.view(self.max_rows + 1, self.history, *r.shape[1:]) for r in self.rings.values()]
        return [t for t in (self.conv, self.recurrent, self.ple_conv, self.ngram_ids) if t is not None] + rings

    def snapshot_tensors(self) -> list[torch.Tensor]:
        """The live state only: a row restored from a snapshot starts a new rollback history."""
        return [t for t in (self.conv, self.recurrent, self.ple_conv, self.ngram_ids) if t is not None]

    def reset(self) -> None:
        for t in (self.conv, self.recurrent, self.ple_conv):
            if t is not None:
                t.zero_()
        if self.ngram_ids is not None:
            self.ngram_ids.fill_(self.eos_token_id)

    def reset_rows(self, rows) -> None:
        """Fresh state for rows (a list or a tensor of indices) that start a new sequence."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.conv.device)
        for t in (self.conv, self.recurrent, self.ple_conv):
            if t is not None:
                t.index_fill_(0, rows, 0)
        if self.ngram_ids is not None:
            self.ngram_ids.index_fill_(0, rows, self.eos_token_id)

    def nbytes(self) -> dict[str, int]:
        return {
            "linear_conv": tensor_bytes(self.conv),
            "linear_recurrent": tensor_bytes(self.recurrent),
            "ple_conv": tensor_bytes(self.ple_conv),
            "ple_ngram": tensor_bytes(self.ngram_ids),
            "rollback_headroom": tensor_bytes(*self.rings.values()),
        }
