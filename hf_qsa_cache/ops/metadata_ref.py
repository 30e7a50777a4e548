"""Per-forward step metadata, built once and only read by the layers.

Token layout: a forward sees ``input_ids`` of shape ``[B, L]``. Token ``t`` of the flattened batch is
row ``t // L``, column ``t % L``. Rows are left-padded within the step: row ``b`` has ``count[b]`` real
tokens in its last columns; its first real token has logical position ``prev_len[b]`` (a row that
holds tokens may have pads in a step too: they sit between its past and its new tokens). Pad tokens get
position -1, zero visible blocks and slot -1 everywhere (never written, never read).

`build_step_metadata_torch` is the readable specification. On CUDA the same outputs come from one
Triton launch (`hf_qsa_cache.ops.metadata_triton`), tested against this function; the cache picks
one (`QSAPagedCache`'s `build_step_metadata`). Here, with the ops that read it, below the cache;
``hf_qsa_cache.metadata`` names the same objects.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class QSAGeometry:
    """What the QSA side caches need from the metadata."""

    compress_ratio: int  # r: raw keys per compressed key
    ring_capacity: int  # raw-key ring rows per cache row
    table: str = "main"  # the block table the compressed store shares with main K/V


@dataclass
class StepMetadata:
    num_rows: int  # B
    query_len: int  # L
    prev_len: torch.Tensor  # [B] int32, logical length before this forward
    count: torch.Tensor  # [B] int32, real tokens of each row in this forward
    token_row: torch.Tensor  # [B*L] int32
    position: torch.Tensor  # [B*L] int64, -1 for pads
    slots: dict[str, torch.Tensor]  # table name -> [B*L] int64 slot, -1 for pads
    block_tables: dict[str, torch.Tensor]  # table name -> [B, columns] int32 (null block = 0)
    # QSA only (None otherwise)
    visible_blocks: torch.Tensor | None  # [B*L] int32: complete groups the query may score
    ring_slot: torch.Tensor | None  # [B*L] int64: row*cap + pos % cap for a row's last cap tokens
    compress_work: torch.Tensor | None  # [W, 2] int32 (row, group); (-1, -1) when unused
    # Host copies of prev_len / count, so that shapes are known without a device sync. None when the
    # step is replayed from a CUDA graph: the values change from replay to replay.
    host_prev_len: list[int] | None
    host_count: list[int] | None
    # Bound on every row's length after this step: the exact maximum when the host values are known,
    # the step's reach in a CUDA graph (`cuda_graphs.reach_bucket`). Shapes that grow with context are
    # sized from it.
    max_seq_len: int
    # A CUDA-graph step whose rows may take fewer tokens than the step (left-padded: verify steps of rows that drafted
    # different counts): its leading pads come from the device counts (`leading_pads`). Recorded apart from the
    # steps without pads, which skip the pads' work.
    padded: bool = False
    # A grouped step (`hf_qsa_cache.step.RowGroup`) runs its groups of rows one rectangle at a time: this metadata's
    # rows are the group's own (0 .. num_rows - 1), and they are cache rows ``row_offset ..``. Per-row state read
    # by row index (recurrent state, windows, the QSA ring) is addressed from there; block tables are the group's.
    row_offset: int = 0

    @property
    def rows(self) -> slice:
        """The cache rows this metadata's rows are."""
        return slice(self.row_offset, self.row_offset + self.num_rows)

    def derived(self, key, make):
        """``make()``, computed once per step for ``key`` and shared by every layer that asks (index tensors
        all layers of a kind compute alike). Kept off the dataclass fields, so `to` starts without them."""
        memo = self.__dict__.setdefault("_derived", {})
        if key not in memo:
            memo[key] = make()
        return memo[key]

    @property
    def valid(self) -> torch.Tensor:
        return self.position >= 0

    @property
    def starts_fresh(self) -> bool:
        """Every row is empty before this step (known on the host; False for a CUDA-graph step): layers
        start from fresh state instead of reading it, so a step recomputed later (activation
        checkpointing, after the step has written its state) computes the same."""
        return self.host_prev_len is not None and not any(self.host_prev_len)

    def leading_pads(self) -> torch.Tensor | None:
        """``[B]`` pad columns before each row's real tokens in this step, or None when no row has any. A CUDA-graph
        step's counts are not known on the host: the device tensor when it was recorded for padded rows
        (``padded``), else None."""
        if self.host_count is None:
            return self.query_len - self.count.long() if self.padded else None
        if all(c == self.query_len for c in self.host_count):
            return None
        return self.query_len - self.count.long()

    def closes_groups(self, ratio: int) -> bool:
        """Whether this forward may close a group of ``ratio`` tokens in some row (always, in a graph)."""
        if self.host_prev_len is None:
            return True
        return any((p + c) // ratio > p // ratio for p, c in zip(self.host_prev_len, self.host_count))

    def to(self, device: torch.device) -> "StepMetadata":
        """The same metadata on another device (for models split across GPUs)."""

        def mv(x):
            if isinstance(x, torch.Tensor):
                return x.to(device, non_blocking=True)
            if isinstance(x, dict):
                return {k: mv(v) for k, v in x.items()}
            return x  # host ints and lists, None

        # Field by field, by name: a new field cannot be forgotten or crossed with another.
        return StepMetadata(**{f.name: mv(getattr(self, f.name)) for f in fields(self)})


def max_compress_work(num_rows: int, query_len: int, ratio: int) -> int:
    """Upper bound on groups one forward closes: each row closes at most ceil(L / r)."""
    return num_rows * (-(-query_len // ratio))


def build_step_metadata_torch(
    prev_len: torch.Tensor,
    count: torch.Tensor,
    query_len: int,
    block_tables: dict[str, torch.Tensor],
    block_sizes: dict[str, int],
    qsa: QSAGeometry | None,
    host_prev_len: list[int] | None,
    host_count: list[int] | None,
    max_seq_len: int | None = None,
) -> StepMetadata:
    device = prev_len.device
    num_rows = prev_len.shape[0]
    n = num_rows * query_len
    t = torch.arange(n, device=device)
    row = t // query_len
    col = t % query_len
    first_real = (query_len - count.long())[row]
    valid = col >= first_real
    position = torch.where(valid, prev_len.long()[row] + col - first_real, -1)
    safe_pos = position.clamp_min(0)

    def paged_slot(table: torch.Tensor, pos: torch.Tensor, block_size: int, ok: torch.Tensor) -> torch.Tensor:
        logical_block = pos // block_size
        in_table = logical_block < table.shape[1]
        block = table[row, logical_block.clamp_max(table.shape[1] - 1)].long()
        slot = block * block_size + pos % block_size
        return torch.where(ok & in_table, slot, -1)

    slots = {name: paged_slot(tab, safe_pos, block_sizes[name], valid) for name, tab in block_tables.items()}
    visible_blocks = ring_slot = compress_work = None
    if qsa is not None:
        r = qsa.compress_ratio
        cap = qsa.ring_capacity
        seq_len = (prev_len + count).long()
        visible = torch.minimum((safe_pos + 1) // r, seq_len[row] // r)
        visible_blocks = torch.where(valid, visible, 0).to(torch.int32)
        # Only the last `cap` real tokens of a row go to the ring; earlier ones would be overwritten anyway.
        ring_slot = torch.where(valid & (col + cap >= query_len), row * cap + safe_pos % cap, -1)
        # Work list: (row, group) for every group closed in this forward, row-major.
        groups_before = prev_len.long() // r
        groups_after = seq_len // r
        per_row = (groups_after - groups_before).clamp_min(0)
        ends = per_row.cumsum(0)
        starts = ends - per_row
        w = max_compress_work(num_rows, query_len, r)
        work = torch.arange(w, device=device)
        work_row = torch.searchsorted(ends, work, right=True)
        active = work < ends[-1] if num_rows > 0 else torch.zeros_like(work, dtype=torch.bool)
        safe_row = work_row.clamp_max(max(num_rows - 1, 0))
        work_group = groups_before[safe_row] + work - starts[safe_row]
        compress_work = torch.stack(
            [torch.where(active, work_row, -1), torch.where(active, work_group, -1)], dim=1
        ).to(torch.int32)
    return StepMetadata(
        num_rows=num_rows, query_len=query_len, prev_len=prev_len, count=count, token_row=row.to(torch.int32),
        position=position, slots=slots, block_tables=block_tables, visible_blocks=visible_blocks,
        ring_slot=ring_slot, compress_work=compress_work,
        **host_fields(host_prev_len, host_count, max_seq_len),
    )


def host_fields(host_prev_len: list[int] | None, host_count: list[int] | None, max_seq_len: int | None) -> dict:
    """The host part of a `StepMetadata`: exact values, or (in a CUDA graph) only a length bound."""
    if host_prev_len is None:
        if max_seq_len is None:
            raise ValueError("metadata without host lengths needs max_seq_len")
        return dict(host_prev_len=None, host_count=None, max_seq_len=max_seq_len)
    seq = [p + c for p, c in zip(host_prev_len, host_count)]
    return dict(host_prev_len=list(host_prev_len), host_count=list(host_count), max_seq_len=max(seq, default=0))
