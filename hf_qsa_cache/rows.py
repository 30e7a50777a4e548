"""`Rows`: the host-side state of a cache's rows, and the one place that writes it.

A row is one sequence of a batch (a beam, a continuous-batching request). Per row the cache keeps:

* ``lengths``: its logical length (real tokens; pads excluded);
* ``rope_deltas``: its multimodal RoPE offset (Qwen4Exp with images or video): a token given no explicit
  position ids is rotated at its logical position plus this delta, so text after an image continues
  where the image's 3-D positions end. Zero for text-only rows;
* ``crop_floor``: the shortest length a crop may reach (Qwen4Exp's rollback rings; `hf_qsa_cache.rollback`);
* ``lost``: 1 when a step that fed the row failed on a cache that keeps no undo copies
  (``QSAPagedCache(step_undo=False)``): its in-place state is partly overwritten, so it takes no further
  step until it is released.

and for the batch: ``count`` (rows in flight), ``columns`` (the rectangular length, pads included, that
`generate()` reasons in) and ``managed`` (rows placed one by one by continuous batching rather than a batch
`generate()` holds).

Every per-row field is named in `PER_ROW`: selecting, moving, releasing, snapshotting and restoring rows
treat them all alike, so a new field is one entry there. The device data of a row (paged blocks, per-row
tensors) is owned by the block tables and the stores; `select_rows` and `move_rows` place rows on a cache:
they check everything, gather the device data, then change the tables, the `Rows` and the stores together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .ops import int_tensor


@dataclass(frozen=True)
class RowsSnapshot:
    fields: dict[str, list[int]]
    count: int
    columns: int
    managed: bool


class Rows:
    PER_ROW = ("lengths", "rope_deltas", "crop_floor", "lost")

    def __init__(self, max_rows: int):
        self.max_rows = max_rows
        self.reset()

    def reset(self) -> None:
        """Every row released: no row in flight, nothing held."""
        for name in self.PER_ROW:
            setattr(self, name, [0] * self.max_rows)
        self.count = 0
        self.columns = 0
        self.managed = False

    # ------------------------------------------------------------------ transactions
    def snapshot(self) -> RowsSnapshot:
        return RowsSnapshot({name: list(getattr(self, name)) for name in self.PER_ROW}, self.count, self.columns,
                            self.managed)

    def restore(self, snapshot: RowsSnapshot) -> None:
        for name, values in snapshot.fields.items():
            setattr(self, name, list(values))
        self.count, self.columns, self.managed = snapshot.count, snapshot.columns, snapshot.managed

    # ------------------------------------------------------------------ a step
    def advance(self, new_lengths: list[int], query_len: int, rope_deltas: list[int | None] | None = None) -> None:
        """Rows ``[0, len(new_lengths))`` took a step of ``query_len`` columns and now hold ``new_lengths``
        tokens; ``rope_deltas`` gives a row's new offset (None keeps it)."""
        rows = len(new_lengths)
        self.lengths[:rows] = new_lengths
        self.count = max(self.count, rows) if self.managed else rows
        self.columns += query_len
        for b, delta in enumerate(rope_deltas or []):
            if delta is not None:
                self.rope_deltas[b] = int(delta)

    def shorten(self, drop: int | list[int]) -> None:
        """Every row in flight drops its last ``drop`` tokens, or row ``b`` its last ``drop[b]`` (the batch drops
        as many columns as the most any row drops)."""
        drops = [drop] * self.count if isinstance(drop, int) else drop
        for b in range(self.count):
            self.lengths[b] -= drops[b]
        self.columns -= max(drops, default=0)

    def raise_crop_floor(self, row: int, floor: int) -> None:
        """Row ``row`` may no longer be cropped below ``floor`` (floors only rise until the row is released)."""
        self.crop_floor[row] = max(self.crop_floor[row], floor)

    def start_at(self, row: int, length: int, crop_floor: int) -> None:
        """Empty row ``row`` starts from a cached prefix of ``length`` tokens (its blocks below are shared)."""
        self.lengths[row] = length
        self.crop_floor[row] = crop_floor
        self.rope_deltas[row] = 0
        self.count = max(self.count, row + 1)

    def mark_lost(self, rows: list[int]) -> None:
        """Rows ``rows`` lost their in-place state to a failed step (see ``lost`` above)."""
        for b in rows:
            self.lost[b] = 1

    def set_columns(self, columns: int) -> None:
        """The batch's rectangular width after a prefill that started rows from cached prefixes (the columns
        the caller fed, some of them held already)."""
        self.columns = columns

    def clear_row(self, row: int) -> None:
        """Row ``row``'s fields back to a fresh row's (a restore that did not complete)."""
        for name in self.PER_ROW:
            getattr(self, name)[row] = 0

    def next_positions(self, rows: int) -> list[int]:
        """The RoPE position each of the first ``rows`` rows continues at (its length plus its delta)."""
        return [self.lengths[b] + self.rope_deltas[b] for b in range(rows)]

    # ------------------------------------------------------------------ placing rows
    def select(self, src: list[int]) -> None:
        """Row ``i`` becomes a copy of row ``src[i]``; rows past ``len(src)`` are released (beam search)."""
        self._permute(src)

    def move(self, src: list[int]) -> None:
        """Row ``i`` becomes row ``src[i]``, or a fresh row where ``src[i] == -1``; rows no entry names are
        released. The rows are managed from now on (continuous batching)."""
        self._permute(src)
        self.managed = True
        self.columns = max(self.columns, 1)  # generate()'s whole-batch rules no longer apply

    def _permute(self, src: list[int]) -> None:
        pad = [0] * (self.max_rows - len(src))
        for name in self.PER_ROW:
            values = getattr(self, name) + [0]  # a fresh row (-1) reads the 0 at the end
            setattr(self, name, list(map(values.__getitem__, src)) + pad)
        self.count = len(src)

    def __repr__(self):
        return f"Rows(count={self.count}, columns={self.columns}, lengths={self.lengths[:self.count]})"


# ---------------------------------------------------------------------- placing rows on a cache
class _IndicesByDevice:
    """Row-index lists as long tensors, each made once per device (a row move touches every store's tensors)."""

    def __init__(self):
        self._made: dict[tuple[int, torch.device], tuple[list[int], torch.Tensor]] = {}

    def __call__(self, rows: list[int], device: torch.device) -> torch.Tensor:
        key = (id(rows), device)
        made = self._made.get(key)
        if made is None or made[0] is not rows:
            made = self._made[key] = (rows, int_tensor(rows).to(device))
        return made[1]


def _check_idle(cache) -> None:
    if cache.open_step is not None:
        raise RuntimeError("cannot move rows while a step is in flight")
    cache.check_usable()


def select_rows(cache, src: list[int]) -> None:
    """Row ``i`` of ``cache`` becomes a copy of row ``src[i]``; rows past ``len(src)`` are released (beam search).
    A copy shares its source's full blocks (reference counted) and copies the last, partial one (which it takes
    over instead when the source row is released: a permutation copies nothing).

    Everything is checked first (row indices, ``max_batch_size``, free blocks for the copies), and the device
    data is gathered before anything is written, so a refusal changes nothing; a failure while writing refuses
    further steps, naming `reset()`.
    """
    _check_idle(cache)
    n, held = len(src), cache.rows.count
    if not 1 <= n <= cache.max_batch_size:
        raise ValueError(f"the cache can hold 1 to max_batch_size={cache.max_batch_size} rows, asked for {n}")
    if any(not 0 <= s < held for s in src):
        raise ValueError(f"row indices must lie in [0, {held}) (rows the cache holds), got {src}")
    lengths = cache.rows.lengths
    for name, table in cache.tables.items():
        need = table.blocks_for_select(src, held, lengths)
        if cache.prefix is not None and need > len(table.free):
            cache.prefix.make_room(name, need)  # idle cached blocks go back to the pool
        have = len(table.free)
        if need > have:
            raise ValueError(f"{name} block pool: copying rows needs {need} more free blocks of "
                             f"{table.block_size} tokens, {have} are free (num_blocks={table.num_blocks})")
    indices = _IndicesByDevice()
    gathered = [(t, t.index_select(0, indices(src, t.device)))  # read everything before the first write
                for store in cache.all_stores() for t in store.row_tensors()]
    try:  # from the first change on, a failure refuses further steps (naming reset())
        plans = {name: table.select_rows(src, held, lengths) for name, table in cache.tables.items()}
        cache.rows.select(src)
        for name, (old, new) in plans.items():
            for store in cache.layer_stores():
                if new and store.table == name and store.allocated:
                    for t in store.paged_tensors():  # a copied row's blocks are copied into its new blocks
                        t.index_copy_(0, indices(new, t.device), t.index_select(0, indices(old, t.device)))
        for t, data in gathered:
            t[:n] = data
    except BaseException as error:
        cache.mark_unusable(f"copying rows failed half way ({type(error).__name__}: {error})")
        raise


def move_rows(cache, src: list[int]) -> None:
    """Place rows one by one (continuous batching): row ``i`` of ``cache`` becomes row ``src[i]``, or a fresh,
    empty row for a new sequence where ``src[i] == -1``; rows no entry names are released (their blocks return
    to the pools). Paged data does not move (blocks change owner); per-row state (GatedDeltaNet / PLE state,
    QSA ring, token log) is copied for the rows that change place only, one gather per tensor. Afterwards a
    forward may cover any prefix of the rows, and a failed step leaves every row as it was.

    Everything is checked first; a failure while copying refuses further steps, naming `reset()`.
    """
    _check_idle(cache)
    held = cache.rows.count
    kept = [s for s in src if s != -1]
    if len(src) > cache.max_batch_size:
        raise ValueError(f"the cache can hold up to max_batch_size={cache.max_batch_size} rows, asked for {len(src)}")
    if kept and (min(kept) < 0 or max(kept) >= held) or len(set(kept)) != len(kept):
        raise ValueError(f"entries must be distinct rows in [0, {held}) or -1 (a fresh row), got {src}")
    moved = [i for i, s in enumerate(src) if s not in (i, -1)]  # only rows that change place are copied
    gathered = []  # read every moved row before the first write
    if moved:
        sources, indices = [src[i] for i in moved], _IndicesByDevice()
        gathered = [(t, indices(moved, t.device), t.index_select(0, indices(sources, t.device)))
                    for store in cache.all_stores() for t in store.row_tensors()]
    try:  # from the first change on, a failure refuses further steps (naming reset())
        for table in cache.tables.values():
            table.move_rows(src, held)
        cache.rows.move(src)
        for t, rows, data in gathered:
            t.index_copy_(0, rows, data)
        fresh = [i for i, s in enumerate(src) if s == -1]
        if fresh:
            for store in cache.layer_stores():
                if store.allocated:
                    store.reset_rows(fresh)
    except BaseException as error:
        cache.mark_unusable(f"moving rows failed half way ({type(error).__name__}: {error})")
        raise
