"""One step of a `QSAPagedCache`: its plan, and the transaction that lands it whole or not at all.

A step is planned (`plan_step`: validation, nothing changes), begun (blocks reserved, rows advanced, the
state it overwrites in place copied aside), and ends with exactly one of `Step.commit` or `Step.abort`.
A plan is a list of pieces, one ``(row, start, count)`` span of real tokens per row; the steps of
`generate()` are rectangles (rows ``0 .. B-1``, ``L`` columns each, left-padded), the shape the step metadata
is built for. A *grouped* step (continuous batching: decoding rows one token each beside prefill chunks) is a
list of such rectangles over consecutive rows (`RowGroup`), its tokens one rectangle after the other; it is
planned and taken back as one step, and its metadata is one per group.

What a step changes, and its one way back:

* the rows' host state (`hf_qsa_cache.rows.Rows`): a snapshot taken before anything changes, put back whole;
* block tables: each table journals the blocks the step reserves (`BlockTable.begin_step`), and blocks
  that fall out of a window are only released at commit, so an abort finds every block where it was;
* paged stores (attention K/V, QSA compressed keys, Inkling conv taps) and the token log: a step writes
  them only at positions past its rows' old lengths, which nothing reads once the lengths are back;
* stores overwritten in place (GatedDeltaNet / PLE state and windows, the QSA raw-key ring): the step's
  rows are copied aside before the first write (one batched copy, `UndoCopies`) and copied back on abort.
  A cache built with ``step_undo=False`` copies nothing: an abort marks the rows the step fed ``lost``
  (`hf_qsa_cache.rows.Rows`), and a later step that feeds one of them is refused until it is released;
* the speculative rollback rings (Qwen4Exp): not copied. An aborted step may have overwritten entries a
  crop would read, so after an abort a row cannot be cropped to its current length or below (a crop of
  rejected drafts after a retried verify step never goes there: the verified token stays).

A cache that held nothing before the step is reset instead (exact and cheaper). If taking the step back
fails itself, the cache refuses every further step with an error that names ``reset()``; the original
error is what the caller sees.

A model's forward may run several steps (the chunks of a long prompt): `ForwardScope` makes the whole
call land or not (`QSAPagedCache.forward_scope`).
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass, field

import torch

from .blocks import device_tables
from .metadata import StepMetadata, build_step_metadata_torch
from .ops import int_tensor
from .padding import host_step_columns


@dataclass(frozen=True)
class Piece:
    """``count`` real tokens of ``row``, at logical positions ``start .. start + count - 1``."""

    row: int
    start: int
    count: int


@dataclass(frozen=True)
class RowGroup:
    """Rows ``first .. first + rows - 1`` of a grouped step, ``query_len`` columns each (a row's real tokens in
    its last columns). A grouped step's tokens are its groups' rectangles one after the other, row-major."""

    first: int
    rows: int
    query_len: int

    @property
    def tokens(self) -> int:
        return self.rows * self.query_len


def row_groups(shape: list[tuple[int, int]]) -> list[RowGroup]:
    """``[(rows, query_len), ...]`` as `RowGroup`s over consecutive rows from row 0."""
    groups, first = [], 0
    for rows, query_len in shape:
        groups.append(RowGroup(first, int(rows), int(query_len)))
        first += int(rows)
    return groups


@dataclass(frozen=True)
class StepPlan:
    """What a step will do: rows ``0 .. len(prev) - 1``, ``query_len`` columns each; row ``b`` holds
    ``prev[b]`` tokens before the step and takes ``counts[b]`` real ones."""

    query_len: int
    prev: list[int]
    counts: list[int]
    rows: int = field(init=False)
    new_lengths: list[int] = field(init=False)  # each row's length after the step

    def __post_init__(self):  # computed once: the host part of a decode step is on its critical path
        object.__setattr__(self, "rows", len(self.prev))
        object.__setattr__(self, "new_lengths", list(map(operator.add, self.prev, self.counts)))

    @property
    def pieces(self) -> list[Piece]:
        return [Piece(b, p, c) for b, (p, c) in enumerate(zip(self.prev, self.counts))]


def build_step_metadata(prev_len: torch.Tensor, *args, **kwargs) -> StepMetadata:
    """A step's metadata: one Triton launch on CUDA, the torch specification elsewhere (same arguments as
    `hf_qsa_cache.metadata.build_step_metadata_torch`)."""
    if prev_len.is_cuda:
        from .ops.metadata_triton import build_step_metadata_triton

        return build_step_metadata_triton(prev_len, *args, **kwargs)
    return build_step_metadata_torch(prev_len, *args, **kwargs)


def graph_step_metadata(cache, lengths: torch.Tensor, query_len: int,
                        block_tables: dict[str, torch.Tensor] | None = None, reach: int | None = None,
                        padded: bool = False) -> StepMetadata:
    """Metadata of a step of ``cache`` whose lengths (``[2, rows]``: before the step, real tokens) sit in a
    device buffer, so that the same launches serve every replay of a CUDA graph: no host copies of the
    lengths, shapes sized for ``reach`` tokens per row (default: the cache's capacity; the caller guarantees
    no row holds more after the step). ``block_tables``: the device tables to read (default: the persistent
    ones, brought up to date). ``padded``: rows may take fewer tokens than ``query_len`` (left-padded). The
    layers read it from ``cache.metadata``."""
    reach = cache.max_cache_len if reach is None else reach
    rows = lengths.shape[1]
    if block_tables is None:
        block_tables = device_tables(cache.tables, rows, lengths.device)
    block_sizes = {name: t.block_size for name, t in cache.tables.items()}
    meta = build_step_metadata(lengths[0], lengths[1], query_len, block_tables, block_sizes, cache.qsa, None,
                               None, max_seq_len=reach)
    meta.padded = padded
    cache.metadata.set(meta, lengths.device)
    return meta


# ---------------------------------------------------------------------- planning (nothing changes)
def row_counts(rows, batch_size: int, query_len: int, attention_mask: torch.Tensor | None) -> list[int]:
    """Real tokens per row in a forward of ``[batch_size, query_len]`` (the mask's last ``query_len`` columns).

    Within the step a row's pads must come before its real tokens (the models reorder any other mask to
    that layout first: `hf_qsa_cache.padding`); the columns before the step may hold pads anywhere (a
    right-padded prompt, then tokens generated after the pads). A row that holds tokens may have pads in
    a step: its state continues at its real length."""
    if attention_mask is None:
        return [query_len] * batch_size
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch_size:
        raise ValueError(
            f"attention_mask must be 2-D [batch, length] with batch {batch_size}, got {tuple(attention_mask.shape)}"
        )
    if attention_mask.shape[1] < query_len:
        raise ValueError(
            f"attention_mask covers {attention_mask.shape[1]} columns, fewer than the {query_len} input tokens"
        )
    if query_len == 1 and 0 not in rows.lengths[:batch_size]:  # no row starts in this step
        # generate() appends a 1 for every row at every step; trusting it keeps decode free of host syncs.
        return [1] * batch_size
    mask = host_step_columns(attention_mask, query_len).to(torch.int64)  # read once (step_order shares it)
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold only 0 and 1")
    steps = mask[:, 1:] - mask[:, :-1]
    bad = (steps < 0).any(dim=1).nonzero().flatten().tolist()
    if bad:
        raise ValueError(
            f"the step's attention_mask columns are not left-padded: row {bad[0]} has a real token before a "
            "pad (the models reorder such masks before the step: hf_qsa_cache.padding.step_order)"
        )
    return mask.sum(dim=1).tolist()


def why_not_fits(cache, new_lengths: list[int], what: str = "this step") -> str | None:
    """None if rows ``0, 1, ...`` of ``cache`` can grow to ``new_lengths`` (``max_cache_len``, every block
    pool), else what stands in the way."""
    if new_lengths and max(new_lengths) > cache.max_cache_len:
        b, need = next((b, n) for b, n in enumerate(new_lengths) if n > cache.max_cache_len)
        return f"row {b} needs {need} slots, cache holds max_cache_len={cache.max_cache_len}"
    for name, table in cache.tables.items():
        need = table.blocks_needed_rows(new_lengths)
        if need > table.available():  # idle cached blocks are given back on demand
            return (f"{name} block pool: {what} needs {need} free blocks of {table.block_size} tokens, "
                    f"{table.available()} are free (num_blocks={table.num_blocks})")
    return None


def group_counts(cache, groups: list[RowGroup], counts: list[int]) -> int:
    """Check a grouped step's shape (`QSAPagedCache.grouped_step`; a row may take no token, all pads); its rows."""
    if not cache.rows.managed:
        raise ValueError("a grouped step runs on rows placed with move_rows (continuous batching)")
    first = 0
    for g in groups:
        if g.first != first or g.rows < 1 or g.query_len < 1:
            raise ValueError(f"row groups must cover rows 0, 1, ... in order, each with at least one row and one "
                             f"column; got {groups}")
        first += g.rows
    if len(counts) != first:
        raise ValueError(f"the groups cover {first} rows, {len(counts)} counts given")
    for g in groups:
        for b in range(g.first, g.first + g.rows):
            if not 0 <= counts[b] <= g.query_len:
                raise ValueError(f"row {b} takes {counts[b]} tokens in a group of {g.query_len} columns")
    if not any(counts):
        raise ValueError("a grouped step feeds at least one token")
    return first


def plan_step(cache, batch_size: int, query_len: int, attention_mask: torch.Tensor | None,
              counts: list[int] | None = None) -> StepPlan:
    """Validate a forward of ``[batch_size, query_len]`` tokens on ``cache`` and plan it; changes nothing.
    ``counts``: each row's real tokens, given (a grouped step) instead of read from ``attention_mask``."""
    cache.check_usable()
    rows = cache.rows
    if query_len < 1 or batch_size < 1:
        raise ValueError(f"a step needs at least one row and one token, got input of shape [{batch_size}, {query_len}]")
    if batch_size > cache.max_batch_size:
        raise ValueError(f"batch of {batch_size} rows exceeds max_batch_size={cache.max_batch_size}")
    if rows.managed:
        if batch_size > rows.count:
            raise ValueError(f"a step over {batch_size} rows, the cache holds {rows.count} (move_rows admits rows)")
    elif rows.columns > 0 and batch_size != rows.count:
        raise ValueError(
            f"the cache holds a batch of {rows.count} rows in flight, got {batch_size}; call reset() first"
        )
    if counts is None:
        counts = row_counts(rows, batch_size, query_len, attention_mask)
    plan = StepPlan(query_len, rows.lengths[:batch_size], counts)
    lost = [b for b, n in enumerate(plan.counts) if n and rows.lost[b]]
    if lost:
        raise ValueError(
            f"row {lost[0]} lost its state when a step that fed it failed (this cache keeps no undo copies: "
            "step_undo=False): release the row (move_rows) or call cache.reset()"
        )
    problem = why_not_fits(cache, plan.new_lengths)
    if problem is not None:
        raise ValueError(problem)
    return plan


# ---------------------------------------------------------------------- the transaction
class Step:
    """One planned step of ``cache``: `begin`, then exactly one of `commit` or `abort`."""

    def __init__(self, cache, plan: StepPlan):
        self.cache = cache
        self.plan = plan
        self.rows_before = cache.rows.snapshot()
        # Managed rows (continuous batching) are never reset wholesale: the other rows hold live requests; nor
        # are rows that start from cached prefixes (their lengths are set before the first step).
        self.started_empty = cache.rows.columns == 0 and not cache.rows.managed and not any(cache.rows.lengths)
        self.saved_rows = 0  # rows of in-place state copied aside (0: nothing to copy back)

    @property
    def prev(self) -> list[int]:
        return self.plan.prev

    @property
    def counts(self) -> list[int]:
        return self.plan.counts

    def begin(self, copy_rows: bool = True, rope_deltas: list[int | None] | None = None) -> None:
        """Make the step's room: fresh stores for a cache that held nothing, the in-place rows copied aside
        (``copy_rows=False``: the caller copies them inside a recorded CUDA graph and says so through
        `rows_saved`), blocks reserved, the rows advanced. On error the caller aborts."""
        cache, plan = self.cache, self.plan
        for table in cache.tables.values():
            table.begin_step(plan.rows)
        if self.started_empty:
            cache.reset_stores()  # rows start fresh: zero GDN/PLE state, EOS n-gram context
        if copy_rows:
            cache.copy_rows_aside(plan.rows)
            self.rows_saved(plan.rows)
        for table in cache.tables.values():
            table.reserve_rows(plan.new_lengths)
        cache.rows.advance(plan.new_lengths, plan.query_len, rope_deltas)

    def build_metadata(self, device: torch.device) -> StepMetadata:
        """The step's metadata on ``device`` (the step's lengths copied once from the host), which the layers
        then read from ``cache.metadata``."""
        return self.build_group_metadata([RowGroup(0, self.plan.rows, self.plan.query_len)], device)[0]

    def build_group_metadata(self, groups: list[RowGroup], device: torch.device) -> list[StepMetadata]:
        """One metadata per group of a grouped step (its rows numbered from 0, `StepMetadata.row_offset` its first
        cache row: stores with per-row state are read from there, `Store.rows_from`). The first is set as the
        step's; each group's layers run under ``cache.replaying(its metadata)``."""
        cache, plan = self.cache, self.plan
        device = canonical_device(device)
        lengths = int_tensor([plan.prev, plan.counts], torch.int32)  # one host-to-device copy a step
        if device.type == "cuda":
            lengths = lengths.to(device, non_blocking=True)
        tables = device_tables(cache.tables, plan.rows, device)
        block_sizes = {name: t.block_size for name, t in cache.tables.items()}
        metas = []
        for g in groups:
            rows = slice(g.first, g.first + g.rows)
            meta = build_step_metadata(lengths[0, rows], lengths[1, rows], g.query_len,
                                       {name: t[rows].contiguous() for name, t in tables.items()}, block_sizes,
                                       cache.qsa, plan.prev[rows], plan.counts[rows])
            meta.row_offset = g.first
            metas.append(meta)
        cache.metadata.set(metas[0], device)
        return metas

    def rows_saved(self, rows: int) -> None:
        """``rows`` rows of in-place state were copied aside: an abort copies them back."""
        if not self.started_empty:  # an abort resets the cache: nothing to copy back
            self.saved_rows = rows

    def commit(self) -> None:
        """The step landed: release blocks that fell out of the windows; with prefix caching, generate()'s rows
        that a one-token step brought to a unit boundary keep a snapshot there (`QSAPagedCache.keep_tails`)."""
        cache = self.cache
        rows = cache.rows
        for table in cache.tables.values():
            table.commit_step(rows.lengths[: rows.count])
        if cache.prefix is not None and self.plan.query_len == 1 and cache.prefix_rows_from_ids and not rows.managed:
            cache.keep_tails(self.plan)

    def abort(self) -> None:
        """Put the cache back as it was before the step (see the module docstring)."""
        cache = self.cache
        cache.rows.restore(self.rows_before)
        for table in cache.tables.values():
            table.rollback_step()
        cache.clear_step_metadata()
        try:
            if self.started_empty:
                cache.reset()
                return
            if not cache.undo.enabled:  # nothing to copy back: the rows the step fed keep what it half wrote
                cache.rows.mark_lost([b for b, n in enumerate(self.plan.counts) if n])
            elif self.saved_rows:
                cache.copy_rows_back(self.saved_rows)
        except BaseException as error:  # the original error is the one the caller sees
            cache.mark_unusable(f"a forward failed and taking it back failed too ({type(error).__name__}: {error})")
            return
        if cache.keeps_rollback_history:
            # The step may have overwritten ring entries a crop would read: no crop to the current length or below.
            rows = cache.rows
            for b in range(rows.count):
                rows.raise_crop_floor(b, rows.lengths[b] + 1)


class ForwardScope:
    """One call of a model's forward (its steps, the LM head, the loss): the steps it runs land only if the
    whole call returns. A step ends `pending` inside a scope; the next step of the call commits it first
    (`land_pending`), and the scope commits the last one when the call returns."""

    def __init__(self, cache):
        self.cache = cache
        self.columns_before = cache.rows.columns
        rows = cache.rows
        self.empty_before = rows.columns == 0 and not rows.managed and not any(rows.lengths)
        self.pending: Step | None = None  # the call's last step, not landed yet
        self.on_land: list = []  # what runs once the whole call has landed (`QSAPagedCache.after_forward`)

    def land_pending(self) -> None:
        if self.pending is not None:
            self.pending.commit()
            self.pending = None

    def failed(self) -> None:
        """The call raised: take the pending step back; if earlier chunks of the call landed, a cache that was
        empty before the call is reset, any other refuses further steps until `reset()`."""
        cache = self.cache
        if self.pending is not None:
            self.pending.abort()
        # Rows the call started from cached prefixes count as landed chunks (the cache was empty: it is reset).
        restored = self.empty_before and any(cache.rows.lengths)
        if cache.rows.columns != self.columns_before or restored:  # earlier steps of this call landed
            if self.columns_before == 0:
                cache.reset()
            else:
                cache.mark_unusable("a forward failed after some of its chunks landed")


@contextlib.contextmanager
def transaction(cache, batch_size: int, query_len: int, attention_mask: torch.Tensor | None, copy_rows: bool = True,
                rope_deltas: list[int | None] | None = None, counts: list[int] | None = None):
    """``with transaction(cache, B, L, mask) as step:`` one step of ``cache``, as a transaction.

    Validates first (`plan_step`: nothing changes on error), then begins the `Step` (``step.prev``: each row's
    length before it, ``step.counts``: its real tokens in it). The step lands only if the block exits
    normally; any exception (host code, metadata, a layer, a graph replay) takes every change back. Inside a
    forward scope it lands with the scope. ``rope_deltas``: each row's RoPE offset after this step (None keeps
    a row's). ``copy_rows=False``: the caller copies the rows aside itself, inside a recorded CUDA graph
    (`QSAPagedCache.copy_rows_aside`), and says so with ``step.rows_saved(rows)`` once that copy has run.
    """
    if cache._open is not None:
        raise RuntimeError("a step of this cache is already in flight (steps do not nest)")
    scope = cache._scope
    if scope is not None:
        scope.land_pending()  # the previous chunk of this forward lands first
    plan = plan_step(cache, batch_size, query_len, attention_mask, counts)
    if cache.prefix is not None:  # idle cached blocks the step needs go back to the pools before it begins
        cache.prefix.make_room_for(plan.new_lengths)
    step = cache._open = Step(cache, plan)
    cache.steps_started += 1
    try:
        step.begin(copy_rows=copy_rows, rope_deltas=rope_deltas)
        yield step
    except BaseException:
        cache._open = None
        step.abort()
        raise
    finally:
        cache.metadata.clear()
    cache._open = None
    if scope is not None:
        scope.pending = step  # lands when the model's whole forward returns
    else:
        step.commit()


@contextlib.contextmanager
def forward_scope(cache):
    """``with forward_scope(cache):`` one call of a model's forward (`ForwardScope`). If the call raises, the
    pending step is taken back; if earlier chunks of the call landed, a cache that was empty before the call
    is reset, any other refuses further steps until `reset()` (landed chunks cannot be taken back). Scopes
    nest: only the outermost one counts."""
    if cache._scope is not None:
        yield
        return
    scope = cache._scope = ForwardScope(cache)
    try:
        yield
    except BaseException:
        cache._scope = None
        scope.failed()
        raise
    cache._scope = None
    scope.land_pending()
    for fn in scope.on_land:
        fn()


# ---------------------------------------------------------------------- what the layers read, and the undo copies
def canonical_device(device) -> torch.device:
    """``cuda`` and ``cuda:<current>`` name the same device; key per-device copies by one name."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class MetadataSlot:
    """The metadata of the step in flight, which every layer reads (copied once per device, for split models)."""

    def __init__(self):
        self.current: StepMetadata | None = None
        self._by_device: dict[torch.device, StepMetadata] = {}

    def set(self, meta: StepMetadata, device: torch.device) -> None:
        self.current = meta
        self._by_device = {canonical_device(device): meta}

    def clear(self) -> None:
        self.current = None
        self._by_device = {}

    def on(self, device: torch.device) -> StepMetadata:
        if self.current is None:
            raise RuntimeError("no step in progress: the model must run inside cache.step()")
        device = canonical_device(device)
        meta = self._by_device.get(device)
        if meta is None:
            meta = self._by_device[device] = self.current.to(device)
        return meta

    @contextlib.contextmanager
    def replaying(self, meta: StepMetadata):
        """Run a layer of the step ``meta`` describes. A no-op inside that step; after it (activation
        checkpointing recomputes layers during backward) the step's metadata is put back for the layer's run.
        The recompute writes the values the step wrote, to the same slots."""
        if self.current is meta:
            yield
            return
        saved = self.current, self._by_device
        self.current, self._by_device = meta, {canonical_device(meta.position.device): meta}
        try:
            yield
        finally:
            self.current, self._by_device = saved


class UndoCopies:
    """The copies a step takes of the per-row state it overwrites in place (GatedDeltaNet / PLE state and
    windows, the QSA raw-key ring: each store's `inplace_rows`), made and owned here.

    With ``enabled=False`` (``QSAPagedCache(step_undo=False)``) no copy is made or taken: an aborted step then
    leaves the rows it fed unusable until they are released (`Step.abort`), and the cache saves the copies'
    memory and the copy a step costs (at 64 rows of Qwen4Exp's released config, 3.8 GiB and ~3 ms a decode step).

    Copies are made as stores are allocated (`track`; never inside a recorded CUDA graph), one per in-place tensor.
    Views of the first rows are kept per row count (building ~100 views costs more host time than a graphed
    decode step can spare), one pair of lists per (device, dtype): torch's foreach copy batches a list of one
    dtype into a few launches and copies a mixed list one tensor at a time."""

    def __init__(self, layers: list, enabled: bool = True):
        self._layers = layers  # the cache's `LayerState`s (not the cache: a runner-free cache frees without gc)
        self.enabled = enabled
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (live, copy) of every in-place tensor
        self._views: dict[int, list[tuple[list[torch.Tensor], list[torch.Tensor]]]] = {}

    def track(self) -> None:
        """Copies for the in-place tensors of every allocated store (kept where the tensor is the same, made
        where it is new, dropped where it is gone)."""
        self._views.clear()
        if not self.enabled:
            return
        def key(t):  # the memory a tensor views (stores hand out fresh views of the same memory)
            return t.device, t.data_ptr(), t.dtype, tuple(t.shape)

        kept = {key(live): copy for live, copy in self._copies}
        self._copies = []  # (the old live tensors are let go before new copies are made)
        for store in (store for layer in self._layers for store in layer.stores.values()):
            for live in store.inplace_rows():
                copy = kept.get(key(live))
                self._copies.append((live, copy if copy is not None else torch.empty_like(live)))

    def nbytes(self) -> int:
        return sum(copy.numel() * copy.element_size() for _, copy in self._copies)

    def views(self, rows: int) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        views = self._views.get(rows)
        if views is None:
            groups: dict[tuple, tuple[list, list]] = {}
            for state, copy in self._copies:
                live, saved = groups.setdefault((state.device, state.dtype), ([], []))
                live.append(state[:rows])
                saved.append(copy[:rows])
            views = self._views[rows] = list(groups.values())
        return views

    def copy_aside(self, rows: int) -> None:
        with torch.no_grad():  # cached state is never differentiated (and foreach copies refuse int64 under grad)
            for live, saved in self.views(rows):
                torch._foreach_copy_(saved, live)

    def copy_back(self, rows: int) -> None:
        with torch.no_grad():
            for live, saved in self.views(rows):
                torch._foreach_copy_(live, saved)
